"""``row`` and ``advisory_xact`` on PostgreSQL draw their fencing number when it
is first read, not with the lock.

The lock is then one statement; a holder that reads ``lk.fence`` (or passes
the lock to ``fenced_update``) gets a number drawn at that moment, once per
holding, committed and flushed before it is handed out, and only while the
lock is still held: a transaction that is gone gets ``LockLost``, never a
number that could be above the next holder's. (That such a number survives
a crash of the server: tests/test_outages.py.)
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction
from django.test.utils import override_settings

import django_dlock as dlock
from django_dlock import signals
from django_dlock.strategies.connection import close_private_connections
from django_dlock.tables import FENCE_SEQUENCE

from .helpers import in_thread, wait_until

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default"]),
    # advisory_xact issues numbers only with fencing on
    pytest.mark.usefixtures("_fencing"),
]

STRATEGIES = ["row", "advisory_xact"]


@pytest.fixture(autouse=True)
def _fencing():
    with override_settings(DLOCK_ADVISORY_FENCING=True):
        yield
    close_private_connections()


def last_number() -> int:
    """The sequence's last number (read on a connection of its own: it draws none)."""
    import psycopg

    settings = connections["default"].settings_dict
    with psycopg.connect(
        host=settings["HOST"],
        port=settings["PORT"],
        user=settings["USER"],
        password=settings.get("PASSWORD") or None,
        dbname=settings["NAME"],
        autocommit=True,
    ) as conn:
        row = conn.execute(
            f"SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END "
            f"FROM {FENCE_SEQUENCE}"
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_number_is_drawn_only_when_read_and_once_per_holding(strategy):
    seen: list[object] = []

    def on_acquired(sender, fence, **kw):
        seen.append(fence)

    before = last_number()
    signals.lock_acquired.connect(on_acquired)
    try:
        with transaction.atomic(), dlock.lock("lazy", strategy=strategy) as lk:
            assert last_number() == before  # the lock drew nothing
            assert lk.held() and last_number() == before
            fence = lk.fence
            assert isinstance(fence, int) and fence > before
            # read again, in every way: the same number, no other drawn
            assert lk.fence == fence and lk.fences == {"lock:lazy": fence}
            with dlock.lock("lazy", strategy=strategy) as again:  # a re-entry
                assert again.fence == fence
            assert last_number() == fence
    finally:
        signals.lock_acquired.disconnect(on_acquired)
    # the signal carries the number only when it was drawn with the lock
    assert seen == [None]
    assert lk.fence is None  # no longer held

    with transaction.atomic(), dlock.lock("lazy", strategy=strategy) as lk:
        pass
    assert last_number() == fence  # a holder that never reads draws none


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_number_read_late_is_above_the_earlier_holders_and_below_the_later(strategy):
    """Each holder reads its number as late as it can, while a later holder
    waits for the lock: the numbers still follow the order of the holdings."""
    numbers: list[int] = []
    order: list[str] = []
    first_in = threading.Event()

    def holder(name: str, wait_for: threading.Event | None) -> None:
        try:
            if wait_for is not None:
                wait_for.wait(30)
            with transaction.atomic(), dlock.lock("late", strategy=strategy, timeout=30) as lk:
                order.append(name)
                first_in.set()
                if name == "first":
                    # numbers drawn meanwhile by others, and the later holder waiting
                    for key in range(3):
                        with dlock.lock(f"late-other-{key}", ttl=30) as other:
                            assert other.fence is not None
                    wait_until(lambda: waiting(strategy), timeout=30)
                numbers.append(lk.fence)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=holder, args=("first", None)),
        threading.Thread(target=holder, args=("second", first_in)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert order == ["first", "second"]
    assert len(numbers) == 2 and numbers[0] < numbers[1]


def waiting(strategy: str) -> bool:
    """Whether a session waits for a lock (the second holder, in the server's queue)."""
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND locktype = %s",
            ["advisory" if strategy == "advisory_xact" else "transactionid"],
        )
        row = cur.fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_number_for_a_transaction_that_is_gone(strategy):
    """The holder's session ends (the server ended it) before it reads its
    number; a later holder takes the lock and its number. The first holder's
    read must not draw one after that: LockLost, and the holding is lost."""
    caught: dict[str, object] = {}
    lk = dlock.lock("gone", strategy=strategy)

    def first() -> None:
        try:
            with transaction.atomic():
                assert lk.acquire(timeout=0)
                with connections["default"].cursor() as cur:
                    cur.execute("SELECT pg_backend_pid()")
                    (pid,) = cur.fetchone()
                kill(pid)
                caught["later"] = in_thread(later)
                try:
                    caught["fence"] = lk.fence
                except dlock.LockLost as exc:
                    caught["lost"] = exc
                caught["lk.lost"] = lk.lost
                raise _Leave
        except _Leave:
            pass
        except Exception as exc:  # leaving the block on a dead connection
            caught.setdefault("leaving", exc)
        finally:
            connections.close_all()

    def later() -> int:
        try:
            with transaction.atomic(), dlock.lock("gone", strategy=strategy, timeout=10) as other:
                number = other.fence
                assert number is not None
                return number
        finally:
            connections.close_all()

    thread = threading.Thread(target=first)
    thread.start()
    thread.join(60)
    assert "fence" not in caught, caught
    assert isinstance(caught.get("lost"), dlock.LockLost), caught
    assert caught["lk.lost"] is True
    assert isinstance(caught["later"], int)


class _Leave(Exception):
    pass


def kill(pid: int) -> None:
    """End the backend ``pid`` (from another session) and wait until it is gone."""

    def gone() -> bool:
        with connections["default"].cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
            return cur.fetchone()[0] == 0

    def terminate() -> None:
        try:
            with connections["default"].cursor() as cur:
                cur.execute("SELECT pg_terminate_backend(%s)", [pid])
            wait_until(gone, timeout=30)
        finally:
            connections.close_all()

    in_thread(terminate)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_async_holder_has_its_number_at_once(strategy):
    """Async code reads ``lk.fence`` on the event loop, where no query may run:
    an async acquire draws it with the lock, in the transaction's thread."""
    import asyncio

    from asgiref.sync import async_to_sync

    async def nested() -> tuple[int | None, int]:
        async with dlock.lock("async-lazy", strategy=strategy) as lk:
            drawn = await asyncio.to_thread(last_number)
            return lk.fence, drawn

    with transaction.atomic():
        fence, drawn = async_to_sync(nested)()
    assert isinstance(fence, int) and fence == drawn
