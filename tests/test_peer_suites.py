"""The peers' own lock test suites, ported: what redis-py's ``Lock``,
python-redis-lock, django-pglock and Kubernetes client-go's leader election
check in their test suites, checked against django-dlock on the real
databases (the lease strategy on PostgreSQL, SQLite and MariaDB; advisory,
advisory_xact and row where the peer is django-pglock; LeaderElection for
client-go).

Our own tests written from the peers' behaviours, not their code. Where we
deliberately differ (the "Coming from another library" page), the test asserts our documented
behaviour and its docstring names the difference.

Every test runs twice: quietly here, and (marked ``slow``) in
tests/test_peer_suites_loaded.py while background load runs against the
test's database: threads that acquire and release other
keys, and a process that keeps a CPU busy. The load is bounded and stopped
at the end of each test; an error it meets fails the test. On SQLite each
load thread rests a little between its locks (``SQLITE_LOAD_PAUSE``): SQLite
has one writer at a time and no queue for it, so writers that take it back
to back starve the others whatever the lock library does.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from io import StringIO
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import IntegrityError, connections, transaction

import django_dlock as dlock
from django_dlock.identity import current_holder
from django_dlock.keys import make_key, pg_locks_ids
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import HeldInThread, expire_now, in_thread, pg_locks, publish, row, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


# -- load: the same tests while other holders hammer the same databases -----------

LOAD_THREADS = 4
LOAD_BOUND = 600.0  # seconds: the load stops by itself after this, whatever happens
#: seconds each load thread rests between two acquire/release cycles (0: back to back)
LOAD_PAUSE = float(os.environ.get("DLOCK_PEER_LOAD_PAUSE", "0"))
#: on SQLite, how long each load thread rests between two of its locks.
#: SQLite has one writer at a time and no queue for it: writers that take
#: it back to back starve the others (a try-once on a free key then says no
#: after its half second, a renewal misses its lease). With this rest, the
#: four threads still write about 200 times a second.
SQLITE_LOAD_PAUSE = float(os.environ.get("DLOCK_PEER_SQLITE_LOAD_PAUSE", "0.02"))

_CPU_BUSY = (
    f"import time\nend = time.monotonic() + {LOAD_BOUND}\nwhile time.monotonic() < end:\n    pass\n"
)


class Load:
    """Background load on ``aliases`` (the test's database): threads that
    acquire and release other keys back to back (some contended among
    themselves), and one process in a CPU busy loop. Errors other than a
    timed-out acquire are kept and raised by :meth:`stop`."""

    def __init__(self, aliases: list[str]) -> None:
        self.aliases = aliases
        self.pause = SQLITE_LOAD_PAUSE if "sqlite" in aliases else LOAD_PAUSE
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.rounds = 0
        self.threads = [
            threading.Thread(target=self._hammer, args=(n,), name=f"peer-load-{n}", daemon=True)
            for n in range(LOAD_THREADS)
        ]
        self.cpu: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.cpu = subprocess.Popen([sys.executable, "-c", _CPU_BUSY])
        for thread in self.threads:
            thread.start()
        # the test starts once the load runs
        wait_until(lambda: self.rounds >= LOAD_THREADS or bool(self.errors), timeout=60)

    def _hammer(self, n: int) -> None:
        end = time.monotonic() + LOAD_BOUND
        i = 0
        try:
            while not self.stopping.is_set() and time.monotonic() < end:
                alias = self.aliases[(n + i) % len(self.aliases)]
                # two threads share each contended key; the others are their own
                key = f"peer-load:{n % 2}" if i % 2 else f"peer-load:own:{n}"
                lk = dlock.lock(key, using=alias, ttl=10, timeout=2, retry_interval=0.02)
                if lk.acquire():
                    lk.release()
                self.rounds += 1
                i += 1
                if self.pause:
                    self.stopping.wait(self.pause)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            close_private_connections()
            connections.close_all()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(60)
        if self.cpu is not None:
            self.cpu.kill()
            self.cpu.wait(30)
        assert not any(t.is_alive() for t in self.threads), "a load thread did not stop"
        if self.errors:
            raise self.errors[0]


def under_load(request: pytest.FixtureRequest) -> Iterator[Load]:
    """Background load on the test's database while the test runs (the
    ``load`` fixture of tests/test_peer_suites_loaded.py)."""
    # set up after the test databases and stopped before they are flushed
    request.getfixturevalue("transactional_db")
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params if callspec is not None else {}
    # the database the test uses (PostgreSQL for the django-pglock ports)
    alias = params.get("alias") or params.get("db") or "default"
    running = Load([alias])
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def load() -> Load | None:
    """No load here: tests/test_peer_suites_loaded.py runs the same tests
    under load (a module of its own, so that the two run side by side)."""
    return None


@pytest.fixture(autouse=True)
def _every_test_both_ways(load: Load | None) -> Load | None:
    return load


# -- helpers -----------------------------------------------------------------------


def seconds_left(alias: str, name: str) -> float:
    """Seconds until the lease ``name`` ends, on the database clock."""
    from django_dlock import operations

    lease = operations.find_lease(alias, name)
    assert lease is not None
    return float(lease.seconds_left)


def steal(alias: str, name: str) -> None:
    """Change the lease's token behind its holder's back (redis-py's
    ``r.set("foo", "a")``)."""
    with connections[alias].cursor() as cur:
        cur.execute("UPDATE django_dlock_lock SET token = 'stolen' WHERE name = %s", [name])
        assert cur.rowcount == 1


def queued(alias: str, name: str) -> int:
    """Live tickets in the waiter queue of ``name``."""
    from django_dlock.models import Waiter

    return Waiter.objects.using(alias).filter(name=name).count()


def elapsed(func: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    result = func()
    return result, time.monotonic() - start


class HeldInTransaction:
    """A thread of its own that takes a transaction-scoped lock inside
    ``transaction.atomic`` and keeps the transaction open until :meth:`release`."""

    def __init__(self, key: str, strategy: str, alias: str = "default") -> None:
        self.acquired = threading.Event()
        self.go = threading.Event()

        def run() -> None:
            try:
                with (
                    transaction.atomic(using=alias),
                    dlock.lock(key, strategy=strategy, using=alias, timeout=10),
                ):
                    self.acquired.set()
                    self.go.wait(60)
            finally:
                connections.close_all()

        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.acquired.wait(30)

    def release(self) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def hold(key: str, strategy: str) -> HeldInThread | HeldInTransaction:
    """Another holder of ``key`` on PostgreSQL with ``strategy``, until released."""
    if strategy in ("advisory_xact", "row"):
        return HeldInTransaction(key, strategy)
    return HeldInThread(dlock.lock(key, strategy=strategy)).wait()


# =================================================================================
# redis-py: tests/test_lock.py (and tests/test_asyncio/test_lock.py)
# =================================================================================


def test_redis_lock_and_release(alias):
    """``test_lock``: a try-once acquire stores the holder's token; release frees the key.
    Differs: redis-py's lock has no expiry by default (ttl -1); ours has
    ``DLOCK_DEFAULT_TTL`` (60 s)."""
    lk = dlock.lock("rp-foo", using=alias)
    assert row(alias, "lock:rp-foo") is None
    assert lk.acquire(blocking=False)
    assert row(alias, "lock:rp-foo")[0] == lk.token
    assert 50 < seconds_left(alias, "lock:rp-foo") <= 60
    lk.release()
    assert not lk.locked()
    assert in_thread(lambda: dlock.lock("rp-foo", using=alias).acquire(blocking=False)) is True


def test_redis_locked(alias):
    """``test_locked``: ``locked()`` is true while anyone holds the key, false after."""
    lk = dlock.lock("rp-locked", using=alias)
    assert lk.locked() is False
    assert lk.acquire(blocking=False)
    assert lk.locked() is True
    assert in_thread(lambda: dlock.lock("rp-locked", using=alias).locked()) is True
    lk.release()
    assert lk.locked() is False


def test_redis_owned(alias):
    """``test_owned``: ``owned()`` is true for the holder only, and false again after
    release, also while another holder has the key. Differs: the owner is the
    thread (two Lock objects in one thread are one owner), so the second lock
    lives in another thread."""
    lk = dlock.lock("rp-owned", using=alias)
    assert lk.owned() is False
    lk.acquire(blocking=False)
    assert lk.owned() is True
    assert in_thread(lambda: dlock.lock("rp-owned", using=alias).owned()) is False
    lk.release()
    assert lk.owned() is False
    other = HeldInThread(dlock.lock("rp-owned", using=alias)).wait()
    try:
        assert lk.owned() is False
        assert lk.locked() is True
    finally:
        other.release()
    assert lk.owned() is False and lk.locked() is False


def test_redis_competing_locks(alias):
    """``test_competing_locks``: while one holder has the key, another's try-once fails;
    after release it succeeds, and the first one's fails. (Two threads: ours
    are owners per thread.)"""
    lk = dlock.lock("rp-compete", using=alias)
    assert lk.acquire(blocking=False)
    assert in_thread(lambda: dlock.lock("rp-compete", using=alias).acquire(blocking=False)) is False
    lk.release()
    other = HeldInThread(dlock.lock("rp-compete", using=alias, timeout=0)).wait()
    try:
        assert lk.acquire(blocking=False) is False
    finally:
        other.release()


@pytest.mark.parametrize("ttl", [10, 9.5])
def test_redis_ttl_int_and_float(alias, ttl):
    """``test_timeout`` / ``test_float_timeout``: the lease lasts the given seconds.
    Differs: redis-py's ``timeout`` is our ``ttl`` (``timeout`` is the wait)."""
    lk = dlock.lock("rp-ttl", using=alias, ttl=ttl)
    assert lk.acquire(blocking=False)
    try:
        assert ttl - 2 < seconds_left(alias, "lock:rp-ttl") <= ttl
    finally:
        lk.release()


