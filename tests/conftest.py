from __future__ import annotations

import socket

import pytest

from django_dlock import notify, sessions

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


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """Each pytest-xdist worker's databases are named in tests/settings.py (the
    processes a test starts read the same names there): no suffix on top."""


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup):
    # The test databases, set up for the first test that uses one (the
    # tests of tests/unit/ use none, and set up none). Before they are
    # dropped, the LISTEN connections and idle advisory sessions are closed.
    yield
    notify.stop_all()
    sessions.close_all()


@pytest.fixture(params=DB_ALIASES, ids=[DB_IDS[a] for a in DB_ALIASES])
def alias(request) -> str:
    """Runs a test once per database: PostgreSQL, SQLite and MariaDB."""
    return request.param


@pytest.fixture
def pg() -> str:
    return "default"
