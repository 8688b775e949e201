"""Lock state follows the database: one test per way it used to drift.

See test_loss.py for the loss table itself (state x operation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

import django_dlock as dlock
from django_dlock import operations as override
from django_dlock import signals
from django_dlock.decorators import fit_key
from django_dlock.keys import MAX_NAME_LENGTH, make_key
from django_dlock.models import Lock as LockRow
from django_dlock.strategies.connection import close_private_connections

from .helpers import in_thread, row, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


@pytest.fixture(autouse=True)
def _close_async_connections():
    # Async code runs its queries in asgiref's shared worker thread: close
    # that thread's connections so the test databases can be dropped.
    yield
    asyncio.run(sync_to_async(connections.close_all)())
    close_private_connections()  # the row strategy's side connection of this thread


def test_name_length_matches_the_column():
    assert LockRow._meta.get_field("name").max_length == MAX_NAME_LENGTH


# -- orphan renewal --------------------------------------------------------------


def test_renewal_stops_when_the_holder_thread_ends(alias, caplog):
    key = "orphan-thread"

    def acquire_and_walk_away():
        assert dlock.lock(key, using=alias, ttl=1, renew=True).acquire(timeout=0)

    caplog.set_level(logging.WARNING, logger="django_dlock")
    in_thread(acquire_and_walk_away)
    # The renewer notices that its holder is gone: the lease runs out.
    wait_until(lambda: not dlock.lock(key, using=alias).locked(), timeout=20)
    assert any(
        "lock:orphan-thread" in r.getMessage() and "ended without releasing" in r.getMessage()
        for r in caplog.records
    )
    assert in_thread(lambda: dlock.lock(key, using=alias).acquire(timeout=0)) is True


def test_renewal_stops_when_the_holder_task_ends(alias):
    key = "orphan-task"

    async def acquire_and_walk_away():
        assert await dlock.lock(key, using=alias, ttl=1, renew=True).aacquire(timeout=0)

    def run():
        asyncio.run(acquire_and_walk_away())

    in_thread(run)
    wait_until(lambda: not dlock.lock(key, using=alias).locked(), timeout=20)


def test_renewal_keeps_a_living_holder(alias):
    # The other side: a holder that is alive keeps its lease past its ttl.
    with dlock.lock("kept-alive", using=alias, ttl=1.5, renew=True) as lk:
        first = row(alias, "lock:kept-alive")
        wait_until(lambda: lk._holdings()[0].renewer.renewals >= 2)
        assert lk.owned() and lk.held()
        assert row(alias, "lock:kept-alive") == first


# -- arguments first, misuse named ------------------------------------------------


def test_extend_checks_its_argument_before_ownership(alias):
    lk = dlock.lock("not-held", using=alias)
    with pytest.raises(ValueError, match="ttl"):
        lk.extend(-1)
    with pytest.raises(ValueError, match="ttl"):
        asyncio.run(lk.aextend(math.nan))
    with pytest.raises(dlock.LockNotOwned):
        lk.extend(5)


@pytest.mark.parametrize("use", ["with", "async with"])
def test_on_fail_skip_is_refused_on_a_with_block(use):
    lk = dlock.lock("skip-with", on_fail="skip")

    async def enter():
        async with lk:
            pass

    with (
        CaptureQueriesContext(connections["default"]) as queries,
        pytest.raises(ValueError, match="skip"),
    ):
        if use == "with":
            with lk:
                pass
        else:
            asyncio.run(enter())
    assert len(queries) == 0


def test_skip_logs_info_only(caplog):
    @dlock.lock("nightly", timeout=0, on_fail="skip")
    def nightly():
        return "ran"

    caplog.set_level(logging.DEBUG, logger="django_dlock")
    with dlock.lock("nightly"):
        assert in_thread(nightly) is None
    skips = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert [r.levelno for r in skips] == [logging.INFO]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- async owned() ---------------------------------------------------------------


def test_aowned_answers_for_the_calling_task(alias):
    async def main():
        lk = dlock.lock("async-owned", using=alias)
        async with lk:
            assert await lk.aowned() is True
            assert await lk.aheld() is True
            assert lk.held() is True
            other = asyncio.create_task(lk.aowned())
            assert await other is False  # another task holds nothing
        assert await lk.aowned() is False

    asyncio.run(main())


def test_held_from_async_code_after_the_lease_ran_out(alias):
    reasons: list[str] = []

    async def main():
        lk = dlock.lock(
            "async-expired", using=alias, ttl=0.3, on_lost=lambda e: reasons.append(str(e))
        )
        assert await lk.aacquire(timeout=0)
        while await sync_to_async(lk.locked)():
            await asyncio.sleep(0.05)
        assert lk.held() is False  # asks the database, off the event loop
        assert await lk.aheld() is False
        assert "expired" in reasons[0] and "could not read" not in reasons[0]
        with pytest.raises(dlock.LockLost):
            await lk.arelease()

    asyncio.run(main())


# -- cancelled async acquire --------------------------------------------------------


def test_cancelled_async_acquire_leaves_no_lock(alias):
    key = "cancelled"
    rounds = 25

    async def acquire_and_release() -> None:
        lk = dlock.lock(key, using=alias, ttl=60)
        if await lk.aacquire(timeout=5):
            await lk.arelease()

    async def attempt(delay: float) -> None:
        # wait_for cancels the attempt after ``delay``, usually while its
        # statement runs in a worker thread.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(acquire_and_release(), delay)

    def run_rounds():
        rng = random.Random(7)
        for _ in range(rounds):
            asyncio.run(attempt(rng.uniform(0.0, 0.004)))
            # Whatever a cancelled attempt took is given back.
            wait_until(lambda: not dlock.lock(key, using=alias).locked(), timeout=10)

    in_thread(run_rounds)


# -- bad input never reaches the driver ----------------------------------------------


def _contended_infinite_wait(alias, strategy):
    key = f"inf-{strategy}"
    got = threading.Event()

    def waiter():
        lk = dlock.lock(key, using=alias, strategy=strategy)
        if strategy == "row":
            with transaction.atomic(using=alias), lk:
                got.set()
        else:
            assert lk.acquire(timeout=math.inf)
            got.set()
            lk.release()

    holder = dlock.lock(key, using=alias, strategy=strategy)
    if strategy == "row":
        atomic = transaction.atomic(using=alias)
        atomic.__enter__()
        holder.acquire()
    else:
        holder.acquire()
    thread = threading.Thread(target=lambda: (waiter(), connections.close_all()))
    thread.start()
    try:
        assert not got.wait(0.3)
    finally:
        if strategy == "row":
            atomic.__exit__(None, None, None)
        else:
            holder.release()
    thread.join(30)
    assert got.is_set()


@pytest.mark.parametrize(
    ("strategy", "db"),
    [
        ("lease", "default"),
        ("lease", "sqlite"),
        ("lease", "mysql"),
        ("advisory", "default"),
        ("row", "default"),
        ("row", "mysql"),
    ],
)
def test_infinite_timeout_waits_like_none(strategy, db):
    _contended_infinite_wait(db, strategy)


def test_advisory_xact_infinite_timeout():
    got = threading.Event()

    def waiter():
        with (
            transaction.atomic(),
            dlock.lock("inf-xact", strategy="advisory_xact", timeout=math.inf),
        ):
            got.set()

    with transaction.atomic(), dlock.lock("inf-xact", strategy="advisory_xact"):
        thread = threading.Thread(target=lambda: (waiter(), connections.close_all()))
        thread.start()
        assert not got.wait(0.3)
    thread.join(30)
    assert got.is_set()


@pytest.mark.parametrize("ttl", [1e12, 1e14, 2e9])
def test_huge_ttl_is_refused_before_sql(alias, ttl):
    with pytest.raises(ValueError, match="at most"):
        dlock.lock("huge", using=alias, ttl=ttl)
    with pytest.raises(ValueError, match="at most"):
        dlock.TaskLock("huge-task", min_hold=ttl)
    with dlock.lock("huge", using=alias) as lk:
        with (
            CaptureQueriesContext(connections[alias]) as queries,
            pytest.raises(ValueError, match="at most"),
        ):
            lk.extend(ttl)
        assert len(queries) == 0
    longest = dlock.lock("huge", using=alias, ttl=1e9)  # the bound itself works
    assert longest.acquire(timeout=0)
    longest.release()


def test_two_part_key_longer_than_the_column_is_refused(alias):
    with pytest.raises(dlock.InvalidLockKey, match="maximum is 300"):
        dlock.lock(("a" * 200, "b" * 200), using=alias)
    longest = ("a" * 140, "b" * 145)
    with dlock.lock(longest, using=alias) as lk:
        stored = LockRow.objects.using(alias).get(name=lk.name).name
        assert stored == lk.name and len(stored) <= MAX_NAME_LENGTH


# -- distinct keys, distinct locks ---------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "db"), [("lease", "default"), ("lease", "sqlite"), ("lease", "mysql")]
)
def test_tuple_and_its_text_are_distinct_locks(strategy, db):
    with dlock.lock(("order", 42), using=db, strategy=strategy) as lk:
        assert lk.name == "lock('order', 42)"
        text = "('order', 42)"
        assert in_thread(lambda: dlock.lock(text, using=db, strategy=strategy).acquire(0)) is True


def test_tuple_and_its_text_are_distinct_row_locks():
    with transaction.atomic(), dlock.lock(("order", 42), strategy="row"):
        assert in_thread(lambda: _row_try("('order', 42)")) is True


def _row_try(key):
    with transaction.atomic():
        return dlock.lock(key, strategy="row").acquire(timeout=0)


def test_hashed_key_cannot_be_named_by_another_input():
    long = "x" * 300
    hashed = fit_key(long)
    assert hashed.startswith("sha256:")
    assert fit_key(hashed) != hashed  # the digest text itself is another key
    assert fit_key("short") == "short"
    assert make_key(fit_key(hashed)).name != make_key(hashed).name


# -- loss reasons ------------------------------------------------------------------


def _reasons(name):
    seen: list[str] = []

    def receiver(sender, name, strategy, reason, **kwargs):
        seen.append(reason)

    signals.lock_lost.connect(receiver, weak=False)
    return seen, receiver


def test_force_release_and_takeover_give_different_reasons(alias):
    seen, receiver = _reasons("lock:reason")
    try:
        lk = dlock.lock("reason", using=alias, ttl=30)
        lk.acquire()
        pk = LockRow.objects.using(alias).get(name="lock:reason").pk
        assert len(override.force_release(alias, pks=[pk], source="command")) == 1
        with pytest.raises(dlock.LockLost, match="force-released"):
            lk.release()

        lk = dlock.lock("reason", using=alias, ttl=0.3)
        lk.acquire()
        wait_until(lambda: not lk.locked())
        assert in_thread(lambda: dlock.lock("reason", using=alias, ttl=30).acquire(0))
        with pytest.raises(dlock.LockLost, match="taken over"):
            lk.extend()
        with pytest.raises(dlock.LockLost):
            lk.release()

        lk = dlock.lock("reason-expired", using=alias, ttl=0.3)
        lk.acquire()
        wait_until(lambda: not lk.locked())
        with pytest.raises(dlock.LockLost, match="expired") as info:
            lk.release()
        assert "taken over" not in str(info.value)
        assert "force-released" in seen[0] and "taken over" not in seen[0]
        assert "taken over" in seen[1]
    finally:
        signals.lock_lost.disconnect(receiver)


# -- the hot path stays cheap ---------------------------------------------------------


def test_held_asks_nothing_and_reentry_renews_once_while_the_lease_surely_runs(alias):
    lk = dlock.lock("cheap", using=alias, ttl=60)
    with lk:
        with CaptureQueriesContext(connections[alias]) as queries:
            assert lk.held()
        assert len(queries) == 0, [q["sql"] for q in queries]
        # a re-entry renews the lease in one statement that checks it is still
        # ours (an operator may have force-released it); leaving it asks nothing
        with CaptureQueriesContext(connections[alias]) as queries, lk:
            assert lk.held()
        assert len(queries) == 1, [q["sql"] for q in queries]


def test_reentry_after_the_lease_ran_out_contends_afresh(alias):
    lk = dlock.lock("reenter-late", using=alias, ttl=0.3)
    # Leaving the outer block raises LockLost: its lease was lost.
    with pytest.raises(dlock.LockLost), lk:
        first = lk.fence
        wait_until(lambda: not lk.locked())
        again = dlock.lock("reenter-late", using=alias, ttl=60)  # same holder and key
        with CaptureQueriesContext(connections[alias]) as queries, again:
            assert lk.fence > first  # acquired afresh, with a new fencing number
            assert lk.held()
        assert len(queries) >= 1  # the database was asked
    assert not lk.held()


# -- settings are read when the lock is used --------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("DLOCK_DEFAULT_STRATEGY", "zookeeper", dlock.StrategyNotSupported),
        ("DLOCK_DEFAULT_TTL", "abc", ValueError),
        ("DLOCK_DEFAULT_TTL", -5, ValueError),
        ("DLOCK_DEFAULT_TIMEOUT", "soon", ValueError),
    ],
)
def test_bad_settings_do_not_break_declaring_locks(setting, value, error):
    with override_settings(**{setting: value}):
        lk = dlock.lock("declared")  # as at import time: no error

        @dlock.lock("declared-decorator")
        def job():
            return 1

        task = dlock.TaskLock("declared-task")
        repr(lk), repr(task)
        with CaptureQueriesContext(connections["default"]) as queries:
            with pytest.raises(error, match=setting):
                lk.acquire()
            with pytest.raises(error, match=setting):
                job()
            if setting == "DLOCK_DEFAULT_TTL":  # a TaskLock fixes strategy and timeout
                with pytest.raises(error, match=setting):
                    task.run(lambda: None)
        assert len(queries) == 0
    # Explicit bad arguments still fail at once.
    with pytest.raises(dlock.StrategyNotSupported):
        dlock.lock("k", strategy="zookeeper")
    with pytest.raises(ValueError):
        dlock.lock("k", ttl="abc")


def test_migration_keeps_fences_increasing_under_the_new_names(alias):
    import importlib
    from types import SimpleNamespace

    from django.apps import apps

    from django_dlock.models import FenceFloor

    migration = importlib.import_module("django_dlock.migrations.0002_two_part_key_names")
    old_name = "lock:('order', 42)"  # a two-part key's name before the change
    with connections[alias].cursor() as cur:
        cur.execute(
            "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
            "VALUES (%s, '', '', %s, NULL, %s)",
            [old_name, 10**12, "2000-01-01 00:00:00"],
        )
    migration.raise_floor(apps, SimpleNamespace(connection=connections[alias]))
    assert FenceFloor.objects.using(alias).get(id=1).value >= 10**12
    with dlock.lock(("order", 42), using=alias) as lk:
        assert lk.fence > 10**12


@pytest.mark.parametrize("db", ["default", "sqlite"])
def test_uncontended_with_costs_its_acquire_and_its_release(db):
    lk = dlock.lock("two-statements", using=db, ttl=60)
    with CaptureQueriesContext(connections[db]) as queries, lk:
        assert lk.held()
    assert len(queries) == 2, [q["sql"] for q in queries]
