"""``dlock_cleanup`` under load: a run finishes, and SQLite's busy database is waited for.

* PostgreSQL (and the other databases): a run deletes what was free when it
  began; locks released while it runs are left for the next run, so it
  finishes however fast new rows are freed.
* SQLite: a batch waits for the write lock (within the database's timeout)
  while other connections take locks, instead of failing at once.
"""

from __future__ import annotations

import itertools
import threading
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connections

import django_dlock as dlock
from django_dlock import cleanup

from .helpers import run_threads

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

FREE_AT_START = 300
BATCH = 50


def _rows(alias: str, prefix: str) -> int:
    from django_dlock.models import Lock as LockRow  # (not at import: child processes)

    return LockRow.objects.using(alias).filter(name__startswith=f"lock:{prefix}").count()


def _free_rows(alias: str, count: int, prefix: str) -> None:
    held = [dlock.lock(f"{prefix}:{i}", using=alias) for i in range(count)]
    for lk in held:
        # a timeout: on SQLite another process's write is contention too
        assert lk.acquire(timeout=30)
    for lk in held:
        lk.release()


def test_a_run_ends_with_what_was_free_when_it_began(alias):
    _free_rows(alias, FREE_AT_START, "old")
    fresh = itertools.count()
    batches = 0

    def progress(deleted: int, total: int) -> None:
        # A writer releasing new keys between every two batches.
        nonlocal batches
        batches += 1
        assert 0 < deleted <= BATCH
        if batches > 3 * FREE_AT_START // BATCH:  # the old code chased these forever
            raise AssertionError("the run keeps deleting rows freed after it began")
        _free_rows(alias, 5, f"new:{next(fresh)}")

    total = cleanup.delete_free(alias, batch_size=BATCH, progress=progress)
    assert total == FREE_AT_START
    assert batches >= FREE_AT_START // BATCH
    assert _rows(alias, "new:") == 5 * batches  # freed during the run: kept for the next one


def test_a_run_finishes_while_threads_keep_releasing_new_keys(pg):
    _free_rows(pg, FREE_AT_START, "old")
    stop = threading.Event()
    finished = threading.Event()

    def churn(i: int) -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            with dlock.lock(f"churn:{i}:{n}", using=pg):
                pass

    def run_cleanup(_: int) -> None:
        try:
            out = StringIO()
            call_command("dlock_cleanup", using=pg, batch_size=BATCH, stdout=out)
            assert "Deleted" in out.getvalue()
            finished.set()
        finally:
            stop.set()

    def guard(_: int) -> None:
        stop.wait(120)  # a bound for the old code, which ran until the writers stopped
        stop.set()

    run_threads(
        lambda i: (churn if i < 3 else run_cleanup if i == 3 else guard)(i),
        [(i,) for i in range(5)],
    )
    assert finished.is_set()


def churn_until(alias: str, stop_file: str, ready_file: str) -> None:
    """In a child process: take and release locks until ``stop_file`` exists (at most 120 s)."""
    import os
    import time

    ends = time.monotonic() + 120
    n = 0
    while not os.path.exists(stop_file) and time.monotonic() < ends:
        n += 1
        with dlock.lock(f"sq-churn:{os.getpid()}:{n % 20}", using=alias, timeout=30):
            pass
        if n == 20:
            open(ready_file, "w").close()


@pytest.mark.slow
def test_sqlite_cleanup_waits_for_the_write_lock_while_another_process_takes_locks(tmp_path):
    from . import procs
    from .helpers import wait_until

    alias = "sqlite"
    stop_file, ready_file = str(tmp_path / "stop"), str(tmp_path / "ready")
    children = [procs.start(churn_until, alias, stop_file, ready_file) for _ in range(2)]
    try:
        wait_until(lambda: (tmp_path / "ready").exists(), timeout=60)
        assert all(child.is_alive() for child in children)
        for round_ in range(5):
            _free_rows(alias, 100, f"round:{round_}")
            call_command("dlock_cleanup", using=alias, batch_size=10, stdout=StringIO())
        assert _rows(alias, "round:") == 0
    finally:
        (tmp_path / "stop").touch()
        for child in children:
            child.join(60)
        connections[alias].close()
    assert [child.exitcode for child in children] == [0, 0]
