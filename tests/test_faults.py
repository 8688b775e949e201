"""Faults: killed holders, killed connections, failing renewals, paused holders."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import signals

from . import procs
from .helpers import expire_now, in_thread, publish, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def _hold_forever(alias: str, ready: str, ttl: float) -> None:
    lk = dlock.lock("victim", using=alias, ttl=ttl)
    lk.acquire()
    publish(ready, str(lk.fence))
    time.sleep(600)


def _lease_window(alias: str) -> tuple[object, object]:
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT acquired_at, expire_at FROM django_dlock_lock WHERE name = 'lock:victim'"
        )
        return cur.fetchone()


@pytest.mark.slow
def test_sigkill_of_a_lease_holder_frees_it_at_expiry_not_before(alias, tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_hold_forever, alias, str(ready), 4.0)
    wait_until(ready.exists, timeout=60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    _, dead_expiry = _lease_window(alias)
    # Another worker waits; it gets the lock only once the lease ran out.
    assert in_thread(lambda: dlock.lock("victim", using=alias).acquire(timeout=0)) is False

    def wait_for_it():
        lk = dlock.lock("victim", using=alias)
        assert lk.acquire(timeout=60)
        window = _lease_window(alias)
        lk.release()
        return window

    acquired_at, _ = in_thread(wait_for_it)
    assert acquired_at >= dead_expiry  # database clock: not before the lease ended


def _kill_other_backends() -> int:
    def kill() -> int:
        with connections["default"].cursor() as cur:
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return int(cur.fetchone()[0])

    return in_thread(kill)


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_killed_connections_of_holder_and_renewer_are_survived():
    lk = dlock.lock("survivor", ttl=1.2, renew=True)
    lk.acquire()
    renewer = lk._holdings()[0].renewer
    wait_until(lambda: renewer.renewals >= 1)
    assert _kill_other_backends() >= 2  # this thread's and the renewer's sessions
    before = renewer.renewals
    wait_until(lambda: renewer.renewals >= before + 3)  # renewals reconnected
    assert not lk.lost and lk.owned()  # our own connection reconnected too
    assert in_thread(lambda: dlock.lock("survivor").acquire(timeout=0)) is False
    lk.release()


_TRIGGERS = {
    "postgresql": [
        "CREATE FUNCTION dlock_test_refuse() RETURNS trigger AS $$ BEGIN "
        "RAISE EXCEPTION 'refused by a test trigger'; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER dlock_test_refuse BEFORE UPDATE ON django_dlock_lock FOR EACH ROW "
        "WHEN (OLD.name = 'lock:doomed' AND NEW.token = OLD.token) "
        "EXECUTE FUNCTION dlock_test_refuse()",
    ],
    "sqlite": [
        "CREATE TRIGGER dlock_test_refuse BEFORE UPDATE ON django_dlock_lock FOR EACH ROW "
        "WHEN OLD.name = 'lock:doomed' AND NEW.token = OLD.token "
        "BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END",
    ],
    "mysql": [
        "CREATE TRIGGER dlock_test_refuse BEFORE UPDATE ON django_dlock_lock FOR EACH ROW "
        "BEGIN IF OLD.name = 'lock:doomed' AND NEW.token = OLD.token THEN "
        "SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by a test trigger'; END IF; END",
    ],
}
_DROP = {
    "postgresql": [
        "DROP TRIGGER IF EXISTS dlock_test_refuse ON django_dlock_lock",
        "DROP FUNCTION IF EXISTS dlock_test_refuse()",
    ],
    "sqlite": ["DROP TRIGGER IF EXISTS dlock_test_refuse"],
    "mysql": ["DROP TRIGGER IF EXISTS dlock_test_refuse"],
}


def test_failing_renewal_loses_the_lock_loudly_never_silently(alias):
    """The database refuses every renewal (a trigger): the holder is told."""
    vendor = connections[alias].vendor
    lost = []

    def receiver(sender, name, **kwargs):
        lost.append(name)

    with connections[alias].cursor() as cur:
        for sql in _TRIGGERS[vendor]:
            cur.execute(sql)
    signals.lock_lost.connect(receiver)
    try:
        lk = dlock.lock("doomed", using=alias, ttl=1.0, renew=True)
        with pytest.raises(dlock.LockLost), lk:
            wait_until(lambda: lk.lost and bool(lost))  # (set first, then reported)
            # Lost on our side no later than the lease can be taken:
            got = in_thread(lambda: dlock.lock("doomed", using=alias).acquire(timeout=30))
            assert got is True
        assert lost == ["lock:doomed"]
    finally:
        signals.lock_lost.disconnect(receiver)
        with connections[alias].cursor() as cur:
            for sql in _DROP[vendor]:
                cur.execute(sql)


class FencedResource:
    """A store that refuses a write whose fencing number is not the highest yet."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def write(self, fence: int, value: str) -> bool:
        last = int(self.path.read_text().split()[0]) if self.path.exists() else 0
        if fence <= last:
            return False
        self.path.write_text(f"{fence} {value}")
        return True


def _paused_holder(alias: str, ready: str, resource: str, outcome: str) -> None:
    lk = dlock.lock("fenced-resource", using=alias, ttl=30)
    lk.acquire()
    publish(ready, str(lk.fence))
    time.sleep(2.0)  # SIGSTOPped in here, while its lease is taken over
    accepted = FencedResource(resource).write(lk.fence, "stale")
    try:
        lk.release()
        released = "released"
    except dlock.LockLost:
        released = "lost"
    Path(outcome).write_text(f"{'accepted' if accepted else 'refused'} {released}")


@pytest.mark.slow
def test_paused_holder_is_fenced_off_by_the_resource(alias, tmp_path):
    ready, outcome = tmp_path / "ready", tmp_path / "outcome"
    resource = FencedResource(str(tmp_path / "resource"))
    proc = procs.start(_paused_holder, alias, str(ready), str(resource.path), str(outcome))
    # (the file exists a moment before its text is written)
    wait_until(ready.exists, timeout=60)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        stale_fence = int(ready.read_text())
        expire_now(alias, "lock:fenced-resource")  # its lease runs out while paused

        def new_holder():
            with dlock.lock("fenced-resource", using=alias, timeout=0) as lk:
                assert lk.fence > stale_fence
                assert FencedResource(str(resource.path)).write(lk.fence, "fresh")

        in_thread(new_holder)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    proc.join(60)
    assert outcome.read_text() == "refused lost"
    assert resource.path.read_text().endswith("fresh")


def test_waiters_survive_a_killed_listener_connection():
    """PostgreSQL: the LISTEN connection is killed while a waiter waits."""
    holder = dlock.lock("listened")
    holder.acquire()
    got = threading.Event()

    def waiter():
        with dlock.lock("listened", timeout=60):
            got.set()
        connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)
    _kill_other_backends()
    holder.release()
    thread.join(60)
    assert got.is_set()
