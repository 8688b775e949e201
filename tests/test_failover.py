"""Fail-over of PostgreSQL: the primary dies, its streaming standby is promoted.

Each test runs on its own pair of private clusters (never the shared
service): a primary and a standby built with PostgreSQL's own tools
(``pg_basebackup -R``, a replication slot), behind a TCP :class:`Switch`
that plays the operator's virtual IP or DNS name. The fail-over is what a
real one is: the primary is killed (SIGKILL of every process), the standby
promoted (``pg_ctl promote``), the switch moved to it; Django's settings do
not change, its connections drop and reconnect.

* Synchronous replication (``synchronous_standby_names``,
  ``synchronous_commit = on``): every lease acquired before the kill is on
  the new primary; its holder keeps renewing it and nobody else gets it.
* Asynchronous replication, with the standby cut off first so that the
  primary's last writes never reach it: the lease acquired meanwhile is
  gone, its holder learns it on the next renewal (``LockLost``, ``lost``,
  ``lock_lost``), and the fencing numbers of the new primary are above
  every number the old one issued, although its raw sequence is behind.
* A planned switchover (a clean shutdown of the primary) keeps every lease,
  also with asynchronous replication.
* Advisory locks are not replicated at all: their holders learn the loss.
* A leader whose leadership was lost with the old primary stops, and leads
  again in a higher term.
* ``advisory_xact`` and ``row`` locks end with their transaction.
* Fencing numbers never repeat or go backwards: after three promotions in a
  row, each standby having missed the old primary's last WAL, and after a
  standby that never followed the newest timeline is promoted and gives its
  timeline an ID already used.
* An acquire with a timeout that starts during a switchover rides it out,
  through the switch and through a libpq multi-host DSN
  (``target_session_attrs=read-write``), and returns the lock held on the
  new primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction
from django.test import override_settings

import django_dlock as dlock
from django_dlock.selfcheck import _replication
from django_dlock.signals import lock_lost
from django_dlock.strategies.fence import NEXT_FENCE

from . import pgcluster
from .helpers import in_thread, wait_until
from .pgcluster import PrivateCluster, Switch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        pgcluster.available() is not None,
        reason=f"no PostgreSQL server binaries: {pgcluster.available()}",
    ),
]

SYNC, ASYNC, LEADER = "failover_sync", "failover_async", "failover_leader"
PLANNED = "failover_planned"
XACT = "failover_xact"
CHAIN, REUSE = "failover_chain", "failover_reuse"
#: one database of a pair, reached through the switch and through a multi-host DSN
RIDEOUT, RIDEOUT_HOSTS = "failover_rideout", "failover_rideout_hosts"
DATABASE = "dlock_failover"


class Pair:
    """A primary, its streaming standby, and the switch the clients connect to."""

    def __init__(self, synchronous: bool) -> None:
        self.primary = PrivateCluster(fsync="off").create()
        self.standby: PrivateCluster | None = None
        self.switch: Switch | None = None
        try:
            self.standby = self.primary.standby()
            if synchronous:
                self.primary.make_synchronous()
            self.switch = Switch(self.primary.port)
        except BaseException:
            self.destroy()
            raise

    @property
    def new_primary(self) -> PrivateCluster:
        assert self.standby is not None
        return self.standby

    def fail_over(self, planned: bool = False) -> None:
        """Kill (or, planned, stop) the primary, promote the standby, move the switch to it."""
        assert self.standby is not None and self.switch is not None
        if planned:
            self.primary.stop()
        else:
            self.primary.kill()
        self.standby.promote()
        self.switch.point_to(self.standby.port)

    def destroy(self) -> None:
        if self.switch is not None:
            self.switch.close()
        for cluster in (self.primary, self.standby):
            if cluster is not None:
                cluster.destroy()


@contextlib.contextmanager
def _pair(alias: str, synchronous: bool, django_db_blocker: Any) -> Iterator[Pair]:
    # Module scope: the alias must exist before the test case starts (Django 6
    # refuses connections to an alias that appears during a test).
    pair = Pair(synchronous)
    assert pair.switch is not None
    try:
        with django_db_blocker.unblock(), pair.primary.attached(alias, DATABASE, pair.switch.port):
            pair.primary.caught_up(pair.new_primary)
            yield pair
    finally:
        pair.destroy()


@pytest.fixture(scope="module")
def sync_pair(django_db_blocker):
    with _pair(SYNC, True, django_db_blocker) as pair:
        yield pair


@pytest.fixture(scope="module")
def async_pair(django_db_blocker):
    with _pair(ASYNC, False, django_db_blocker) as pair:
        yield pair


@pytest.fixture(scope="module")
def leader_pair(django_db_blocker):
    with _pair(LEADER, False, django_db_blocker) as pair:
        yield pair


@pytest.fixture(scope="module")
def planned_pair(django_db_blocker):
    with _pair(PLANNED, False, django_db_blocker) as pair:
        yield pair


@pytest.fixture(scope="module")
def xact_pair(django_db_blocker):
    with _pair(XACT, True, django_db_blocker) as pair:
        yield pair


class Chain:
    """A primary behind a switch, and every cluster made from it (destroyed together)."""

    def __init__(self) -> None:
        self.primary = PrivateCluster(fsync="off").create()
        self.clusters = [self.primary]
        self.switch = Switch(self.primary.port)

    def standby(self, slot: str) -> PrivateCluster:
        """A new standby of the primary, caught up, then cut off: it never gets
        what the primary writes from here on."""
        standby = self.primary.standby(slot)
        self.clusters.append(standby)
        self.primary.caught_up(standby)
        standby.cut_off()
        return standby

    def promote(self, standby: PrivateCluster) -> None:
        """Kill the primary, promote ``standby``, move the switch to it."""
        self.primary.kill()
        standby.promote()
        self.switch.point_to(standby.port)
        self.primary = standby

    def destroy(self) -> None:
        self.switch.close()
        for cluster in self.clusters:
            cluster.destroy()


@contextlib.contextmanager
def _chain(alias: str, django_db_blocker: Any) -> Iterator[Chain]:
    chain = Chain()
    try:
        with (
            django_db_blocker.unblock(),
            chain.primary.attached(alias, DATABASE, chain.switch.port),
        ):
            yield chain
    finally:
        chain.destroy()


@pytest.fixture(scope="module")
def chain(django_db_blocker):
    with _chain(CHAIN, django_db_blocker) as made:
        yield made


@pytest.fixture(scope="module")
def reuse_chain(django_db_blocker):
    with _chain(REUSE, django_db_blocker) as made:
        yield made


@pytest.fixture(scope="module")
def rideout_pair(django_db_blocker):
    with _pair(RIDEOUT, False, django_db_blocker) as pair:
        # The same database as a libpq multi-host DSN: the primary, then the
        # standby; libpq connects to whichever one accepts writes.
        settings = dict(connections.settings[RIDEOUT])
        settings.update(
            HOST="127.0.0.1,127.0.0.1",
            PORT=f"{pair.primary.port},{pair.new_primary.port}",
            OPTIONS={**settings.get("OPTIONS", {}), "target_session_attrs": "read-write"},
        )
        connections.settings[RIDEOUT_HOSTS] = settings
        try:
            yield pair
        finally:
            with django_db_blocker.unblock():
                connections[RIDEOUT_HOSTS].close()
            del connections[RIDEOUT_HOSTS]
            del connections.settings[RIDEOUT_HOSTS]


@pytest.fixture
def losses() -> Iterator[list[dict[str, Any]]]:
    """Every ``lock_lost`` signal sent during the test."""
    seen: list[dict[str, Any]] = []
    mutex = threading.Lock()

    def receiver(sender: Any, **kwargs: Any) -> None:
        with mutex:
            seen.append(kwargs)

    lock_lost.connect(receiver, weak=False)
    try:
        yield seen
    finally:
        lock_lost.disconnect(receiver)


def _try(name: str, alias: str, **kwargs: Any) -> int | None:
    """Another holder (a new thread) tries ``name`` once; its fence, or None."""

    def attempt() -> int | None:
        lk = dlock.lock(name, using=alias, **kwargs)
        if not lk.acquire(timeout=0):
            return None
        fence = lk.fence
        lk.release()
        return fence if fence is not None else 0

    fence: int | None = in_thread(attempt)
    return fence


def _take(name: str, alias: str, **kwargs: Any) -> int:
    """Another holder takes ``name`` (it must be free); its fence."""
    fence = _try(name, alias, **kwargs)
    assert fence is not None, f"{name} is not free"
    return fence


def _session(cluster: PrivateCluster) -> Any:
    """A session of its own on ``cluster`` (not through the switch)."""
    import psycopg

    return psycopg.connect(
        host="127.0.0.1", port=cluster.port, user="postgres", dbname=DATABASE, autocommit=True
    )


def _fence_on(conn: Any) -> int:
    """The next fencing number, taken in the session ``conn``."""
    row = conn.execute(f"SELECT {NEXT_FENCE}").fetchone()
    assert row is not None
    return int(row[0])


def _fences_as(cluster: PrivateCluster, role: str, count: int) -> list[int]:
    """The next ``count`` fencing numbers, taken in one session on ``cluster`` as ``role``."""
    with _session(cluster) as conn:
        conn.execute(f'SET ROLE "{role}"')
        return [_fence_on(conn) for _ in range(count)]


def _raw_sequence(cluster: PrivateCluster) -> int:
    (value,) = cluster.sql("SELECT last_value FROM django_dlock_fence", dbname=DATABASE)[0]
    return int(value)


@pytest.mark.django_db(transaction=True, databases=["default", SYNC])
def test_synchronous_replication_loses_no_lease(sync_pair, losses):
    verdict = _replication(SYNC)
    assert verdict is not None and verdict.result == "PASS", verdict
    assert verdict.detail.startswith("1 of 1 standby(s) synchronous"), verdict
    renewed = dlock.lock("sync:renewed", using=SYNC, ttl=20.0, renew=True)
    assert renewed.acquire(timeout=0)
    renewer = renewed._holdings()[0].renewer
    assert renewer is not None
    # Acquired just before the kill: each commit waited for the standby.
    keys = [f"sync:{i}" for i in range(20)]
    held = [dlock.lock(key, using=SYNC, ttl=300) for key in keys]
    for lk in held:
        assert lk.acquire(timeout=0)
    fences = [lk.fence for lk in held] + [renewed.fence]
    assert all(isinstance(f, int) for f in fences)

    advisory = dlock.lock("sync:advisory", using=SYNC, strategy="advisory")
    seen: dict[str, Any] = {}
    # (Only observations inside the block: an assertion error there would
    # be masked by the LockLost that leaving the block raises.)
    with pytest.raises(dlock.LockLost), advisory:
        sync_pair.fail_over()
        seen["advisory owned"] = advisory.owned()
        seen["advisory lost"] = advisory.lost
        seen["advisory free"] = _try("sync:advisory", SYNC, strategy="advisory")
    assert seen == {"advisory owned": False, "advisory lost": True, "advisory free": 0}
    assert not advisory.lost  # reported by leaving the block

    # Every lease is on the new primary and still ours.
    for lk in held:
        assert lk.owned()
        lk.extend()
    assert not any(_try(key, SYNC) for key in keys)
    before = renewer.renewals
    wait_until(lambda: renewer.renewals > before, timeout=60)  # on the new primary
    assert not renewed.lost and renewed.owned()
    assert _try("sync:renewed", SYNC) is None
    assert [s["name"] for s in losses] == [advisory.name]

    for lk in [*held, renewed]:
        lk.release()
    after = _try("sync:0", SYNC)
    assert after is not None and after > max(f for f in fences if f is not None)
    assert not renewed.lost


@pytest.mark.django_db(transaction=True, databases=["default", ASYNC])
def test_asynchronous_replication_loss_is_detected_and_fences_keep_rising(async_pair, losses):
    pair = async_pair
    # dlock_selfcheck says what asynchronous replication cannot keep
    verdict = _replication(ASYNC)
    assert verdict is not None and verdict.result == "WARN", verdict
    assert "none synchronous" in verdict.detail and "clocks agree" in verdict.detail, verdict
    replicated = dlock.lock("async:replicated", using=ASYNC, ttl=300)
    assert replicated.acquire(timeout=0)
    issued = [replicated.fence]
    pair.primary.caught_up(pair.new_primary)

    for statement in (
        "CREATE ROLE dlock_fence_user",
        "GRANT USAGE ON SEQUENCE django_dlock_fence TO dlock_fence_user",
    ):
        pair.primary.sql(statement, dbname=DATABASE)
    pair.primary.caught_up(pair.new_primary)

    # From here on, nothing the primary writes reaches the standby.
    pair.new_primary.cut_off()
    unreplicated = dlock.lock("async:unreplicated", using=ASYNC, ttl=6.0, renew=True)
    assert unreplicated.acquire(timeout=0)
    issued.append(unreplicated.fence)
    # More than one batch of the fence sequence (32 numbers), so the old
    # primary gives out numbers whose WAL record the standby never gets.
    for i in range(40):
        lk = dlock.lock(f"async:burst:{i}", using=ASYNC, ttl=300)
        assert lk.acquire(timeout=0)
        issued.append(lk.fence)
        lk.release()
    advisory = dlock.lock("async:advisory", using=ASYNC, strategy="advisory")
    assert advisory.acquire(timeout=0)
    highest = max(f for f in issued if f is not None)
    # A session open on the standby takes no number there (read-only), and
    # lives through the promotion.
    import psycopg

    on_standby = _session(pair.new_primary)
    with pytest.raises(psycopg.Error, match="recovery is in progress"):
        _fence_on(on_standby)

    pair.fail_over()

    # The hazard is real: the new primary's sequence is behind the old one's.
    assert _raw_sequence(pair.new_primary) < highest
    assert pair.new_primary.timeline() == 2

    # A role that may not raise the sequence gets numbers above the old
    # primary's too (the sequence stays where it is).
    limited = _fences_as(pair.new_primary, "dlock_fence_user", 2)
    limited += _fences_as(pair.new_primary, "dlock_fence_user", 1)
    assert highest < limited[0] < limited[1] < limited[2], (highest, limited)
    assert _raw_sequence(pair.new_primary) < highest

    # The session that was open on the standby: its numbers on the new
    # timeline are above the old primary's too (it had learned nothing of
    # the old timeline), and each one above the last.
    with on_standby:
        survived = [_fence_on(on_standby) for _ in range(3)]
    assert max(limited) < survived[0] < survived[1] < survived[2], (limited, survived)

    # The lease that had reached the standby is still held.
    assert replicated.owned()
    replicated.extend()
    assert _try("async:replicated", ASYNC) is None

    # The unreplicated lease: its next renewal finds it gone.
    wait_until(lambda: unreplicated.lost, timeout=60)
    assert not unreplicated.owned()
    with pytest.raises(dlock.LockLost):
        unreplicated.extend()
    with pytest.raises(dlock.LockLost):
        unreplicated.release()

    # Another holder takes it, and every number the new primary issues is
    # above every number the old primary issued.
    after = [_take("async:unreplicated", ASYNC), _take("async:burst:0", ASYNC)]
    after.append(_take("async:fresh", ASYNC))
    with override_settings(DLOCK_ADVISORY_FENCING=True):
        after.append(_take("async:fenced", ASYNC, strategy="advisory"))
    assert min(after) > max(limited), (after, limited)
    assert after == sorted(after) and len(set(after)) == len(after)

    # The advisory lock vanished with the old primary.
    assert not advisory.owned()
    assert advisory.lost
    with pytest.raises(dlock.LockLost):
        advisory.release()
    assert _take("async:advisory", ASYNC, strategy="advisory") == 0

    assert sorted(s["name"] for s in losses) == sorted([unreplicated.name, advisory.name])
    replicated.release()


@pytest.mark.django_db(transaction=True, databases=["default", LEADER])
def test_leader_elected_after_the_cut_off_steps_down_and_leads_again_in_a_higher_term(
    leader_pair,
):
    pair = leader_pair
    events: list[tuple[str, int | None]] = []
    changed = threading.Condition()

    def record(event: str, term: int | None = None) -> None:
        with changed:
            events.append((event, term))
            changed.notify_all()

    election = dlock.LeaderElection(
        "failover",
        using=LEADER,
        lease=6.0,
        renew_deadline=4.0,
        retry=0.5,
        on_started_leading=lambda term: record("started", term),
        on_stopped_leading=lambda: record("stopped"),
    )
    pair.new_primary.cut_off()
    election.start()
    try:
        wait_until(lambda: election.is_leader, timeout=60)
        first = election.term
        assert first is not None
        record_before = election.leader()  # this thread connects to the old primary
        assert record_before is not None and record_before.term == first

        # Its leadership row never reached the standby.
        pair.fail_over()

        wait_until(lambda: len(events) >= 3, timeout=60)
        assert [e for e, _ in events[:3]] == ["started", "stopped", "started"]
        second = events[2][1]
        assert second is not None and second > first
        wait_until(lambda: election.is_leader, timeout=60)
        assert election.term == second
        # This thread's Django connection died with the old primary:
        # leader() reconnects, as lock methods do.
        record_now = election.leader()
        assert record_now is not None and record_now.term == second
    finally:
        election.stop()
        connections.close_all()


@pytest.mark.django_db(transaction=True, databases=["default", PLANNED])
def test_planned_switchover_keeps_every_lease_also_with_asynchronous_replication(
    planned_pair, losses
):
    # Acquired right before the shutdown, without waiting for the standby:
    # a clean shutdown sends its standbys all of its WAL before it stops.
    keys = [f"planned:{i}" for i in range(20)]
    held = [dlock.lock(key, using=PLANNED, ttl=300) for key in keys]
    for lk in held:
        assert lk.acquire(timeout=0)
    highest = max(lk.fence or 0 for lk in held)
    advisory = dlock.lock("planned:advisory", using=PLANNED, strategy="advisory")
    assert advisory.acquire(timeout=0)

    planned_pair.fail_over(planned=True)

    for lk in held:
        assert lk.owned()
        lk.extend()
    assert not any(_try(key, PLANNED) for key in keys)
    assert not advisory.owned()
    with pytest.raises(dlock.LockLost):
        advisory.release()
    assert [s["name"] for s in losses] == [advisory.name]
    for lk in held:
        lk.release()
    assert _take("planned:0", PLANNED) > highest


@pytest.mark.django_db(transaction=True, databases=["default", XACT])
def test_transaction_scoped_locks_end_with_the_transaction(xact_pair):
    strategies = ["advisory_xact", "row"]
    failed_over = threading.Event()
    held = {strategy: threading.Event() for strategy in strategies}
    errors: dict[str, BaseException] = {}

    def holder(strategy: str) -> None:
        try:
            lock = dlock.lock(f"xact:{strategy}", using=XACT, strategy=strategy)
            with transaction.atomic(using=XACT), lock:
                held[strategy].set()
                failed_over.wait(120)
                with connections[XACT].cursor() as cur:
                    cur.execute("SELECT 1")
        except BaseException as exc:
            errors[strategy] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=holder, args=(s,)) for s in strategies]
    for thread in threads:
        thread.start()
    try:
        for event in held.values():
            assert event.wait(60)
        xact_pair.fail_over()
    finally:
        failed_over.set()
        for thread in threads:
            thread.join(120)
    # The transaction died with the old primary: the holder's next statement fails.
    kinds = {strategy: type(error).__name__ for strategy, error in errors.items()}
    assert kinds == dict.fromkeys(strategies, "OperationalError"), errors
    # This thread's connection died too; Django drops it at the end of a request.
    connections[XACT].close()

    def take(strategy: str) -> bool:
        with transaction.atomic(using=XACT):
            lock = dlock.lock(f"xact:{strategy}", using=XACT, strategy=strategy)
            return bool(lock.acquire(timeout=0))

    for strategy in strategies:
        assert in_thread(take, strategy), strategy


class Fences:
    """Every fencing number issued, per key and in order, through one alias."""

    def __init__(self, alias: str, keys: int = 100) -> None:
        self.alias = alias
        self.keys = [f"fence:{i}" for i in range(keys)]
        self.issued: list[int] = []
        self.per_key: dict[str, list[int]] = {key: [] for key in self.keys}

    def round(self) -> list[int]:
        """Every key taken and released once; the numbers, each checked against
        every number issued before (not repeated, not lower)."""
        before = max(self.issued, default=0)
        numbers = []
        for key in self.keys:
            lk = dlock.lock(key, using=self.alias, ttl=300)
            assert lk.acquire(timeout=0)
            assert isinstance(lk.fence, int)
            numbers.append(lk.fence)
            self.per_key[key].append(lk.fence)
            lk.release()
        repeated = sorted(set(numbers) & set(self.issued))
        lower = [n for n in numbers if n <= before]
        assert not repeated and not lower, (
            f"{len(lower)} of {len(numbers)} numbers at or below the highest issued before "
            f"({before}); issued again: {repeated[:10]}"
        )
        self.issued.extend(numbers)
        return numbers


@pytest.mark.django_db(transaction=True, databases=["default", CHAIN])
def test_three_promotions_each_missing_the_last_wal_never_repeat_a_fence(chain):
    fences = Fences(CHAIN)
    fences.round()
    for promotion in range(1, 4):
        standby = chain.standby(f"chain{promotion}")
        # More than one batch of the fence sequence (32 numbers) that the
        # standby never receives, and every key's row newer than its copy.
        fences.round()
        chain.promote(standby)
        assert standby.timeline() == promotion + 1
        fences.round()
    for key, numbers in fences.per_key.items():
        assert numbers == sorted(set(numbers)), (key, numbers)


@pytest.mark.django_db(transaction=True, databases=["default", REUSE])
def test_a_timeline_id_used_twice_never_repeats_a_fence(reuse_chain):
    """Two switchovers in quick succession: the second standby promoted never
    followed the first one's timeline, and names its own with the same ID."""
    fences = Fences(REUSE)
    fences.round()
    first = reuse_chain.standby("reuse1")
    second = reuse_chain.standby("reuse2")
    fences.round()  # neither standby gets these
    reuse_chain.promote(first)
    assert first.timeline() == 2
    fences.round()
    reuse_chain.promote(second)  # it never saw timeline 2
    assert second.timeline() == 2
    fences.round()
    for key, numbers in fences.per_key.items():
        assert numbers == sorted(set(numbers)), (key, numbers)