def test_redis_blocking_timeout(alias):
    """``test_blocking_timeout`` / ``test_context_manager_blocking_timeout``: a wait for
    a held key gives up after its timeout (not before), returning False.
    Differs: redis-py's ``blocking_timeout`` is our ``timeout``."""
    with dlock.lock("rp-bt", using=alias):
        waiting = dlock.lock("rp-bt", using=alias, timeout=0.4, retry_interval=0.05)
        acquired, took = in_thread(lambda: elapsed(waiting.acquire))
    assert acquired is False
    assert 0.4 <= took < 0.4 + 5


def test_redis_small_timeout_with_a_long_retry_interval(alias):
    """``test_high_sleep_small_blocking_timeout``: a poll interval longer than the
    timeout does not stretch the wait past the timeout."""
    with dlock.lock("rp-sleep", using=alias):
        waiting = dlock.lock("rp-sleep", using=alias, timeout=1, retry_interval=60)
        acquired, took = in_thread(lambda: elapsed(waiting.acquire))
    assert acquired is False
    assert took < 1 + 5


def test_redis_context_manager(alias):
    """``test_context_manager`` (and python-redis-lock's ``test_plain``): the block
    holds the key with this holder's token; leaving it frees the key."""
    with dlock.lock("rp-cm", using=alias, timeout=0.2) as lk:
        assert row(alias, "lock:rp-cm")[0] == lk.token
        assert lk.held()
    assert not lk.locked()


def test_redis_context_manager_raises_when_not_acquired(alias):
    """``test_context_manager_raises_when_locked_not_acquired`` and
    ``test_lock_error_gives_correct_lock_name``: a ``with`` that cannot acquire
    raises, naming the lock. Differs: redis-py raises ``LockError``, ours
    ``LockTimeout``."""
    other = HeldInThread(dlock.lock("rp-cmr", using=alias)).wait()
    try:
        with (
            pytest.raises(dlock.LockTimeout, match="lock:rp-cmr"),
            dlock.lock("rp-cmr", using=alias, timeout=0.1),
        ):
            pytest.fail("the block ran without the lock")
    finally:
        other.release()


def test_redis_leaving_the_block_after_the_lease_ran_out_raises(alias):
    """``test_context_manager_not_raise_on_release_lock_not_owned_error`` (the
    ``raise_on_release_error=True`` half): leaving a block whose lease ran out
    raises. Differs: redis-py ``LockNotOwnedError``, ours ``LockLost``; we
    have no option to silence it."""
    with pytest.raises(dlock.LockLost), dlock.lock("rp-cmlost", using=alias, ttl=300):
        expire_now(alias, "lock:rp-cmlost")
    assert in_thread(lambda: dlock.lock("rp-cmlost", using=alias).acquire(timeout=0)) is True


def test_redis_leaving_the_block_after_a_manual_release_raises(alias):
    """``test_context_manager_not_raise_on_release_lock_error`` (the raising half):
    releasing inside the block, then leaving it, raises ``LockNotOwned``
    (redis-py: ``LockError``); the key is free."""
    lk = dlock.lock("rp-cmrel", using=alias)
    with pytest.raises(dlock.LockNotOwned), lk:
        lk.release()
    assert not lk.locked()


def test_redis_releasing_an_unlocked_lock_raises(alias):
    """``test_releasing_unlocked_lock_raises_error``: ``LockNotOwned``
    (redis-py: ``LockError``)."""
    with pytest.raises(dlock.LockNotOwned):
        dlock.lock("rp-unlocked", using=alias).release()


def test_redis_releasing_a_lock_no_longer_owned_raises_and_forgets_it(alias):
    """``test_releasing_lock_no_longer_owned_raises_error``: the token changed on the
    server; release raises, and the holder forgets the lock anyway. Differs:
    redis-py ``LockNotOwnedError``, ours ``LockLost``."""
    lk = dlock.lock("rp-stolen", using=alias, ttl=300)
    assert lk.acquire(blocking=False)
    steal(alias, "lock:rp-stolen")
    with pytest.raises(dlock.LockLost):
        lk.release()
    assert not lk.held()
    with pytest.raises(dlock.LockNotOwned):
        lk.release()  # forgotten: not held any more


@pytest.mark.parametrize("ttl", [10, 10.5])
def test_redis_extend_sets_the_time_left(alias, ttl):
    """``test_extend_lock`` / ``test_extend_lock_float``: redis-py's ``extend(t)`` adds
    t to the time left (20 s). Differs: ours sets it to t from now (documented)."""
    lk = dlock.lock("rp-extend", using=alias, ttl=ttl)
    assert lk.acquire(blocking=False)
    try:
        lk.extend(ttl)
        assert ttl - 2 < seconds_left(alias, "lock:rp-extend") <= ttl
    finally:
        lk.release()


