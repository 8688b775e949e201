"""The loss table, walked state by state and operation by operation.

| event | owned()/held() | extend() | release() | leaving the block | acquire() again |
| lease expired, nobody took it | False | LockLost | LockLost | LockLost | contends afresh |
| another holder took it | False | LockLost | LockLost | LockLost | contends afresh |
| advisory session died (PG, MySQL) | False | LockLost | LockLost | LockLost | contends afresh |
| lease force-released, taken | False (owned) | LockLost | LockLost | LockLost | contends afresh |

A force-released lease is found out by the holder's next statement (owned(),
a renewal, extend(), release(), leaving the block, a re-entrant acquire);
``held()`` answers from memory while the lease surely runs, so it is not a
cell of that row.

Leases really run out (a short ttl, waited for on the database clock), so
the holder's own notion of time is part of what is tested. Each case also
checks that the loss is reported exactly once (``lock_lost`` signal and
``on_lost`` callback) and that the key can be acquired again afterwards.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import signals
from django_dlock.operations import force_release
from django_dlock.strategies.advisory import sessions

from .helpers import end_server_session, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

#: (strategy, alias, state)
CASES = [
    ("lease", "default", "expired"),
    ("lease", "default", "taken"),
    ("lease", "sqlite", "expired"),
    ("lease", "sqlite", "taken"),
    ("lease", "mysql", "expired"),
    ("lease", "mysql", "taken"),
    ("advisory", "default", "session died"),
    ("advisory", "default", "taken"),
    ("advisory", "mysql", "session died"),
    ("advisory", "mysql", "taken"),
    ("lease", "default", "force-released"),
    ("lease", "sqlite", "force-released"),
    ("lease", "mysql", "force-released"),
    # a semaphore's permit is a lease of its own (one permit here: see
    # tests/test_semaphore.py for one permit lost among several)
    ("semaphore", "default", "expired"),
    ("semaphore", "default", "taken"),
    ("semaphore", "default", "force-released"),
    ("semaphore", "sqlite", "expired"),
    ("semaphore", "sqlite", "taken"),
    ("semaphore", "sqlite", "force-released"),
    ("semaphore", "mysql", "expired"),
    ("semaphore", "mysql", "taken"),
    ("semaphore", "mysql", "force-released"),
    # a reader (shared=True): its own lease row; "taken" and "force-released"
    # (the key's row, which says readers hold it) let a writer in
    ("shared", "default", "expired"),
    ("shared", "default", "taken"),
    ("shared", "default", "force-released"),
    ("shared", "sqlite", "expired"),
    ("shared", "sqlite", "taken"),
    ("shared", "sqlite", "force-released"),
    ("shared", "mysql", "expired"),
    ("shared", "mysql", "taken"),
    ("shared", "mysql", "force-released"),
    # an upgradeable reader after its upgrade: the key's row is its own
    ("upgraded", "default", "expired"),
    ("upgraded", "default", "taken"),
    ("upgraded", "default", "force-released"),
    ("upgraded", "sqlite", "expired"),
    ("upgraded", "sqlite", "taken"),
    ("upgraded", "sqlite", "force-released"),
    ("upgraded", "mysql", "expired"),
    ("upgraded", "mysql", "taken"),
    ("upgraded", "mysql", "force-released"),
]
OPERATIONS = ["owned", "held", "extend", "release", "leave", "acquire"]
#: (strategy, alias, state, operation): every cell of the table
CELLS = [
    pytest.param(*case, operation, id="-".join((*case, operation)))
    for case in CASES
    for operation in OPERATIONS
    if not (case[2] == "force-released" and operation == "held")
]

TTL = 0.4


def _make(key, alias, strategy, **options):
    """A lock of ``strategy``, or (``"semaphore"``) a semaphore of one permit."""
    if strategy == "semaphore":
        return dlock.semaphore(key, permits=1, using=alias, **options)
    if strategy == "shared":
        return dlock.lock(key, using=alias, shared=True, **options)
    if strategy == "upgraded":
        return dlock.lock(key, using=alias, upgradeable=True, **options)
    return dlock.lock(key, using=alias, strategy=strategy, **options)


def _name(key, strategy) -> str:
    return f"semaphore:{key}" if strategy == "semaphore" else f"lock:{key}"


def _leased(strategy) -> bool:
    return strategy in ("lease", "semaphore", "shared", "upgraded")


def _reads(strategy) -> bool:
    return strategy in ("shared", "upgraded")


def _upgraded(lk, strategy) -> None:
    """An "upgraded" lock: turned into the write lock (nobody else reads)."""
    if strategy == "upgraded":
        assert lk.upgrade(timeout=5)


#: a force-release happens well within the lease: nothing runs out meanwhile
FORCE_RELEASED_TTL = 60.0


class Losses:
    """Counts lock_lost signals and on_lost calls for one name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.signals: list[str] = []
        self.callbacks: list[dlock.LockLost] = []
        self._mutex = threading.Lock()

    def receiver(self, sender, name, strategy, reason, **kwargs):
        if name == self.name:
            with self._mutex:
                self.signals.append(reason)

    def on_lost(self, error: dlock.LockLost) -> None:
        self.callbacks.append(error)