#: how long the switchover lasts (the old primary stopped, nothing accepts
#: writes), and when in it the acquires start
SWITCHOVER, STARTS_AFTER = 2.0, 0.5


@pytest.mark.django_db(transaction=True, databases=["default", RIDEOUT, RIDEOUT_HOSTS])
def test_an_acquire_that_starts_during_a_switchover_rides_it_out(rideout_pair):
    pair = rideout_pair
    clients = [
        (RIDEOUT, "lease", False),  # through the switch (a virtual IP)
        (RIDEOUT, "advisory", False),
        (RIDEOUT_HOSTS, "lease", False),  # host=a,b target_session_attrs=read-write
        (RIDEOUT_HOSTS, "lease", True),  # aacquire()
    ]
    start, done = threading.Event(), threading.Event()
    results: dict[int, dict[str, Any]] = {}
    ready = threading.Barrier(len(clients) + 1)

    def client(n: int, alias: str, strategy: str, run_async: bool) -> None:
        # Connected before the switchover: its connection (or advisory
        # session) dies with the old primary.
        warm = dlock.lock(f"rideout:warm:{n}", using=alias, strategy=strategy)
        with warm:
            pass
        ready.wait(60)
        start.wait(60)
        lk = dlock.lock(f"rideout:{n}", using=alias, strategy=strategy)
        began = time.monotonic()
        if run_async:
            asyncio.run(_hold_async(lk, began, results, n, done))
            return
        try:
            acquired = lk.acquire(timeout=10)
        except dlock.DLockError as exc:
            results[n] = {"acquired": exc, "began": began, "returned": time.monotonic()}
            return
        got = {"acquired": acquired, "began": began, "returned": time.monotonic()}
        if acquired:
            got.update(owned=lk.owned(), token=lk._holdings()[0].request.token)
        results[n] = got  # (whole: the test thread reads it once it is there)
        if acquired:
            done.wait(60)
            lk.release()

    # Waiters already in the queue when the switchover begins: for keys this
    # thread holds, and releases once the new primary accepts writes.
    queued: dict[str, Any] = {}
    holding = {
        strategy: dlock.lock(f"rideout:queued:{strategy}", using=RIDEOUT, strategy=strategy)
        for strategy in ("lease", "advisory")
    }

    def waiter(strategy: str) -> None:
        lk = dlock.lock(f"rideout:queued:{strategy}", using=RIDEOUT, strategy=strategy)
        try:
            acquired = lk.acquire(timeout=10)
        except dlock.DLockError as exc:
            queued[strategy] = {"acquired": exc}
            return
        got = {"acquired": acquired, "returned": time.monotonic()}
        if acquired:
            got["owned"] = lk.owned()
            lk.release()
        queued[strategy] = got  # (whole: the test thread reads it once it is there)

    threads = [
        threading.Thread(target=_closing(client), args=(n, *spec)) for n, spec in enumerate(clients)
    ]
    threads += [threading.Thread(target=_closing(waiter), args=(s,)) for s in holding]
    for lk in holding.values():
        assert lk.acquire(timeout=0)
    for thread in threads:
        thread.start()
    try:
        ready.wait(60)
        wait_until(
            lambda: (
                pair.primary.sql(
                    "SELECT count(*) FROM django_dlock_waiter WHERE name = %s",
                    "lock:rideout:queued:lease",
                    dbname=DATABASE,
                )
                == [(1,)]
            )
        )
        wait_until(
            lambda: (
                pair.primary.sql(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                == [(1,)]
            )
        )
        stopped = time.monotonic()
        pair.primary.stop()  # a planned switchover: nothing accepts writes from here
        time.sleep(max(0.0, stopped + STARTS_AFTER - time.monotonic()))
        start.set()
        time.sleep(max(0.0, stopped + SWITCHOVER - time.monotonic()))
        pair.new_primary.promote()
        promoted = time.monotonic()
        assert pair.switch is not None
        pair.switch.point_to(pair.new_primary.port)
        moved = time.monotonic()
        for lk in holding.values():  # (advisory: its session died with the old primary)
            with contextlib.suppress(dlock.LockLost):
                lk.release()
        released = time.monotonic()
        wait_until(lambda: len(results) == len(clients), timeout=60)
        wait_until(lambda: all(strategy in queued for strategy in holding), timeout=60)
        for strategy in holding:
            assert queued[strategy]["acquired"] is True, (strategy, queued)
            assert queued[strategy]["owned"] is True, strategy

        for n, (alias, strategy, _) in enumerate(clients):
            got = results[n]
            assert got["acquired"] is True, (alias, strategy, got)
            assert got["owned"] is True, (alias, strategy)
            assert got["returned"] - got["began"] < 10  # within the timeout
            # Held on the new primary: another holder cannot take it there.
            assert _try(f"rideout:{n}", alias, strategy=strategy) is None, (alias, strategy)
        for n, (_, strategy, _) in enumerate(clients):
            if strategy == "lease":
                rows = pair.new_primary.sql(
                    "SELECT token FROM django_dlock_lock WHERE name = %s",
                    f"lock:rideout:{n}",
                    dbname=DATABASE,
                )
                assert rows == [(results[n]["token"],)], rows
        # (what the report gives: how long after the database came back each returned)
        for n, (alias, strategy, run_async) in enumerate(clients):
            back = moved if alias == RIDEOUT else promoted
            print(
                f"rideout {alias} {strategy}{' async' if run_async else ''}: began "
                f"{results[n]['began'] - stopped:.2f}s into the switchover, returned "
                f"{results[n]['returned'] - back:.3f}s after the database was back"
            )
        for strategy in holding:
            print(
                f"rideout queued {strategy}: returned "
                f"{queued[strategy]['returned'] - released:.3f}s after the release"
            )
    finally:
        start.set()
        done.set()
        for thread in threads:
            thread.join(60)
        for alias in (RIDEOUT, RIDEOUT_HOSTS):  # (this thread's died with the old primary)
            connections[alias].close()


async def _hold_async(
    lk: dlock.Lock, began: float, results: dict[int, Any], n: int, done: threading.Event
) -> None:
    """The async client of the switchover: one task acquires, holds and releases."""
    try:
        acquired = await lk.aacquire(timeout=10)
    except dlock.DLockError as exc:
        results[n] = {"acquired": exc, "began": began, "returned": time.monotonic()}
        return
    got = {"acquired": acquired, "began": began, "returned": time.monotonic()}
    if acquired:
        got.update(owned=await lk.aowned(), token=lk._holdings()[0].request.token)
    results[n] = got  # (whole: the test thread reads it once it is there)
    if acquired:
        await asyncio.to_thread(done.wait, 60)
        await lk.arelease()


def _closing(func: Any) -> Any:
    """``func``, run in a thread that closes its connections when it ends."""

    def run(*args: Any) -> None:
        try:
            func(*args)
        finally:
            connections.close_all()

    return run