def test_redis_extend_replace_ttl(alias):
    """``test_extend_lock_replace_ttl``: ``extend(t, replace_ttl=True)`` is our
    ``extend(t)``: the time left becomes t."""
    lk = dlock.lock("rp-replace", using=alias, ttl=10)
    assert lk.acquire(blocking=False)
    try:
        lk.extend(100)
        assert 98 < seconds_left(alias, "lock:rp-replace") <= 100
        lk.extend(10)
        assert 8 < seconds_left(alias, "lock:rp-replace") <= 10
    finally:
        lk.release()


def test_redis_extend_and_reacquire_an_unlocked_lock_raise(alias):
    """``test_extending_unlocked_lock_raises_error`` and
    ``test_reacquiring_unlocked_lock_raises_error``: ``LockNotOwned``
    (redis-py: ``LockError``). ``reacquire()`` is our ``extend()``."""
    lk = dlock.lock("rp-ext-unlocked", using=alias, ttl=10)
    with pytest.raises(dlock.LockNotOwned):
        lk.extend(10)
    with pytest.raises(dlock.LockNotOwned):
        lk.extend()


def test_redis_extend_a_lock_without_a_ttl(alias):
    """``test_extending_lock_with_no_timeout_raises_error``,
    ``test_reacquiring_lock_with_no_timeout_raises_error`` and
    ``test_context_manager_reacquiring_lock_with_no_timeout_raises_error``
    (python-redis-lock: ``test_extend_lock_without_expire_fail``): a lock with
    no expiry cannot be extended there. Differs: every lease has a TTL
    (``ttl=None`` is ``DLOCK_DEFAULT_TTL``), so extend works."""
    with dlock.lock("rp-nottl", using=alias, ttl=None) as lk:
        lk.extend()
        assert 58 < seconds_left(alias, "lock:rp-nottl") <= 60
        lk.extend(10)
        assert 8 < seconds_left(alias, "lock:rp-nottl") <= 10


def test_redis_extend_and_reacquire_a_lock_no_longer_owned_raise(alias):
    """``test_extending_lock_no_longer_owned_raises_error`` and
    ``test_reacquiring_lock_no_longer_owned_raises_error``: the token changed on
    the server. Differs: redis-py ``LockNotOwnedError``, ours ``LockLost``,
    and nothing is changed."""
    for call in ("extend(10)", "extend()"):
        lk = dlock.lock("rp-ext-stolen", using=alias, ttl=10)
        assert lk.acquire(blocking=False)
        steal(alias, "lock:rp-ext-stolen")
        with pytest.raises(dlock.LockLost):
            lk.extend(10) if call == "extend(10)" else lk.extend()
        assert row(alias, "lock:rp-ext-stolen")[0] == "stolen", call
        with connections[alias].cursor() as cur:
            cur.execute("DELETE FROM django_dlock_lock WHERE name = 'lock:rp-ext-stolen'")


def test_redis_reacquire_resets_the_lease(alias):
    """``test_reacquire_lock`` (python-redis-lock: ``test_extend_lock_default_expire``):
    the lease, shortened meanwhile, is set back to the lock's full ttl."""
    lk = dlock.lock("rp-reacquire", using=alias, ttl=10)
    assert lk.acquire(blocking=False)
    try:
        lk.extend(5)
        assert seconds_left(alias, "lock:rp-reacquire") <= 5
        lk.extend()
        assert 8 < seconds_left(alias, "lock:rp-reacquire") <= 10
    finally:
        lk.release()


def test_redis_leaving_the_block_after_the_token_changed_raises(alias):
    """``test_context_manager_reacquiring_lock_no_longer_owned_raises_error``:
    the token changed inside the block. Differs: ``LockLost`` on leaving it
    (redis-py: ``LockNotOwnedError``)."""
    with pytest.raises(dlock.LockLost), dlock.lock("rp-cm-stolen", using=alias, ttl=10):
        steal(alias, "lock:rp-cm-stolen")
    assert row(alias, "lock:rp-cm-stolen")[0] == "stolen"


def test_redis_release_from_another_thread_on_purpose(alias):
    """``test_lock_token_thread_local_false``: redis-py shares the token between
    threads with ``thread_local=False``. Ours: another thread's ``release()``
    raises ``LockNotOwned``; ``release_for(holder)`` releases on purpose."""
    lk = dlock.lock("rp-shared-token", using=alias)
    assert lk.acquire(blocking=False)
    holder = current_holder()
    with pytest.raises(dlock.LockNotOwned):
        in_thread(lk.release)
    assert lk.locked()
    in_thread(lk.release_for, holder)
    assert not lk.locked()


def test_redis_async_competing_tasks(alias):
    """The asyncio suite's ``test_competing_locks`` and ``test_owned``: two tasks are
    two owners (ours: per task; redis-py: per lock object)."""

    async def scenario() -> list[Any]:
        lk = dlock.lock("rp-async", using=alias)
        got, done = asyncio.Event(), asyncio.Event()
        seen: list[Any] = []

        async def first() -> None:
            seen.append(await lk.aacquire(blocking=False))
            seen.append(await lk.aowned())
            got.set()
            await done.wait()
            await lk.arelease()

        async def second() -> None:
            await got.wait()
            seen.append(await lk.aacquire(blocking=False))
            seen.append(await lk.aowned())
            done.set()

        await asyncio.gather(first(), second())
        seen.append(await lk.aacquire(blocking=False))
        await lk.arelease()
        return seen

    assert async_to_sync(scenario)() == [True, True, False, False, True]


def test_redis_async_release_cancelled_leaves_no_lock_behind(alias):
    """The asyncio suite's ``test_release_cancellation_preserves_lock_state``: a
    release cancelled at once must not leave the key locked for good. Ours
    runs a cancelled release to the end: the key becomes free without another
    call."""

    async def scenario() -> bool:
        lk = dlock.lock("rp-cancel", using=alias)
        assert await lk.aacquire(blocking=False)
        assert await lk.aowned()
        try:
            async with asyncio.timeout(0):
                await lk.arelease()
        except TimeoutError:
            pass  # cancelled: the release goes on by itself
        return await lk.aheld()

    assert async_to_sync(scenario)() is False
    lk = dlock.lock("rp-cancel", using=alias)
    wait_until(lambda: not lk.locked())
    assert in_thread(lambda: dlock.lock("rp-cancel", using=alias).acquire(timeout=0)) is True


# =================================================================================
# python-redis-lock: tests/test_redis_lock.py
# =================================================================================


def _hold_in_child(alias: str, key: str, ready: str, go: Any) -> None:
    """A child process: hold ``key``, publish the token to ``ready``, wait for ``go``."""
    with dlock.lock(key, using=alias, ttl=60, timeout=60) as lk:
        publish(ready, lk.token)
        assert go.wait(120)


@pytest.mark.slow
def test_prl_held_by_another_process(alias, tmp_path):
    """``test_no_block``, ``test_timeout_acquired``, ``test_simple``: another process
    holds the key: a try-once fails, a wait longer than its hold succeeds
    once it releases."""
    ctx = procs.multiprocessing.get_context("spawn")
    go = ctx.Event()
    ready = tmp_path / "ready"
    child = procs.start(_hold_in_child, alias, "prl-proc", str(ready), go)
    try:
        wait_until(ready.exists, timeout=60)
        lk = dlock.lock("prl-proc", using=alias)
        assert lk.acquire(blocking=False) is False
        assert row(alias, "lock:prl-proc")[0] == ready.read_text()
        go.set()
        assert lk.acquire(timeout=30) is True
        lk.release()
    finally:
        go.set()
        child.join(60)
    assert child.exitcode == 0


