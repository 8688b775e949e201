"""Collects the examples of README.md and docs/*.md as tests (see tests/docs_examples.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.docs_examples import (
    is_code_example,
    mark_docs_items,
    page_database,
    partial_examples,
    pytest_collect_file,  # noqa: F401  (the Sybil collector)
)

_docs: dict[str, Any] = {
    "items": [],
    "partial": set(),
    "misplaced": {},
    "ran": 0,
    "failed": 0,
    "skipped": 0,
}


#: Pages whose examples are being rewritten on other branches at the time of
#: writing: their examples are skipped here. Empty this set after merging.
PENDING_PAGES: set[str] = set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_docs_items(items)
    for item in items:
        if is_code_example(item) and item.path.name in PENDING_PAGES:
            item.add_marker(pytest.mark.skip(reason="examples rewritten on another branch"))
    _docs["items"] = [item for item in items if is_code_example(item)]
    partial, _docs["misplaced"] = partial_examples(items)
    _docs["partial"] = {item.nodeid for item in partial}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid in _docs["partial"] or not (
        report.when == "call" or (report.when == "setup" and report.skipped)
    ):
        return
    if any(item.nodeid == report.nodeid for item in _docs["items"]):
        if report.passed:
            _docs["ran"] += 1
        elif report.failed:
            _docs["failed"] += 1
        else:
            _docs["skipped"] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _docs["items"]:
        terminalreporter.write_line(
            f"docs examples: {len(_docs['items'])} found, {_docs['ran']} ran and passed, "
            f"{_docs['failed']} failed, {len(_docs['partial'])} marked partial, "
            f"{_docs['skipped']} skipped otherwise"
        )


@pytest.fixture(scope="session")
def _docs_sessions_closed(django_db_setup: None) -> Iterator[None]:
    # Before the test databases are dropped: close LISTEN and advisory sessions.
    import asyncio

    from asgiref.sync import sync_to_async
    from django.db import connections

    import django_dlock as dlock

    yield
    dlock.close_connections()
    # async examples ran Django queries in asgiref's shared sync thread
    asyncio.run(sync_to_async(connections.close_all)())


@pytest.fixture
def docs_example_db(
    request: pytest.FixtureRequest, transactional_db: None, _docs_sessions_closed: None
) -> Iterator[str]:
    """Transactional access to the page's database, with the dlock models routed there."""
    from django.test import override_settings

    from django_dlock.strategies.connection import close_private_connections

    problem = _docs["misplaced"].get(request.node.nodeid)
    if problem is not None:
        pytest.fail(f"misplaced skip marker: {problem}", pytrace=False)

    alias = page_database(request.node.example.document.text)
    try:
        if alias == "default":
            yield alias
        else:
            routers = [f"tests.docs_examples.Route{alias.title()}"]
            with override_settings(DATABASE_ROUTERS=routers):
                yield alias
    finally:
        close_private_connections()  # opened by lock writes inside transaction.atomic


# -- the test databases (here, not in tests/conftest.py: the examples of the
# docs and README.md are collected from here and use the same databases) ----


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix() -> None:
    """Each pytest-xdist worker's databases are named in tests/settings.py (the
    processes a test starts read the same names there): no suffix on top."""


@pytest.fixture(scope="session", autouse=True)
def _test_databases_first(request: pytest.FixtureRequest) -> None:
    """The test databases, set up before any module's fixtures (some add aliases of
    their own: a private cluster, a PgBouncer); not when only the tests of
    tests/unit/ run, which need none."""
    unit = Path(__file__).resolve().parent / "tests" / "unit"
    if all(unit in Path(item.path).resolve().parents for item in request.session.items):
        return
    request.getfixturevalue("django_db_setup")


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None) -> Iterator[None]:
    # Before the test databases are dropped, the LISTEN connections and idle
    # advisory sessions are closed.
    import django_dlock as dlock

    yield
    dlock.close_connections()


#: while a run of ``bash scripts/test`` lasts, its pytest process holds the
#: run's lock, so that a later run's clean-up leaves its databases alone
#: (tests/servers.py)
_run_lock: list[Any] = []


def pytest_configure(config: pytest.Config) -> None:
    import contextlib
    import os

    from tests.servers import RUN_SUFFIX, hold_run_lock

    suffix = os.environ.get("DLOCK_TEST_DB_SUFFIX", "")
    if os.environ.get("PYTEST_XDIST_WORKER") is None and RUN_SUFFIX.fullmatch(suffix):
        # (PostgreSQL down: tests/conftest.py's pytest_sessionstart fails the run, by name)
        with contextlib.suppress(Exception):
            _run_lock.append(hold_run_lock(suffix))
