"""The ``advisory_xact`` strategy: transaction-scoped advisory locks, and ``lock_and_atomic``."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

import django_dlock as dlock
from django_dlock.keys import hash32
from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.connection import close_private_connections

from .helpers import in_thread, pg_locks, run_threads

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

XACT = "advisory_xact"


@pytest.fixture(autouse=True)
def _close_private():
    yield
    close_private_connections()
    sessions.close_all()  # idle sessions of the advisory strategy


def other_try(key, **options) -> bool:
    """In another thread and transaction: could the lock be taken now?"""

    def attempt() -> bool:
        with transaction.atomic():
            return dlock.lock(key, strategy=XACT, **options).acquire(timeout=0)

    return in_thread(attempt)


def lock_timeout() -> str:
    with connections["default"].cursor() as cur:
        cur.execute("SHOW lock_timeout")
        return str(cur.fetchone()[0])


def test_outside_a_transaction_is_a_clear_error():
    lk = dlock.lock("x", strategy=XACT)
    with CaptureQueriesContext(connections["default"]) as queries:
        with pytest.raises(dlock.DLockError, match=r"transaction\.atomic") as info:
            lk.acquire()
        assert "lock_and_atomic" in str(info.value)
        with pytest.raises(dlock.DLockError, match=r"transaction\.atomic"), lk:
            pass
    assert len(queries) == 0


def test_held_until_commit_exactly():
    seen: dict[str, bool] = {}
    with transaction.atomic():
        lk = dlock.lock("commit", strategy=XACT)
        assert lk.acquire(timeout=0)
        assert lk.held() and lk.owned() and lk.locked()
        assert len(pg_locks("commit")) == 1
        assert other_try("commit") is False
        transaction.on_commit(lambda: seen.setdefault("after commit", other_try("commit")))
        seen["last statement"] = other_try("commit")
    assert seen == {"last statement": False, "after commit": True}
    assert not lk.held() and not lk.owned()  # the holding ended with the transaction
    assert pg_locks("commit") == []


def test_held_until_rollback_exactly():
    lk = dlock.lock("rollback", strategy=XACT)
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        lk.acquire()
        assert other_try("rollback") is False
        _ = 1 / 0
    assert not lk.held()
    assert other_try("rollback") is True


def test_leaving_the_block_keeps_the_lock_until_commit():
    with transaction.atomic():
        with dlock.lock("block", strategy=XACT) as lk:
            assert lk.held()
        assert not lk.held()  # the holding ended ...
        assert other_try("block") is False  # ... the database keeps the lock
    assert other_try("block") is True


def test_explicit_release_is_an_error():
    with transaction.atomic():
        lk = dlock.lock("norelease", strategy=XACT)
        lk.acquire()
        with pytest.raises(dlock.DLockError, match="transaction ends"):
            lk.release()
        with pytest.raises(dlock.DLockError, match="transaction ends"):
            asyncio.run(lk.arelease())
        assert lk.held()


def test_a_holding_never_outlives_its_transaction():
    lk = dlock.lock("again", strategy=XACT)
    with transaction.atomic():
        lk.acquire()  # never released: the commit ends it
    with transaction.atomic():
        assert not lk.held()
        assert lk.acquire(timeout=0)  # a real acquisition, not a re-entry
        assert len(pg_locks("again")) == 1
        assert other_try("again") is False
    assert other_try("again") is True


def test_rolled_back_savepoint_ends_the_holding():
    lk = dlock.lock("sp", strategy=XACT)
    with transaction.atomic():
        with pytest.raises(KeyError), transaction.atomic():
            lk.acquire()
            assert lk.held()
            raise KeyError("inner")
        # PostgreSQL released the lock with the savepoint, and the holding is gone.
        assert not lk.held()
        assert pg_locks("sp") == []
        with transaction.atomic():  # a committed savepoint passes the lock on
            lk.acquire()
        assert lk.held() and other_try("sp") is False
    assert other_try("sp") is True


def test_timeout_inside_an_outer_atomic_leaves_it_usable_and_lock_timeout_unchanged():
    from django_dlock.models import Lock as LockRow

    with transaction.atomic():
        dlock.lock("busy", strategy=XACT).acquire()

        def work() -> tuple[list[str], list[str]]:
            timeouts = []
            with transaction.atomic():
                with connections["default"].cursor() as cur:
                    cur.execute("SET LOCAL lock_timeout = '7s'")
                LockRow.objects.create(name="data:before", expire_at="2000-01-01T00:00:00Z")
                with pytest.raises(dlock.LockTimeout):
                    dlock.lock("busy", strategy=XACT, timeout=0.2).__enter__()
                timeouts.append(lock_timeout())
                with dlock.lock("free", strategy=XACT, timeout=5):  # a successful wait path
                    timeouts.append(lock_timeout())
                LockRow.objects.create(name="data:after", expire_at="2000-01-01T00:00:00Z")
            names = LockRow.objects.filter(name__startswith="data:").values_list("name", flat=True)
            return sorted(names), timeouts

        names, timeouts = in_thread(work)
    assert names == ["data:after", "data:before"]
    assert timeouts == ["7s", "7s"]


def test_shared_and_exclusive():
    with transaction.atomic():
        reader = dlock.lock("doc", strategy=XACT, shared=True)
        reader.acquire()
        assert other_try("doc", shared=True) is True
        assert other_try("doc") is False
        assert [mode for _, mode in pg_locks("doc")] == ["ShareLock"]
        assert reader.owned()
    with transaction.atomic():
        dlock.lock("doc", strategy=XACT).acquire()
        assert other_try("doc", shared=True) is False


@pytest.mark.parametrize(
    ("key", "parts"),
    [((-(2**31), 2**31 - 1), (-(2**31), 2**31 - 1)), (("order", 42), (hash32("order"), 42))],
)
def test_two_part_keys_show_as_classid_objid(key, parts):
    a, b = parts
    with transaction.atomic(), dlock.lock(key, strategy=XACT):
        with connections["default"].cursor() as cur:
            cur.execute(
                "SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks "
                "WHERE locktype = 'advisory' AND granted AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            assert cur.fetchall() == [(a & 0xFFFFFFFF, b & 0xFFFFFFFF, 2)]
        # advisory (session) and advisory_xact share PostgreSQL's advisory key space
        assert in_thread(lambda: dlock.lock(key, strategy="advisory").acquire(timeout=0)) is False


def test_fencing_is_opt_in():
    with transaction.atomic(), dlock.lock("f", strategy=XACT) as lk:
        assert lk.fence is None
    fences = []
    with override_settings(DLOCK_ADVISORY_FENCING=True):
        for _ in range(5):
            with transaction.atomic(), dlock.lock("f", strategy=XACT, timeout=5) as lk:
                fences.append(lk.fence)
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False))


def test_not_supported_on_sqlite_and_mysql():
    for alias in ("sqlite", "mysql"):
        with pytest.raises(dlock.StrategyNotSupported, match="needs PostgreSQL"):
            dlock.lock("k", strategy=XACT, using=alias).acquire()


def test_decorator_inside_a_transaction():
    calls: list[int] = []

    @dlock.lock("decorated", strategy=XACT, timeout=0, on_fail="skip")
    def job(n: int) -> int:
        calls.append(n)
        return n

    with transaction.atomic():
        assert job(1) == 1
        assert other_try("decorated") is False  # kept until commit
    assert calls == [1]


# -- lock_and_atomic -------------------------------------------------------------------


def _counter_value(name: str) -> int:
    from django_dlock.models import Lock as LockRow

    return LockRow.objects.get(name=name).fence


def _increment_in_db(key: str, name: str, iterations: int, strategy: str = XACT) -> None:
    """Read-modify-write of a database counter, one committed transaction per lock."""
    from django_dlock.models import Lock as LockRow

    for _ in range(iterations):
        with dlock.lock_and_atomic(key, strategy=strategy, timeout=120):
            value = LockRow.objects.get(name=name).fence
            LockRow.objects.filter(name=name).update(fence=value + 1)


def _make_counter(name: str) -> None:
    from django_dlock.models import Lock as LockRow

    LockRow.objects.create(name=name, fence=0, expire_at="2000-01-01T00:00:00Z")


@pytest.mark.parametrize("strategy", [XACT, "advisory", "lease"])
def test_lock_and_atomic_commits_before_the_lock_goes(strategy):
    # If the lock passed on before the commit, the next holder would read the
    # old value and an increment would be lost.
    _make_counter("data:counter")
    run_threads(_increment_in_db, [("counter", "data:counter", 25, strategy)] * 4)
    assert _counter_value("data:counter") == 100


def test_lock_and_atomic_timeout_writes_nothing():
    with transaction.atomic():
        dlock.lock("taken", strategy=XACT).acquire()

        def attempt() -> None:
            with dlock.lock_and_atomic("taken", strategy=XACT, timeout=0.1):
                raise AssertionError("must not run")

        with pytest.raises(dlock.LockTimeout):
            in_thread(attempt)


def test_lock_and_atomic_inside_an_outer_transaction(caplog):
    with caplog.at_level("WARNING", logger="django_dlock"), transaction.atomic():
        with dlock.lock_and_atomic("nested", strategy=XACT):
            pass
        assert other_try("nested") is False  # held until the outer commit
        assert "outer transaction" not in caplog.text
        with dlock.lock_and_atomic("nested-lease", strategy="lease"):
            pass
        assert "outer transaction" in caplog.text  # the writes would commit after release


def test_lock_and_atomic_as_a_decorator():
    @dlock.lock_and_atomic("deco", strategy=XACT)
    def work() -> bool:
        return connections["default"].in_atomic_block and other_try("deco") is False

    assert work() is True
    assert other_try("deco") is True


# -- concurrency -----------------------------------------------------------------------


def test_async_with_inside_a_sync_transaction_and_tasks_sharing_it():
    # An async function nested in a sync transaction (async_to_sync) locks in
    # that transaction; two of its tasks still exclude each other.
    order: list[str] = []

    async def nested() -> tuple[bool, bool]:
        first_in = asyncio.Event()
        first_may_leave = asyncio.Event()

        async def first() -> None:
            async with dlock.lock("shared-txn", strategy=XACT):
                order.append("first in")
                first_in.set()
                await first_may_leave.wait()
                order.append("first out")

        task = asyncio.create_task(first())
        await first_in.wait()
        blocked = await asyncio.create_task(
            dlock.lock("shared-txn", strategy=XACT).aacquire(timeout=0)
        )
        with pytest.raises(dlock.DLockError, match="shares this database transaction"):
            await asyncio.create_task(dlock.lock("shared-txn", strategy=XACT).aacquire(timeout=5))
        first_may_leave.set()
        await task
        after = await asyncio.create_task(_try_async("shared-txn"))
        return blocked, after

    with transaction.atomic():
        blocked, after = async_to_sync(nested)()
        assert other_try("shared-txn") is False  # held by this transaction
    assert (blocked, after) == (False, True)
    assert order == ["first in", "first out"]


async def _try_async(key: str) -> bool:
    async with dlock.lock(key, strategy=XACT, timeout=0) as lk:
        return lk.held()


def test_pure_async_code_has_no_transaction():
    async def main() -> None:
        with pytest.raises(dlock.DLockError, match=r"transaction\.atomic"):
            async with dlock.lock("async", strategy=XACT):
                pass

    asyncio.run(main())


# -- faults ----------------------------------------------------------------------------