def test_prl_timeout(alias):
    """``test_timeout``: a wait for a held key returns False after its timeout."""
    with dlock.lock("prl-timeout", using=alias):
        assert in_thread(lambda: dlock.lock("prl-timeout", using=alias).acquire(timeout=1)) is False


def _abandon(alias: str, key: str, **options: Any) -> None:
    """Acquire ``key`` in a thread that then ends without releasing it."""
    assert in_thread(lambda: dlock.lock(key, using=alias, **options).acquire(timeout=0)) is True


def test_prl_timeout_expire(alias):
    """``test_timeout_expire`` and ``test_expire_without_timeout``: a lease nobody
    releases runs out; a try-once fails before, a longer wait gets it."""
    _abandon(alias, "prl-expire", ttl=1.5)
    lk = dlock.lock("prl-expire", using=alias, ttl=1)
    assert lk.acquire(blocking=False) is False
    assert lk.acquire(timeout=30) is True
    lk.release()


def test_prl_timeout_expire_with_renewal(alias):
    """``test_timeout_expire_with_renewal``: a renewed lease does not run out: a wait
    longer than its ttl fails."""
    holder = HeldInThread(dlock.lock("prl-renewed", using=alias, ttl=1.5, renew=True)).wait()
    try:
        assert in_thread(lambda: dlock.lock("prl-renewed", using=alias).acquire(timeout=3)) is False
        assert holder.lk.locked()
    finally:
        holder.release()


def test_prl_blocking_false_wins_over_a_timeout(alias):
    """``test_not_usable_timeout``: python-redis-lock refuses ``blocking=False`` with a
    timeout (``TimeoutNotUsable``). Ours: ``blocking=False`` is one try, the
    timeout is not waited."""
    with dlock.lock("prl-nb", using=alias):
        waiting = dlock.lock("prl-nb", using=alias)
        acquired, took = in_thread(lambda: elapsed(lambda: waiting.acquire(False, timeout=30)))
    assert acquired is False and took < 30


def test_prl_a_ttl_shorter_than_the_wait(alias):
    """``test_expire_less_than_timeout``: python-redis-lock refuses ``expire`` shorter
    than the wait (``TimeoutTooLarge``) unless renewed. Ours accepts it: a
    waiter's lease counts from the statement that granted it, so a renewed
    waiter that queued longer than its ttl holds a live lease, is not
    reported lost, and releases without error."""
    holder = HeldInThread(dlock.lock("prl-short", using=alias)).wait()
    lost: list[Any] = []
    waiter = dlock.lock("prl-short", using=alias, ttl=1.5, renew=True, on_lost=lost.append)
    box: dict[str, Any] = {}

    def wait_for_it() -> None:
        try:
            box["acquired"] = waiter.acquire(timeout=60)
            box["lost"] = waiter.lost
            box["owned"] = waiter.owned()
            waiter.release()
        except BaseException as exc:
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=wait_for_it)
    start = time.monotonic()
    thread.start()
    try:
        wait_until(lambda: queued(alias, "lock:prl-short") == 1, timeout=30)
        # the waiter queues for more than its ttl: the scene itself, not a sync
        wait_until(lambda: time.monotonic() - start > 2.5, timeout=30)
    finally:
        holder.release()
    thread.join(60)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    assert box == {"acquired": True, "lost": False, "owned": True}
    assert lost == []


