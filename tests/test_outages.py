"""Lock calls while the database server stops, restarts or crashes.

Runs on a private PostgreSQL cluster created by the test module (never the
shared service). A call that cannot reach the database raises
``DatabaseUnavailable`` with the driver's error chained, on every strategy
(an acquire with a timeout once it has kept trying until its timeout);
a grant after a release that could not reach the database gets a new
fencing number; and fencing numbers never repeat across a crash of the
server, also those drawn for locks held in the caller's transaction.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import DatabaseError, InterfaceError, OperationalError, connections, transaction
from django.test import override_settings

import django_dlock as dlock
from django_dlock.strategies.connection import _pooler_seen, close_private_connections

from .pgcluster import _accepts, attached_cluster

ALIAS = "outage"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=[ALIAS]),
]


cluster = attached_cluster(ALIAS)


@pytest.fixture
def server(cluster):
    """The cluster, running again (and this thread's connection fresh) after the test."""
    try:
        yield cluster
    finally:
        connections[ALIAS].close()
        close_private_connections()
        if not _accepts(cluster.port):
            cluster.start()


def _unavailable(caught: pytest.ExceptionInfo[dlock.DatabaseUnavailable]) -> None:
    """The error names the database and chains Django's driver error."""
    assert isinstance(caught.value, dlock.DLockError)
    assert ALIAS in str(caught.value)
    assert isinstance(caught.value.__cause__, (OperationalError, InterfaceError))


def test_lease_calls_raise_database_unavailable_while_the_server_is_down(server):
    held = dlock.lock("outage-lease", using=ALIAS, ttl=60)
    assert held.acquire(timeout=0)
    server.stop()

    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        held.extend()
    _unavailable(caught)
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        held.owned()
    _unavailable(caught)
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-lease-other", using=ALIAS).acquire(timeout=0)
    _unavailable(caught)
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-lease-other", using=ALIAS).acquire(timeout=0.5)
    _unavailable(caught)
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        held.release()
    _unavailable(caught)

    # The release was not done: the holding is forgotten here, and the lease
    # stays in the database until it runs out.
    assert not held.held()
    server.start()
    assert held.locked()


def test_a_try_once_during_an_outage_raises_database_unavailable_at_once(server, caplog):
    server.stop()
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-once", using=ALIAS).acquire(timeout=0)
    _unavailable(caught)
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-once", using=ALIAS, strategy="advisory").acquire(blocking=False)
    assert caught.value.__cause__ is not None
    assert "trying again" not in caplog.text  # one try, no second


@pytest.mark.parametrize("strategy", ["lease", "advisory"])
def test_an_acquire_whose_timeout_ends_during_the_outage_raises_database_unavailable(
    server, strategy
):
    # It kept trying to reach the database until its timeout; the database's
    # error, not a LockTimeout, says why it has no lock.
    server.stop()
    lk = dlock.lock("outage-ends", using=ALIAS, strategy=strategy, timeout=1)
    started = time.monotonic()
    with pytest.raises(dlock.DatabaseUnavailable) as caught, lk:
        pass
    assert time.monotonic() - started >= 1
    assert not isinstance(caught.value, dlock.LockTimeout)
    assert caught.value.__cause__ is not None
    assert ALIAS in str(caught.value)


def test_an_acquire_that_starts_during_an_outage_rides_out_a_restart(server):
    server.stop()
    got: dict[str, bool] = {}

    def take(strategy: str, timeout: float | None) -> None:
        lk = dlock.lock(f"outage-rides-{strategy}", using=ALIAS, strategy=strategy)
        got[strategy] = lk.acquire(timeout=timeout)
        if got[strategy]:
            got[f"{strategy} owned"] = lk.owned()
            lk.release()

    # (timeout=None: waiting forever rides out an outage of any length)
    threads = [
        threading.Thread(target=_closing(take), args=args, daemon=True)
        for args in (("lease", None), ("advisory", 30))
    ]
    for thread in threads:
        thread.start()
    time.sleep(1)  # both are trying to reach the stopped server
    assert got == {}
    server.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert got == {"lease": True, "lease owned": True, "advisory": True, "advisory owned": True}


def _closing(func: Any) -> Any:
    """``func``, run in a thread that closes its connections when it ends."""

    def run(*args: Any) -> None:
        try:
            func(*args)
        finally:
            close_private_connections()
            connections.close_all()

    return run


def test_the_first_lock_statement_of_a_process_during_an_outage(server):
    # Whether a pooler is in between is asked once per process and database,
    # by the first lock statement.
    _pooler_seen.clear()
    connections[ALIAS].__dict__.pop("_dlock_behind_pooler", None)  # (this thread's answer)
    server.stop()
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-first", using=ALIAS).acquire(timeout=0)
    _unavailable(caught)


def test_leaving_the_block_keeps_the_blocks_own_error_during_an_outage(server):
    held = dlock.lock("outage-block", using=ALIAS)
    with pytest.raises(ValueError, match="the block's own"), held:
        server.stop()
        raise ValueError("the block's own error")
    server.start()
    # Without an error of its own, leaving the block raises the outage.
    other = dlock.lock("outage-block-2", using=ALIAS, ttl=60)
    with pytest.raises(dlock.DatabaseUnavailable), other:
        server.stop()


def test_lease_release_reconnects_after_a_restart(server):
    held = dlock.lock("outage-restart", using=ALIAS, ttl=60)
    assert held.acquire(timeout=0)
    server.restart()
    # The connection of this thread died with the server: it reconnects.
    held.release()
    assert not held.locked()


def test_row_calls_raise_database_unavailable_after_a_restart(server):
    with transaction.atomic(using=ALIAS):
        held = dlock.lock("outage-row", strategy="row", using=ALIAS)
        assert held.acquire(timeout=0)
        assert held.owned()
        server.restart()  # the transaction, and its row lock, end with the server

        with pytest.raises(dlock.DatabaseUnavailable) as caught:
            dlock.lock("outage-row-other", strategy="row", using=ALIAS).acquire(timeout=0)
        _unavailable(caught)
        with pytest.raises(dlock.DatabaseUnavailable) as caught:
            held.extend()
        _unavailable(caught)
        with pytest.raises(dlock.DatabaseUnavailable) as caught:
            held.owned()
        _unavailable(caught)
        transaction.set_rollback(True, using=ALIAS)
    connections[ALIAS].close()
    with transaction.atomic(using=ALIAS):
        assert dlock.lock("outage-row", strategy="row", using=ALIAS).acquire(timeout=0)


def test_row_acquire_raises_database_unavailable_while_the_server_is_down(server):
    with transaction.atomic(using=ALIAS):
        connections[ALIAS].ensure_connection()
        with connections[ALIAS].cursor() as cur:
            cur.execute("SELECT 1")
        server.stop()
        with pytest.raises(dlock.DatabaseUnavailable) as caught:
            dlock.lock("outage-row-down", strategy="row", using=ALIAS).acquire(timeout=1)
        _unavailable(caught)
        server.start()  # (leaving the block reconnects)
        transaction.set_rollback(True, using=ALIAS)


def test_advisory_while_the_server_is_down(server):
    held = dlock.lock("outage-advisory", strategy="advisory", using=ALIAS)
    assert held.acquire(timeout=0)
    server.stop()
    # The session is gone, and its lock with it: a loss, not an outage.
    with pytest.raises(dlock.LockLost):
        held.release()
    with pytest.raises(dlock.DatabaseUnavailable) as caught:
        dlock.lock("outage-advisory", strategy="advisory", using=ALIAS).acquire(timeout=0)
    assert ALIAS in str(caught.value) and caught.value.__cause__ is not None


def test_a_grant_after_a_failed_release_gets_a_new_fence(server):
    first = dlock.lock("outage-fence", using=ALIAS, ttl=60)
    assert first.acquire(timeout=0)
    old = first.fence
    assert old is not None
    server.stop()
    with pytest.raises(dlock.DatabaseUnavailable):
        first.release()
    server.start()

    # Still this thread's lease in the database (the release never ran).
    again = dlock.lock("outage-fence", using=ALIAS, ttl=60)
    assert again.acquire(timeout=0)
    assert again.fence is not None and again.fence > old
    again.release()


def _fences(strategy: str, keys: list[str]) -> list[int]:
    """Take every key in the current transaction; the fencing numbers."""
    found = []
    for key in keys:
        lk = dlock.lock(key, strategy=strategy, using=ALIAS)
        assert lk.acquire(timeout=0)
        assert lk.fence is not None
        found.append(lk.fence)
    return found


@override_settings(DLOCK_ADVISORY_FENCING=True)
def test_transaction_scoped_fences_never_repeat_after_a_crash(server):
    # Enough numbers per strategy to cross several of the sequence's batches
    # of 32 (one WAL record each), in a transaction that never commits.
    rows = [f"crash-row-{i}" for i in range(100)]
    xacts = [f"crash-xact-{i}" for i in range(100)]
    with transaction.atomic(using=ALIAS):
        _fences("row", rows)  # the rows exist (committed) before the crash
    issued: list[int] = []
    with pytest.raises(DatabaseError), transaction.atomic(using=ALIAS):
        issued += _fences("row", rows)
        issued += _fences("advisory_xact", xacts)
        server.crash_and_restart()
        connections[ALIAS].cursor().execute("SELECT 1")  # the transaction is gone
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    connections[ALIAS].close()

    after: list[int] = []
    with transaction.atomic(using=ALIAS):
        after += _fences("row", rows[:3])
        after += _fences("advisory_xact", xacts[:3])
    assert min(after) > max(issued), (max(issued), after)


@override_settings(DLOCK_ADVISORY_FENCING=True)
def test_numbers_read_late_never_repeat_after_a_crash(server):
    """row and advisory_xact draw their number when it is first read: all the
    locks first, then every number, then the crash before the transaction
    commits. No number read comes back after the restart."""
    rows = [f"late-row-{i}" for i in range(100)]
    xacts = [f"late-xact-{i}" for i in range(100)]
    with transaction.atomic(using=ALIAS):
        for key in rows:  # the rows exist (committed) before the crash
            assert dlock.lock(key, strategy="row", using=ALIAS).acquire(timeout=0)
    issued: list[int] = []
    with pytest.raises(DatabaseError), transaction.atomic(using=ALIAS):
        held = [dlock.lock(key, strategy="row", using=ALIAS) for key in rows]
        held += [dlock.lock(key, strategy="advisory_xact", using=ALIAS) for key in xacts]
        for lk in held:
            assert lk.acquire(timeout=0)
        issued = [lk.fence for lk in held]  # drawn now, one by one
        server.crash_and_restart()
        connections[ALIAS].cursor().execute("SELECT 1")  # the transaction is gone
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    connections[ALIAS].close()

    after: list[int] = []
    with transaction.atomic(using=ALIAS):
        after += _fences("row", rows[:3])
        after += _fences("advisory_xact", xacts[:3])
    assert min(after) > max(issued), (max(issued), after)
