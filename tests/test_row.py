"""The ``row`` strategy: ``SELECT ... FOR UPDATE`` on the key's row, PostgreSQL and MariaDB."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import in_thread, run_threads, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ROW = "row"
ROW_ALIASES = ["default", "mysql"]


@pytest.fixture(autouse=True)
def _close_private():
    yield
    close_private_connections()


@pytest.fixture(params=ROW_ALIASES, ids=["postgresql", "mariadb"])
def db(request) -> str:
    return request.param


def other_try(key, alias, **options) -> bool:
    """In another thread and transaction: could the lock be taken now?"""

    def attempt() -> bool:
        with transaction.atomic(using=alias):
            return dlock.lock(key, strategy=ROW, using=alias, **options).acquire(timeout=0)

    return in_thread(attempt)


def rows(alias: str, name: str) -> list[tuple[str, bool]]:
    """(token, free on the database clock) of the rows called ``name``."""
    from django_dlock.models import Lock as LockRow

    found = LockRow.objects.using(alias).filter(name=name)
    free = set(found.expired().values_list("name", flat=True))
    return [(token, n in free) for n, token in found.values_list("name", "token")]


def test_refused_on_sqlite():
    with (
        CaptureQueriesContext(connections["sqlite"]) as queries,
        pytest.raises(dlock.StrategyNotSupported, match="PostgreSQL or MySQL"),
    ):
        dlock.lock("k", strategy=ROW, using="sqlite").acquire()
    assert len(queries) == 0


def test_outside_a_transaction_is_a_clear_error(db):
    with pytest.raises(dlock.DLockError, match=r"transaction\.atomic"):
        dlock.lock("x", strategy=ROW, using=db).acquire()


def test_the_row_is_created_free_and_locked(db):
    with transaction.atomic(using=db):
        lk = dlock.lock("job", strategy=ROW, using=db)
        assert lk.acquire(timeout=0)
        assert lk.held() and lk.owned() and lk.locked()
        assert other_try("job", db) is False
        # a free lease row: empty token, expire_at in the past (database clock)
        assert rows(db, "lock:job") == [("", True)]
    assert not lk.held()
    assert not dlock.lock("job", strategy=ROW, using=db).locked()
    assert other_try("job", db) is True
    assert rows(db, "lock:job") == [("", True)]  # still one row


def test_released_at_commit_and_at_rollback(db):
    seen: dict[str, bool] = {}
    with transaction.atomic(using=db):
        dlock.lock("commit", strategy=ROW, using=db).acquire()
        transaction.on_commit(lambda: seen.setdefault("after", other_try("commit", db)), using=db)
        seen["before"] = other_try("commit", db)
    assert seen == {"before": False, "after": True}
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=db):
        dlock.lock("rollback", strategy=ROW, using=db).acquire()
        assert other_try("rollback", db) is False
        _ = 1 / 0
    assert other_try("rollback", db) is True


def test_explicit_release_is_an_error_and_the_holding_ends_with_the_transaction(db):
    lk = dlock.lock("r", strategy=ROW, using=db)
    with transaction.atomic(using=db):
        lk.acquire()
        with pytest.raises(dlock.DLockError, match="transaction ends"):
            lk.release()
    with transaction.atomic(using=db):
        assert not lk.held()
        assert lk.acquire(timeout=0)
        assert other_try("r", db) is False


def test_timeout_inside_an_outer_atomic_leaves_it_usable(db):
    from django_dlock.models import Lock as LockRow

    with transaction.atomic(using=db):
        dlock.lock("busy", strategy=ROW, using=db).acquire()

        def work() -> list[str]:
            with transaction.atomic(using=db):
                LockRow.objects.using(db).create(name="data:1", expire_at="2000-01-01T00:00:00Z")
                with pytest.raises(dlock.LockTimeout):
                    dlock.lock("busy", strategy=ROW, using=db, timeout=1.2).__enter__()
                LockRow.objects.using(db).create(name="data:2", expire_at="2000-01-01T00:00:00Z")
            found = LockRow.objects.using(db).filter(name__startswith="data:")
            return sorted(found.values_list("name", flat=True))

        assert in_thread(work) == ["data:1", "data:2"]


@pytest.mark.parametrize("timeout", [60, None], ids=["timeout", "forever"])
def test_a_wait_is_handed_over_at_commit(db, timeout):
    go, holding = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic(using=db):
            dlock.lock("handoff", strategy=ROW, using=db).acquire()
            holding.set()
            go.wait(30)
        connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(30)
    result: dict[str, bool] = {}

    def waiter() -> None:
        with transaction.atomic(using=db):
            lk = dlock.lock("handoff", strategy=ROW, using=db)
            result["got"] = lk.acquire(timeout=timeout)
        connections.close_all()

    waiting = threading.Thread(target=waiter)
    waiting.start()
    threading.Event().wait(0.5)
    assert "got" not in result
    go.set()
    thread.join(30)
    waiting.join(60)
    assert result == {"got": True}


def test_a_row_deleted_while_waiting_is_made_again(db):
    from django_dlock.models import Lock as LockRow

    go, holding = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic(using=db):
            dlock.lock("gone", strategy=ROW, using=db).acquire()
            holding.set()
            go.wait(30)
            LockRow.objects.using(db).filter(name="lock:gone").delete()  # as cleanup would
        connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(30)
    result: dict[str, bool] = {}

    def waiter() -> None:
        with transaction.atomic(using=db):
            lk = dlock.lock("gone", strategy=ROW, using=db)
            result["got"] = lk.acquire(timeout=60)
            result["blocks others"] = other_try("gone", db) is False
        close_private_connections()
        connections.close_all()

    waiting = threading.Thread(target=waiter)
    waiting.start()
    threading.Event().wait(0.5)
    go.set()
    thread.join(30)
    waiting.join(60)
    assert result == {"got": True, "blocks others": True}


def test_fences(db):
    fences = []
    for _ in range(5):
        with transaction.atomic(using=db), dlock.lock("f", strategy=ROW, using=db) as lk:
            fences.append(lk.fence)
    if db == "default":  # nextval, taken once the row is locked
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False))
    else:  # a number in the row would be rolled back with the transaction
        assert fences == [None] * 5


def test_many_keys_all_or_none(db):
    with transaction.atomic(using=db):
        dlock.lock("b", strategy=ROW, using=db).acquire()

        def both() -> bool:
            with transaction.atomic(using=db):
                return dlock.lock(["a", "b"], strategy=ROW, using=db).acquire(timeout=0)

        assert in_thread(both) is False
        with dlock.lock(["a", "b"], strategy=ROW, using=db):  # same holder: re-entry of b
            assert other_try("a", db) is False


def test_inspection_holds_nothing(db):
    lk = dlock.lock("look", strategy=ROW, using=db)
    with transaction.atomic(using=db):
        lk.acquire()
    assert not lk.locked()
    assert other_try("look", db) is True


def test_check_e011_row_needs_row_locks():
    from django_dlock.checks import database_messages

    assert [m.id for m in database_messages("row", "x", {}, "sqlite")] == ["dlock.E011"]
    assert database_messages("row", "x", {}, "postgresql") == []
    assert database_messages("row", "x", {}, "mysql") == []
    with override_settings(DLOCK_DEFAULT_STRATEGY="row"):
        from django_dlock.checks import check_strategy_database

        assert check_strategy_database() == []  # the lock database is PostgreSQL


# -- concurrency -----------------------------------------------------------------------


def _db_worker(alias: str, iterations: int) -> None:
    """Read-modify-write of a database counter under the row lock."""
    from django_dlock.models import Lock as LockRow

    counter = LockRow.objects.using(alias)
    for _ in range(iterations):
        with dlock.lock_and_atomic("counter", strategy=ROW, using=alias, timeout=120):
            value = counter.get(name="data:counter").fence
            counter.filter(name="data:counter").update(fence=value + 1)


def _file_worker(alias: str, counter_path: str, iterations: int) -> None:
    counter = procs.FileCounter(counter_path)
    for _ in range(iterations):
        with dlock.lock_and_atomic("counter", strategy=ROW, using=alias, timeout=120):
            counter.increment(pause=0.0002)


def test_threads_exclude_each_other(db):
    from django_dlock.models import Lock as LockRow

    LockRow.objects.using(db).create(name="data:counter", fence=0, expire_at="2000-01-01T00:00:00Z")
    run_threads(_db_worker, [(db, 25)] * 6)
    assert LockRow.objects.using(db).get(name="data:counter").fence == 150


@pytest.mark.slow
def test_processes_exclude_each_other(db, tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    procs.run_all(_file_worker, [(db, counter.path, 200)] * 8)
    assert counter.read() == 8 * 200


def test_asyncio_tasks_exclude_each_other(db):
    state = {"counter": 0, "inside": 0, "overlaps": 0}

    def in_transaction() -> None:
        try:
            with dlock.lock_and_atomic("atasks", strategy=ROW, using=db, timeout=60):
                state["inside"] += 1
                state["overlaps"] += state["inside"] > 1
                value = state["counter"]
                threading.Event().wait(0.001)
                state["counter"] = value + 1
                state["inside"] -= 1
        finally:
            close_private_connections()
            connections.close_all()

    async def task() -> None:
        for _ in range(5):
            await sync_to_async(in_transaction, thread_sensitive=False)()

    async def main() -> None:
        await asyncio.gather(*(task() for _ in range(6)))

    asyncio.run(main())
    assert state == {"counter": 30, "inside": 0, "overlaps": 0}


def _hold_in_transaction(alias: str, ready_path: str) -> None:
    import time

    with transaction.atomic(using=alias):
        dlock.lock("crash", strategy=ROW, using=alias).acquire()
        with open(ready_path, "w") as f:
            f.write("held")
        time.sleep(600)


def test_sigkill_of_the_holder_frees_the_row(db, tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_hold_in_transaction, db, str(ready))
    try:
        wait_until(ready.exists, timeout=60)
        assert other_try("crash", db) is False
        os.kill(proc.pid, signal.SIGKILL)

        def waiter() -> bool:
            with transaction.atomic(using=db):
                return dlock.lock("crash", strategy=ROW, using=db).acquire(timeout=60)

        assert in_thread(waiter) is True
    finally:
        proc.kill()
        proc.join(10)