def test_prl_invalid_timeout_and_ttl(alias):
    """``test_invalid_timeout``, ``test_timeout_int_conversion``,
    ``test_expire_int_conversion``, ``test_borken_expires`` (django-pglock:
    ``test_timeout_args``): negative values are refused. Differs: strings are
    refused too (no conversion), and a ttl of 0 is a ``ValueError`` (there it
    means no expiry)."""
    for bad in (-1, -123, "0", "123", "foobar"):
        with pytest.raises(ValueError, match="timeout"):
            dlock.lock("prl-bad", using=alias, timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            dlock.lock("prl-bad", using=alias).acquire(timeout=bad)
    for bad in (-1, -123, "-1", "1", 0):
        with pytest.raises(ValueError, match="ttl"):
            dlock.lock("prl-bad", using=alias, ttl=bad)
    lk = dlock.lock("prl-bad", using=alias)
    for bad in (-1, -123, "-1"):
        with pytest.raises(ValueError, match="ttl"):
            lk.extend(bad)  # checked first, held or not
    assert lk.acquire(timeout=0)
    lk.release()


def test_prl_extend_sets(alias):
    """``test_extend``: ``extend(expire=1000)`` sets the time left (both libraries)."""
    with dlock.lock("prl-extend", using=alias, ttl=100) as lk:
        assert seconds_left(alias, "lock:prl-extend") <= 100
        lk.extend(1000)
        assert 990 < seconds_left(alias, "lock:prl-extend") <= 1000


def test_prl_another_instance_of_the_same_owner(alias):
    """``test_extend_another_instance``, ``test_given_id``, ``test_bogus_release``:
    another Lock object with the lock's ``id`` can extend and release it.
    Differs: the owner is the thread, not an id: another Lock object in the
    same thread is the same owner (and acquiring through it counts a
    re-entry instead of raising ``AlreadyAcquired``)."""
    orig = dlock.lock("prl-same", using=alias, ttl=100)
    assert orig.acquire()
    again = dlock.lock("prl-same", using=alias, ttl=100)
    again.extend(1000)
    assert seconds_left(alias, "lock:prl-same") > 100
    assert again.acquire(timeout=0)  # a re-entry, counted
    again.release()
    again.release()  # the last level: released by another object
    assert not orig.locked()
    with pytest.raises(dlock.LockNotOwned):
        orig.release()


def test_prl_another_owner_cannot_extend_or_release(alias):
    """``test_extend_another_instance_different_id_fail`` and the first half of
    ``test_bogus_release``: another owner cannot extend or release
    (``LockNotOwned``; python-redis-lock ``NotAcquired``); nothing changes."""
    lk = dlock.lock("prl-other", using=alias, ttl=100)
    with pytest.raises(dlock.LockNotOwned):
        lk.release()
    lk.acquire()
    try:
        other = dlock.lock("prl-other", using=alias)
        with pytest.raises(dlock.LockNotOwned):
            in_thread(other.extend, 1000)
        with pytest.raises(dlock.LockNotOwned):
            in_thread(other.release)
        assert seconds_left(alias, "lock:prl-other") <= 100
        assert lk.owned()
    finally:
        lk.release()


def test_prl_double_acquire(alias):
    """``test_double_acquire``: python-redis-lock raises ``AlreadyAcquired``. Differs:
    ours counts a re-entry; ``reentrant=False`` raises ``LockReentrantError``."""
    lk = dlock.lock("prl-double", using=alias)
    with lk:
        assert lk.acquire()
        lk.release()
        assert lk.held()
    strict = dlock.lock("prl-double", using=alias, reentrant=False)
    with strict, pytest.raises(dlock.LockReentrantError):
        strict.acquire()
    assert not strict.locked()


def test_prl_enter_a_held_lock_without_blocking(alias):
    """``test_enter_already_acquired_with_not_blocking``: a non-blocking ``with`` on a
    held key raises. Differs: ``LockTimeout`` (python-redis-lock ``NotAcquired``)."""
    with dlock.lock("prl-enter", using=alias):

        def enter() -> None:
            with dlock.lock("prl-enter", using=alias, timeout=0):
                pytest.fail("the block ran without the lock")

        with pytest.raises(dlock.LockTimeout):
            in_thread(enter)


def _take_turns(alias: str, key: str, counter: str, fences: str, rounds: int) -> None:
    """A child process: ``rounds`` times, hold ``key`` and bump the counter in a
    deliberately racy read-modify-write; record each grant's fence."""
    count = procs.FileCounter(counter)
    got: list[str] = []
    for _ in range(rounds):
        with dlock.lock(key, using=alias, ttl=60, timeout=120) as lk:
            count.increment(pause=0.005)
            got.append(str(lk.fence))
    publish(fences, "\n".join(got))


@pytest.mark.slow
def test_prl_no_overlap(alias, tmp_path):
    """``test_no_overlap``: processes that contend for one key never hold it at the
    same time (a racy counter updated under the lock loses no update), and
    every grant has its own, increasing fence."""
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    workers, rounds = 4, 5
    procs.run_all(
        _take_turns,
        [
            (alias, "prl-overlap", counter.path, str(tmp_path / f"fences-{n}"), rounds)
            for n in range(workers)
        ],
        timeout=300,
    )
    assert counter.read() == workers * rounds
    fences = [
        int(f) for n in range(workers) for f in (tmp_path / f"fences-{n}").read_text().split()
    ]
    assert len(set(fences)) == workers * rounds
    for n in range(workers):
        mine = [int(f) for f in (tmp_path / f"fences-{n}").read_text().split()]
        assert mine == sorted(mine)


def _wait_then_hold(alias: str, key: str, got: str, go: Any) -> None:
    """A child process: block on ``key``; once held, say so and hold until ``go``."""
    with dlock.lock(key, using=alias, ttl=60, timeout=120):
        publish(got, "1")
        assert go.wait(120)


@pytest.mark.slow
def test_prl_no_overlap2_one_of_many_blocked(alias, tmp_path):
    """``test_no_overlap2``: of many processes blocked on one key at once, exactly
    one gets it; the others wait (each has its ticket in the queue), and
    each gets it in turn once the holder lets go."""
    ctx = procs.multiprocessing.get_context("spawn")
    go = ctx.Event()
    holder = HeldInThread(dlock.lock("prl-many", using=alias)).wait()
    workers = 4
    got = [tmp_path / f"got-{n}" for n in range(workers)]
    children = [procs.start(_wait_then_hold, alias, "prl-many", str(g), go) for g in got]
    try:
        wait_until(lambda: queued(alias, "lock:prl-many") == workers, timeout=120)
        holder.release()
        wait_until(lambda: sum(g.exists() for g in got) == 1, timeout=30)
        # the one holds; the others still have their tickets
        wait_until(lambda: queued(alias, "lock:prl-many") == workers - 1, timeout=30)
        assert sum(g.exists() for g in got) == 1
        go.set()
        for child in children:
            child.join(120)
    finally:
        go.set()
        for child in children:
            if child.is_alive():
                child.kill()
    assert [c.exitcode for c in children] == [0] * workers
    assert all(g.exists() for g in got)


def test_prl_reset_then_old_holder_release_raises(alias):
    """``test_reset``: after a reset the key is free; the old holder's release fails.
    Ours: ``dlock_release`` (force-release); the old holder gets ``LockLost``
    (python-redis-lock ``NotAcquired``)."""
    lk = dlock.lock("prl-reset", using=alias, ttl=300)
    lk.acquire()
    call_command("dlock_release", "lock:prl-reset", "--using", alias, "--yes", stdout=StringIO())
    assert in_thread(lambda: dlock.lock("prl-reset", using=alias).acquire(timeout=0)) is True
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_prl_reset_all(alias):
    """``test_reset_all``: every held key force-released; each can be taken again.
    Ours has no one-call reset of every lock: ``dlock_release`` per key."""
    lk1 = dlock.lock("prl-reset1", using=alias, ttl=300)
    lk2 = dlock.lock("prl-reset2", using=alias, ttl=300)
    assert lk1.acquire(blocking=False) and lk2.acquire(blocking=False)
    for name in ("lock:prl-reset1", "lock:prl-reset2"):
        call_command("dlock_release", name, "--using", alias, "--yes", stdout=StringIO())

    def both() -> bool:
        a = dlock.lock("prl-reset1", using=alias)
        b = dlock.lock("prl-reset2", using=alias)
        ok = a.acquire(blocking=False) and b.acquire(blocking=False)
        a.release()
        b.release()
        return ok

    assert in_thread(both) is True


def test_prl_owner_token_is_stored(alias):
    """``test_token`` / ``test_get_owner_id``: before acquiring no row names the key;
    after, the row's token is the holder's. (A caller-chosen id is not
    offered.)"""
    lk = dlock.lock("prl-tok", using=alias)
    assert row(alias, "lock:prl-tok") is None
    assert lk.acquire(blocking=False)
    assert row(alias, "lock:prl-tok")[0] == lk.token
    lk.release()


def test_prl_try_once_cycles_leave_no_garbage(alias):
    """``test_release_from_nonblocking_leaving_garbage``: ten try-once cycles leave
    one row for the key and no ticket in the queue."""
    for _ in range(10):
        lk = dlock.lock("prl-garbage", using=alias)
        assert lk.acquire(blocking=False)
        lk.release()
    with connections[alias].cursor() as cur:
        cur.execute("SELECT count(*) FROM django_dlock_lock WHERE name = 'lock:prl-garbage'")
        assert cur.fetchone()[0] == 1
    assert queued(alias, "lock:prl-garbage") == 0
    assert not dlock.lock("prl-garbage", using=alias).locked()


def test_prl_auto_renewal(alias):
    """``test_auto_renewal`` / ``test_simple_auto_renewal``: a renewed lease outlives
    its ttl, renewed more than once, and is still the holder's; release frees it.
    (``test_auto_renewal_bad_values``: ``expire=None`` is refused with renewal;
    ours: ``ttl=None`` is ``DLOCK_DEFAULT_TTL``, renewable.)"""
    from django_dlock.models import Lock as LockRow

    def expire_at() -> datetime.datetime:
        return LockRow.objects.using(alias).get(name="lock:prl-renew").expire_at

    assert dlock.lock("prl-renew", using=alias, ttl=None, renew=True).ttl == 60.0
    lk = dlock.lock("prl-renew", using=alias, ttl=1.5, renew=True)
    with lk:
        first = expire_at()
        wait_until(lambda: (expire_at() - first).total_seconds() >= 1.5, timeout=30)
        assert lk.owned() and not lk.lost
    assert not lk.locked()


def test_prl_reset_wakes_a_blocked_waiter(alias):
    """``test_reset_signalizes``: a reset wakes a waiter blocked on the key.
    Ours: ``dlock_release`` (force-release) grants the key to the waiter."""
    lk = dlock.lock("prl-signal", using=alias, ttl=300)
    lk.acquire()
    box: dict[str, Any] = {}

    def waiter() -> None:
        box["acquired"] = dlock.lock("prl-signal", using=alias).acquire(timeout=60)

    thread = threading.Thread(target=lambda: in_thread(waiter))
    thread.start()
    try:
        wait_until(lambda: queued(alias, "lock:prl-signal") == 1, timeout=30)
        call_command(
            "dlock_release", "lock:prl-signal", "--using", alias, "--yes", stdout=StringIO()
        )
    finally:
        thread.join(90)
    assert box == {"acquired": True}
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_prl_reset_all_wakes_a_waiter_of_two_keys(alias):
    """``test_reset_all_signalizes``: a waiter blocked on two held keys gets both once
    they are reset. Ours: a lock on two keys (all or none), both force-released."""
    lk1 = dlock.lock("prl-sig1", using=alias, ttl=300)
    lk2 = dlock.lock("prl-sig2", using=alias, ttl=300)
    lk1.acquire()
    lk2.acquire()
    box: dict[str, Any] = {}

    def waiter() -> None:
        both = dlock.lock(["prl-sig1", "prl-sig2"], using=alias)
        box["acquired"] = both.acquire(timeout=60)
        both.release()

    thread = threading.Thread(target=lambda: in_thread(waiter))
    thread.start()
    try:
        # keys are taken in sorted order: the waiter queues on the first
        wait_until(lambda: queued(alias, "lock:prl-sig1") == 1, timeout=30)
        for name in ("lock:prl-sig1", "lock:prl-sig2"):
            call_command("dlock_release", name, "--using", alias, "--yes", stdout=StringIO())
    finally:
        thread.join(90)
    assert box == {"acquired": True}


def test_prl_renewal_stops_when_the_holder_is_gone(alias):
    """``test_auto_renewal_stops_after_gc``: the renewal stops when the lock object is
    garbage-collected and the key expires. Ours: it stops when its holder
    (the thread) is gone; the lease then runs out and the key is free."""
    _abandon(alias, "prl-gc", ttl=1.5, renew=True)
    assert dlock.lock("prl-gc", using=alias).acquire(timeout=60) is True
    dlock.lock("prl-gc", using=alias).release()


def test_prl_locked_method(alias):
    """``test_locked_method``: ``locked()`` is true for any Lock object of the key."""
    lk = dlock.lock("prl-lm", using=alias)
    other = dlock.lock("prl-lm", using=alias)
    assert lk.locked() is False and other.locked() is False
    assert lk.acquire() is True
    assert lk.locked() is True and other.locked() is True
    assert in_thread(other.locked) is True
    lk.release()


# =================================================================================
# django-pglock: pglock/tests/test_core.py
# =================================================================================

PG_STRATEGIES = ["advisory", "advisory_xact", "row"]


def users() -> Any:
    """django.contrib.auth's User (a model with a unique column), imported late:
    the child processes of this module import it before Django is set up."""
    from django.contrib.auth.models import User

    return User.objects


def show_lock_timeout() -> str:
    with connections["default"].cursor() as cur:
        cur.execute("SHOW lock_timeout")
        return str(cur.fetchone()[0])


@pytest.mark.parametrize("strategy", PG_STRATEGIES)
def test_pglock_lock_timeout_is_local(strategy):
    """``test_timeout``: lock_timeout is set for the lock's wait only and restored,
    also across nested transactions that fail. (``pglock.timeout()`` itself is
    not offered: a wait is the lock's ``timeout``.)"""
    users().create(username="hello")
    before = show_lock_timeout()
    other = hold("pg-lt", strategy)
    try:
        with transaction.atomic():
            assert dlock.lock("pg-lt", strategy=strategy).acquire(timeout=0.2) is False
            assert show_lock_timeout() == before
            with pytest.raises(IntegrityError), transaction.atomic():
                assert dlock.lock("pg-lt", strategy=strategy).acquire(timeout=0.2) is False
                users().create(username="hello")
            assert show_lock_timeout() == before
        assert show_lock_timeout() == before
    finally:
        other.release()


def test_pglock_advisory_args():
    """``test_advisory_args``: bad arguments are refused at once: a key that is not
    a key (``InvalidLockKey``), an unknown side effect (our ``on_fail``),
    ``Skip`` in a ``with`` block, a timeout that is not a number."""
    with pytest.raises(dlock.InvalidLockKey):
        dlock.lock(datetime.timedelta(seconds=100), strategy="advisory")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_fail"):
        dlock.lock("pg-args", strategy="advisory", on_fail="bad")  # type: ignore[call-overload]
    with (
        pytest.raises(ValueError, match="skip"),
        dlock.lock("pg-args", strategy="advisory", on_fail="skip"),
    ):
        pytest.fail("the block ran")
    with pytest.raises(ValueError, match="timeout"):
        dlock.lock("pg-args", strategy="advisory", timeout="1")  # type: ignore[arg-type]


@pytest.mark.parametrize("strategy", ["advisory", "advisory_xact"])
def test_pglock_no_wait(strategy):
    """``test_advisory_no_wait`` and the first half of ``test_advisory_xact``: a
    try-once on a held key is not acquired. Differs: a ``with`` raises
    ``LockTimeout`` (django-pglock yields False; ``Raise``: ``OperationalError``)."""
    other = hold("pg-nowait", strategy)
    try:
        with transaction.atomic():
            assert dlock.lock("pg-nowait", strategy=strategy).acquire(timeout=0) is False
        with (
            pytest.raises(dlock.LockTimeout),
            transaction.atomic(),
            dlock.lock("pg-nowait", strategy=strategy, timeout=0),
        ):
            pytest.fail("the block ran without the lock")
    finally:
        other.release()
    with transaction.atomic(), dlock.lock("pg-nowait", strategy=strategy, timeout=0) as lk:
        assert lk.held()


def test_pglock_advisory_decorator():
    """``test_advisory_decorator``: a decorated function on a held key raises by
    default (ours ``LockTimeout``, theirs ``OperationalError``) or is skipped
    (``on_fail="skip"``, their ``Skip``: returns None); a decorator without a
    key locks the function's ``module.qualname``."""

    @dlock.lock("pg-deco", strategy="advisory", timeout=0)
    def decorated_default() -> None:
        raise AssertionError

    @dlock.lock("pg-deco", strategy="advisory", timeout=0, on_fail="skip")
    def decorated_skip() -> None:
        raise AssertionError

    @dlock.lock(strategy="advisory", timeout=0)
    def can_acquire() -> bool:
        name = f"{can_acquire.__module__}.{can_acquire.__qualname__}"
        return bool(in_thread(lambda: dlock.lock(name, strategy="advisory").locked()))

    other = hold("pg-deco", "advisory")
    try:
        with pytest.raises(dlock.LockTimeout):
            decorated_default()
        assert decorated_skip() is None
    finally:
        other.release()
    assert can_acquire() is True


@pytest.mark.parametrize("strategy", PG_STRATEGIES)
def test_pglock_timeout_keeps_the_transaction_usable(strategy):
    """``test_advisory_timeout``: a wait that times out inside a transaction leaves
    the transaction usable (a failed lock statement is rolled back to a
    savepoint); a skipped decorated call too; ``on_fail="raise"`` raises
    ``LockTimeout`` (theirs ``OperationalError``)."""

    @dlock.lock("pg-to", strategy=strategy, timeout=0.1, on_fail="skip")
    def decorated() -> None:
        raise AssertionError

    other = hold("pg-to", strategy)
    try:
        if strategy == "advisory":
            assert dlock.lock("pg-to", strategy=strategy).acquire(timeout=0.1) is False
        with transaction.atomic():
            assert dlock.lock("pg-to", strategy=strategy).acquire(timeout=0.1) is False
            assert not users().exists()
        with transaction.atomic():
            assert decorated() is None
            assert not users().exists()
        with (
            pytest.raises(dlock.LockTimeout),
            transaction.atomic(),
            dlock.lock("pg-to", strategy=strategy, timeout=0.1),
        ):
            pytest.fail("the block ran without the lock")
    finally:
        other.release()


@pytest.mark.parametrize("strategy", PG_STRATEGIES)
def test_pglock_error_inside_the_locks_transaction(strategy):
    """``test_advisory_inside_transaction``: the holder's transaction fails
    (``IntegrityError``) inside the lock; another thread can take the lock
    once the holder is out (session advisory: released on leaving the block;
    advisory_xact and row: the rollback frees it)."""
    users().create(username="hello")
    inside, after = threading.Event(), threading.Event()

    def hold_and_fail() -> None:
        with (
            pytest.raises(IntegrityError),
            transaction.atomic(),
            dlock.lock("pg-err", strategy=strategy),
        ):
            inside.set()
            users().create(username="hello")
        after.set()

    holder = threading.Thread(target=lambda: in_thread(hold_and_fail))
    holder.start()
    try:
        assert inside.wait(30)

        def take() -> bool:
            assert after.wait(30)
            with transaction.atomic(), dlock.lock("pg-err", strategy=strategy, timeout=10) as lk:
                return lk.held()

        assert in_thread(take) is True
    finally:
        holder.join(60)


@pytest.mark.parametrize("strategy", ["advisory_xact", "row"])
def test_pglock_lease_calls_after_a_rolled_back_lock_transaction(strategy):
    """``test_advisory_inside_transaction``'s sequence on a connection that has
    already run lease calls: a transaction-scoped lock whose transaction an
    error rolled back, three times. Lock calls of any strategy on the same
    connection keep working afterwards."""

    def lease_calls(tag: str) -> list[bool]:
        done = []
        for n in range(6):
            lk = dlock.lock(f"pg-seq-lease:{n % 2}", ttl=30)
            done.append(lk.acquire(timeout=5))
            lk.extend(20)
            done.append(lk.owned())
            lk.release()
            done.append(not lk.locked())
        return done

    def sequence() -> list[bool]:
        users().using("default").get_or_create(username="hello")
        results = lease_calls("before")
        for _ in range(3):
            with (
                pytest.raises(IntegrityError),
                transaction.atomic(),
                dlock.lock("pg-seq", strategy=strategy),
            ):
                assert dlock.lock("pg-seq-other", strategy=strategy).acquire(timeout=5)
                users().create(username="hello")
        results += lease_calls("after")
        with transaction.atomic():
            results.append(dlock.lock("pg-seq", strategy=strategy).acquire(timeout=5))
        return results

    assert in_thread(sequence) == [True] * 37


def test_pglock_advisory_xact():
    """``test_advisory_xact``: a transaction-scoped advisory lock, taken with a
    ``with`` block or with ``acquire()`` inside ``transaction.atomic``, keeps
    others out until its transaction ends."""
    inside, done = threading.Event(), threading.Event()
    turn2, done2 = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic(), dlock.lock("pg-xact", strategy="advisory_xact"):
            inside.set()
            assert done.wait(30)
        with transaction.atomic():
            assert dlock.lock("pg-xact", strategy="advisory_xact").acquire()
            turn2.set()
            assert done2.wait(30)

    thread = threading.Thread(target=lambda: in_thread(holder))
    thread.start()
    try:
        assert inside.wait(30)
        with transaction.atomic():
            assert dlock.lock("pg-xact", strategy="advisory_xact").acquire(timeout=0) is False
        done.set()
        assert turn2.wait(30)
        with transaction.atomic():
            assert dlock.lock("pg-xact", strategy="advisory_xact").acquire(timeout=0) is False
        done2.set()
    finally:
        done.set()
        done2.set()
        thread.join(60)
    with transaction.atomic():
        assert dlock.lock("pg-xact", strategy="advisory_xact").acquire(timeout=10) is True


def test_pglock_advisory_xact_usage():
    """``test_advisory_xact_usage``: outside a transaction a transaction-scoped lock
    is refused (``TransactionRequired``; theirs ``RuntimeError``); it cannot be
    released by hand (``DLockError``). Differs: a ``with`` block inside a
    transaction is fine (django-pglock refuses it)."""
    with pytest.raises(dlock.TransactionRequired):
        dlock.lock("pg-usage", strategy="advisory_xact").acquire()
    with transaction.atomic(), dlock.lock("pg-usage", strategy="advisory_xact") as lk:
        assert lk.held()
    with transaction.atomic():
        lk = dlock.lock("pg-usage", strategy="advisory_xact")
        assert lk.acquire()
        with pytest.raises(dlock.DLockError, match="releases it when the transaction ends"):
            lk.release()


@pytest.mark.slow
def test_pglock_advisory_ids():
    """``test_advsiory_id``: keys map to PostgreSQL's advisory lock ids as documented:
    a two-part int key is ``pg_advisory_lock(int4, int4)`` (so it can be found
    in ``pg_locks``); a string is hashed to 64 bits, the same in every process."""
    with dlock.lock((11, 22), strategy="advisory"), connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND "
            "classid = 11::oid AND objid = 22::oid AND objsubid = 2 AND granted"
        )
        assert cur.fetchone()[0] == 1
    ids = pg_locks_ids(make_key("hello", "lock"))
    with dlock.lock("hello", strategy="advisory"):
        assert len(pg_locks("hello")) == 1
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from django_dlock.keys import make_key, pg_locks_ids;"
            "print(pg_locks_ids(make_key('hello', 'lock')))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == str(ids)


