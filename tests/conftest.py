from __future__ import annotations

import socket

import pytest

DB_ALIASES = ["default", "sqlite", "mysql"]
DB_IDS = {"default": "postgresql", "sqlite": "sqlite", "mysql": "mariadb"}


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return True
    except OSError:
        return False


def pytest_sessionstart(session: pytest.Session) -> None:
    # The suite runs against real servers: a missing one is a failure, never a skip.
    from django.conf import settings

    missing = []
    for alias in ("default", "mysql"):
        db = settings.DATABASES[alias]
        if not _reachable(db["HOST"], int(db["PORT"])):
            missing.append(f"{alias} ({db['ENGINE']} at {db['HOST']}:{db['PORT']})")
    if missing:
        pytest.exit("database server(s) unreachable: " + ", ".join(missing), returncode=3)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test run once per database (the ``alias`` parameter) flushes only
    that database, not the three its module declares for all its tests."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        alias = callspec.params.get("alias") if callspec is not None else None
        marker = item.get_closest_marker("django_db")
        if alias not in DB_ALIASES or marker is None:
            continue
        if sorted(marker.kwargs.get("databases") or []) != sorted(DB_ALIASES):
            continue  # the test says itself which databases it uses
        item.add_marker(
            pytest.mark.django_db(
                transaction=marker.kwargs.get("transaction", False), databases=[alias]
            )
        )


@pytest.fixture(params=DB_ALIASES, ids=[DB_IDS[a] for a in DB_ALIASES])
def alias(request) -> str:
    """Runs a test once per database: PostgreSQL, SQLite and MariaDB."""
    return request.param


@pytest.fixture
def pg() -> str:
    return "default"