def _kill_session(lk, alias: str) -> None:
    session = sessions.find(alias, lk.token)
    assert session is not None
    end_server_session(alias, session.backend_pid)


class Taker:
    """Another thread that acquires ``key`` and holds it until stopped."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.holding = threading.Event()
        self.thread: threading.Thread | None = None

    def take(self, key, alias, strategy) -> None:
        def hold():
            try:
                # (after a reader, a writer: another reader would share it)
                other = _make(key, alias, "lease" if _reads(strategy) else strategy, ttl=60)
                if other.acquire(timeout=10):
                    self.holding.set()
                    self.done.wait(60)
                    other.release()
            finally:
                connections.close_all()

        self.thread = threading.Thread(target=hold)
        self.thread.start()
        assert self.holding.wait(15), "the other holder could not acquire"

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join(30)


def _lose(lk, key, alias, strategy, state, taker, losses):
    """Bring the lock held by ``lk`` into ``state``."""
    if state == "force-released":
        # as an operator does it (the admin action, manage.py dlock_release),
        # then another holder takes the key
        row = _name(key, strategy) + ("#0" if strategy == "semaphore" else "")
        released = force_release(alias, names=[row], source="test")
        assert len(released) == 1
        taker.take(key, alias, strategy)
    elif _leased(strategy):
        # The lease really runs out, on the database clock.
        wait_until(lambda: not lk.locked())
        if state == "taken":
            taker.take(key, alias, strategy)
    else:
        _kill_session(lk, alias)
        # The session watcher notices the closed connection on its own, and
        # reports it (lost is set first, then the signal and the callback).
        wait_until(lambda: lk.lost and bool(losses.callbacks), timeout=30)
        if state == "taken":
            taker.take(key, alias, strategy)


@pytest.mark.parametrize(("strategy", "alias", "state", "operation"), CELLS)
def test_loss_table(strategy, alias, state, operation):
    key = f"loss-{strategy}-{state.replace(' ', '-')}-{operation}"
    losses = Losses(_name(key, strategy))
    signals.lock_lost.connect(losses.receiver)
    taker = Taker()
    taken = state in ("taken", "force-released")
    ttl = FORCE_RELEASED_TTL if state == "force-released" else TTL
    try:
        lk = _make(key, alias, strategy, ttl=ttl, on_lost=losses.on_lost)
        if operation == "leave":
            with pytest.raises(dlock.LockLost), lk:
                _upgraded(lk, strategy)
                _lose(lk, key, alias, strategy, state, taker, losses)
        else:
            assert lk.acquire(timeout=0)
            _upgraded(lk, strategy)
            first_fence = lk.fence
            _lose(lk, key, alias, strategy, state, taker, losses)
            if operation == "owned":
                assert lk.owned() is False
                assert lk.held() is False
            elif operation == "held":
                assert lk.held() is False
                assert lk.owned() is False
            elif operation == "extend":
                with pytest.raises(dlock.LockLost):
                    lk.extend()
                assert lk.locked() is taken  # an expired lease is not revived
            if operation in ("owned", "held", "extend"):
                with pytest.raises(dlock.LockLost):
                    lk.release()
            elif operation == "release":
                with pytest.raises(dlock.LockLost) as info:
                    lk.release()
                assert isinstance(info.value, dlock.LockNotOwned)
            elif operation == "acquire":
                # Re-entry is refused by the database: the caller contends afresh
                # (with a long lease this time, so that it surely runs meanwhile).
                again = _make(key, alias, strategy, ttl=60).acquire(0)
                assert again is not taken
                if again:
                    assert lk.held() and lk.owned()
                    if _leased(strategy):
                        assert lk.fence > first_fence
                    lk.release()
                # The lost level still reports its loss when it is left.
                with pytest.raises(dlock.LockLost):
                    lk.release()
        # Reported exactly once, however many operations saw it.
        assert len(losses.signals) == 1, losses.signals
        assert len(losses.callbacks) == 1
        assert not lk.held() and not lk.lost
        with pytest.raises(dlock.LockNotOwned):
            lk.release()
        # After the loss is reported, the key can be acquired like any other.
        if not taken:
            assert lk.acquire(timeout=0)
            lk.release()
    finally:
        taker.stop()
        signals.lock_lost.disconnect(losses.receiver)


@pytest.mark.django_db(transaction=True, databases=["default", "q1", "q2", "q3"])
def test_a_quorum_waiter_that_waited_longer_than_its_ttl_keeps_its_lease():
    """A quorum's lease is counted from the round that was granted, not from
    when its rounds began: a renewed waiter granted after waiting longer than
    its ttl is not reported lost."""
    from django_dlock.strategies import quorum

    using = ["q1", "q2", "q3"]
    ttl = 2.0
    losses: list[dlock.LockLost] = []
    result: dict[str, object] = {}
    started, granted, checked = threading.Event(), threading.Event(), threading.Event()

    def waiter() -> None:
        try:
            lk = dlock.lock("quorum-wait", using=using, ttl=ttl, renew=True, on_lost=losses.append)
            started.set()
            result["got"] = lk.acquire(timeout=60)
            granted.set()
            checked.wait(60)
            result["lost"] = lk.lost
            lk.release()  # LockLost if it was reported lost
            result["released"] = True
        finally:
            started.set()
            granted.set()
            connections.close_all()

    holder = dlock.lock("quorum-wait", using=using, ttl=30)
    assert holder.acquire(timeout=0)
    try:
        thread = threading.Thread(target=waiter)
        thread.start()
        assert started.wait(30)
        time.sleep(ttl + 0.5)  # the waiter's rounds have run for longer than its ttl
    finally:
        holder.release()
    assert granted.wait(60)
    time.sleep(ttl / 2)  # past its first renewal, before its lease could end
    checked.set()
    thread.join(60)
    quorum.close_all()
    assert result == {"got": True, "lost": False, "released": True}
    assert losses == []


def test_a_renewal_that_waited_for_its_row_past_the_lease_end_does_not_revive_it():
    """Another session holds the lease row (a stalled transaction) while the
    lease runs out; the holder's extend() waits for the row. When the row
    is let go, the lease has ended: extend() raises LockLost, and the row
    stays expired (judged once the row is the renewal's, not when its
    statement began, which would bring back a lease its holder may already
    have been told it lost)."""
    lk = dlock.lock("revive", ttl=1)
    assert lk.acquire(timeout=0)
    holding = threading.Event()

    def stall() -> None:
        other = connections["default"].copy()
        try:
            with other.cursor() as cur:
                cur.execute("BEGIN")
                cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = 'lock:revive' FOR UPDATE")
                holding.set()

                def extend_waits() -> bool:
                    cur.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND query LIKE %s",
                        ["%UPDATE django_dlock_lock SET expire_at%"],
                    )
                    return cur.fetchone()[0] == 1

                wait_until(extend_waits)
                # the lease runs out (database clock) while the renewal waits
                cur.execute("SELECT pg_sleep(1.2)")
                cur.execute("ROLLBACK")
        finally:
            other.close()

    thread = threading.Thread(target=stall)
    thread.start()
    try:
        assert holding.wait(30)
        with pytest.raises(dlock.LockLost):
            lk.extend(30)
    finally:
        thread.join(30)
    with connections["default"].cursor() as cur:
        cur.execute("SELECT expire_at <= now() FROM django_dlock_lock WHERE name = 'lock:revive'")
        assert cur.fetchone()[0] is True  # not revived
    assert dlock.lock("revive").acquire(timeout=0)