def test_pglock_is_locked():
    """``test_is_locked`` (an older test_core.py): ``locked()`` sees another
    holder's advisory lock."""
    lk = dlock.lock("pg-is-locked", strategy="advisory")
    assert lk.locked() is False
    other = hold("pg-is-locked", "advisory")
    try:
        assert lk.locked() is True
    finally:
        other.release()
    assert lk.locked() is False


# =================================================================================
# client-go: tools/leaderelection/leaderelection_test.go
# =================================================================================

TIMINGS = {"lease": 4.0, "renew_deadline": 3.0, "retry": 0.5}


class Recorded:
    """An election whose callbacks are recorded in order (the Go test's event
    recorder and ``OnNewLeader``)."""

    def __init__(self, alias: str, identity: str, name: str = "gl", **options: Any) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.election = dlock.LeaderElection(
            name,
            using=alias,
            identity=identity,
            on_started_leading=lambda term: self.events.append(("started", term)),
            on_stopped_leading=lambda: self.events.append(("stopped",)),
            on_new_leader=lambda who: self.events.append(("new", who)),
            **{**TIMINGS, **options},
        )

    def leaders_seen(self) -> list[str]:
        return [e[1] for e in self.events if e[0] == "new"]


def test_client_go_acquire_from_no_object(alias):
    """``TestTryAcquireOrRenew``, "acquire from no object": the first candidate leads;
    ``OnNewLeader`` reports it; the record names it."""
    baz = Recorded(alias, "baz")
    with baz.election as e:
        wait_until(lambda: e.is_leader, timeout=30)
        record = e.leader()
        assert record is not None and record.identity == "baz"
        assert record.term == e.term
        wait_until(lambda: "baz" in baz.leaders_seen())
        assert ("started", e.term) in baz.events


def test_client_go_acquire_from_a_released_record(alias):
    """ "acquire from object without annotations", "acquire from unled object",
    "acquire from empty led, acked object": a record nobody holds (the last
    leader released it) is taken, and the leadership transitions (a new,
    greater term)."""
    bing = Recorded(alias, "bing")
    with bing.election as e:
        wait_until(lambda: e.is_leader, timeout=30)
        first = e.term
    assert bing.election.leader() is None  # released, the row remains
    baz = Recorded(alias, "baz")
    with baz.election as e:
        wait_until(lambda: e.is_leader, timeout=30)
        assert e.term is not None and first is not None and e.term > first
        assert e.leader().identity == "baz"


def test_client_go_dont_acquire_from_a_led_object(alias):
    """ "don't acquire from led, acked object": while a leader renews, another
    candidate does not lead; it observes the leader (``OnNewLeader("bing")``)."""
    bing = Recorded(alias, "bing")
    baz = Recorded(alias, "baz")
    with bing.election as leader:
        wait_until(lambda: leader.is_leader, timeout=30)
        term = leader.term
        with baz.election as standby:
            wait_until(lambda: "bing" in baz.leaders_seen(), timeout=30)
            assert not standby.is_leader
            record = standby.leader()
            assert record is not None and (record.identity, record.term) == ("bing", term)
        assert leader.is_leader and leader.term == term
    assert not any(e[0] == "started" for e in baz.events)


def test_client_go_renew_already_acquired(alias):
    """ "renew already acquired object": the leader renews its own record: same
    holder, same term (no transition), the lease end moves forward."""
    baz = Recorded(alias, "baz")
    with baz.election as e:
        wait_until(lambda: e.is_leader, timeout=30)
        first = e.leader()
        assert first is not None
        wait_until(lambda: e.leader().expires > first.expires, timeout=30)
        later = e.leader()
        assert (later.identity, later.term) == ("baz", first.term)
        assert e.is_leader and e.term == first.term
    assert [x for x in baz.events if x[0] != "new"] == [("started", first.term), ("stopped",)]


def _lead_then_freeze(alias: str, ready: str) -> None:
    """A child process: lead, say so, then wait to be killed (never releases)."""
    election = dlock.LeaderElection("gl", using=alias, identity="bing", **TIMINGS)
    election.start()
    wait_until(lambda: election.is_leader, timeout=60)
    publish(ready, str(election.term))
    time.sleep(600)  # killed by the test long before


@pytest.mark.slow
def test_client_go_acquire_from_a_dead_leaders_object(alias, tmp_path):
    """ "acquire from led object with the lease duration seconds" and "acquire from
    led, unacked object": the leader's process dies without releasing; once
    its lease has run out, a standby takes it with a new term."""
    ready = tmp_path / "ready"
    child = procs.start(_lead_then_freeze, alias, str(ready))
    try:
        wait_until(ready.exists, timeout=90)
        dead_term = int(ready.read_text())
    finally:
        child.kill()
        child.join(30)
    baz = Recorded(alias, "baz")
    with baz.election as e:
        wait_until(lambda: "bing" in baz.leaders_seen() or e.is_leader, timeout=30)
        wait_until(lambda: e.is_leader, timeout=60)
        assert e.term is not None and e.term > dead_term
        assert e.leader().identity == "baz"


def test_client_go_release(alias):
    """``testReleaseLease``: releasing leaves no holder; the events are "became
    leader" then "stopped leading"."""
    baz = Recorded(alias, "baz")
    baz.election.start()
    wait_until(lambda: baz.election.is_leader, timeout=30)
    term = baz.election.term
    baz.election.stop()
    assert baz.election.leader() is None
    assert not baz.election.is_leader
    assert [x for x in baz.events if x[0] != "new"] == [("started", term), ("stopped",)]


def session_id(connection: Any) -> int:
    """The server's id of ``connection``'s session."""
    with connection.cursor() as cur:
        pg = connection.vendor == "postgresql"
        cur.execute("SELECT pg_backend_pid()" if pg else "SELECT CONNECTION_ID()")
        return int(cur.fetchone()[0])


def blocked_by(alias: str, blocker: int) -> bool:
    """Whether a session of ``alias`` waits for a lock held by the session ``blocker``."""
    if connections[alias].vendor == "postgresql":
        query = "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
    else:
        # InnoDB refreshes these tables only when they were not read for 0.1 s:
        # a faster poll would read the same stale copy for ever
        time.sleep(0.15)
        query = (
            "SELECT count(*) FROM information_schema.innodb_lock_waits w "
            "JOIN information_schema.innodb_trx t ON t.trx_id = w.blocking_trx_id "
            "WHERE t.trx_mysql_thread_id = %s"
        )
    with connections[alias].cursor() as cur:
        cur.execute(query, [blocker])
        return bool(cur.fetchone()[0])


@pytest.mark.parametrize("db", ["default", "mysql"])
def test_client_go_release_on_cancel_while_a_renewal_is_in_flight(db):
    """``TestReleaseOnCancellation`` and ``TestReleaseRetriesOnConflict``: the leader
    is stopped while a renewal is stuck (here: another session holds the
    record's row); once that renewal returns, the lease is released all the
    same; the events are "became leader", "stopped leading"."""
    baz = Recorded(db, "baz")
    baz.election.start()
    try:
        wait_until(lambda: baz.election.is_leader, timeout=30)
        term = baz.election.term
        blocker = connections.create_connection(db)
        try:
            blocker.set_autocommit(False)
            with blocker.cursor() as cur:
                cur.execute(
                    "SELECT name FROM django_dlock_lock WHERE name = 'leader:gl' FOR UPDATE"
                )
            blocker_id = session_id(blocker)
            wait_until(lambda: blocked_by(db, blocker_id), timeout=30)
            stopper = threading.Thread(target=baz.election.stop)
            stopper.start()
            wait_until(lambda: baz.election.stop_requested, timeout=30)
        finally:
            blocker.rollback()
            blocker.close()
        stopper.join(60)
        assert not stopper.is_alive()
    finally:
        baz.election.stop()
    wait_until(lambda: baz.election.leader() is None, timeout=30)
    assert [x for x in baz.events if x[0] != "new"] == [("started", term), ("stopped",)]


def test_client_go_config_validation(alias):
    """``TestLeaderElectionConfigValidation``: a valid configuration is accepted; an
    empty identity is refused (theirs: "Lock identity is empty")."""
    dlock.LeaderElection("gl", using=alias, identity="baz", lease=15, renew_deadline=2, retry=1)
    for empty in ("", "   "):
        with pytest.raises(ValueError, match="identity"):
            dlock.LeaderElection("gl", using=alias, identity=empty, **TIMINGS)


def test_client_go_check_while_running(alias):
    """``TestCheckMethodRace``: with aggressive timings, reading the election's
    state from other threads while it campaigns and renews is safe: no error,
    and a term is seen only while leading."""
    baz = Recorded(alias, "baz", lease=2.0, renew_deadline=1.0, retry=0.05)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(200):
                leading, term = baz.election.is_leader, baz.election.term
                assert term is not None or not leading or not baz.election.is_leader
                record = baz.election.leader()
                assert record is None or record.identity == "baz"
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    with baz.election:
        readers = [threading.Thread(target=read) for _ in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(120)
    assert not any(r.is_alive() for r in readers)
    assert errors == []
