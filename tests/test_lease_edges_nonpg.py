"""The lease strategy at its edges on every database: names that differ only
in case, accents or trailing spaces; a release inside a transaction that
rolls back."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import IntegrityError, connections, transaction

import django_dlock as dlock

from .helpers import in_thread
from .test_two_phase import Holder

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


@pytest.mark.parametrize(
    ("waited", "free"),
    [("Invoice", "invoice"), ("café", "cafe"), ("a", "a "), ("b ", "b")],
    ids=["case", "accent", "trailing-space", "no-trailing-space"],
)
def test_a_waiter_blocks_only_its_own_exact_name(alias, waited, free):
    holder = Holder(alias, waited)
    queued = threading.Event()
    let_go = threading.Event()

    def waiter() -> None:
        try:
            lk = dlock.lock(waited, using=alias, ttl=30)
            assert lk.enqueue() is False  # a live ticket for `waited`
            queued.set()
            let_go.wait(30)
            lk.release()  # gives the place up
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert queued.wait(30)
        # a different name: free, and nobody waits for it
        other = dlock.lock(free, using=alias)
        assert in_thread(lambda: other.acquire(timeout=0) and (other.release() or True))
    finally:
        let_go.set()
        thread.join(30)
        holder.release()


def test_a_lock_left_inside_a_transaction_that_rolls_back_is_free(alias):
    """The block ended: the lock is free, whatever the caller's transaction does."""
    with connections[alias].cursor() as cur:
        cur.execute("DELETE FROM django_dlock_fencefloor WHERE id = 2")
    with (
        pytest.raises(IntegrityError),
        transaction.atomic(using=alias),
        dlock.lock("tx-rollback", using=alias, ttl=30),
        connections[alias].cursor() as cur,
    ):
        # the caller writes, and its transaction then fails
        cur.execute("INSERT INTO django_dlock_fencefloor (id, value) VALUES (2, 0)")
        cur.execute("INSERT INTO django_dlock_fencefloor (id, value) VALUES (2, 0)")
    # another thread gets the key at once (it would wait the whole lease)
    other = dlock.lock("tx-rollback", using=alias)
    assert in_thread(lambda: other.acquire(timeout=5) and (other.release() or True))


@pytest.mark.django_db(transaction=True, databases=["sqlite"])
@pytest.mark.parametrize("shared", [False, True], ids=["lock", "read-lock"])
def test_a_lock_left_inside_a_sqlite_transaction_broken_by_an_integrity_error_is_free(shared):
    """The holder takes the lock inside ``transaction.atomic`` and creates a
    duplicate row: Django marks the transaction for rollback and lets no
    statement run in it. The lock still goes to a waiter once the
    transaction has rolled back, and the caller sees its own error."""
    import time

    from django.contrib.auth.models import User

    users = User.objects.using("sqlite")
    users.create(username="taken")
    waiting = threading.Event()
    got: dict[str, object] = {}

    def waiter() -> None:
        try:
            lk = dlock.lock("tx-broken", using="sqlite")
            waiting.set()
            started = time.monotonic()
            got["acquired"] = lk.acquire(timeout=10)
            got["waited"] = time.monotonic() - started
            if got["acquired"]:
                lk.release()
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    try:
        with (
            pytest.raises(IntegrityError),
            transaction.atomic(using="sqlite"),
            dlock.lock("tx-broken", using="sqlite", ttl=30, shared=shared),
        ):
            thread.start()
            assert waiting.wait(10)
            time.sleep(0.3)  # the waiter waits
            users.create(username="taken")
    finally:
        thread.join(30)
    assert got["acquired"] is True
    assert got["waited"] < 10


@pytest.mark.django_db(transaction=True, databases=["sqlite"])
@pytest.mark.parametrize("shared", [False, True], ids=["lock", "read-lock"])
def test_a_sqlite_release_after_a_rollback_leaves_the_next_grant_alone(shared):
    """The holder writes, then takes the lock inside the same transaction
    (the grant is part of it), and the transaction fails and rolls back,
    undoing the grant. The same thread takes the key again at once: that
    new grant stays its own (the release after the transaction is of the
    lease committed before it, and there was none)."""
    with connections["sqlite"].cursor() as cur:
        cur.execute("DELETE FROM django_dlock_fencefloor WHERE id = 2")
    with (
        pytest.raises(IntegrityError),
        transaction.atomic(using="sqlite"),
        connections["sqlite"].cursor() as cur,
    ):
        cur.execute("INSERT INTO django_dlock_fencefloor (id, value) VALUES (2, 0)")
        with dlock.lock("tx-again", using="sqlite", ttl=30, shared=shared):
            cur.execute("INSERT INTO django_dlock_fencefloor (id, value) VALUES (2, 0)")
    again = dlock.lock("tx-again", using="sqlite", ttl=30, shared=shared)
    assert again.acquire(timeout=0)
    for thread in threading.enumerate():  # the releases after the transaction
        if thread.name.startswith("django-dlock-release-after-transaction"):
            thread.join(30)
    assert again.owned()
    again.release()


def test_a_ticket_renewal_on_a_locked_sqlite_database_never_puts_the_ticket_back():
    """Another writer keeps the SQLite file locked past a waiter's deadline,
    then lets go just as the waiter renews its ticket. The renewal gives the
    acquire up (a timeout); it never reads the locked database as "the
    ticket is gone" and inserts it again under its own number."""
    import sqlite3
    import time

    from django_dlock.keys import make_key
    from django_dlock.retry import Deadline
    from django_dlock.strategies import queue
    from django_dlock.strategies.base import Request
    from django_dlock.strategies.connection import statement_deadline

    req = Request(
        make_key("renewed"), "sqlite", "token-1", "owner", 30.0, False, row="lock:renewed"
    )
    ticket = queue.enqueue(req)
    blocker = sqlite3.connect(
        connections["sqlite"].settings_dict["NAME"], timeout=5, check_same_thread=False
    )
    blocker.isolation_level = None
    blocker.execute("BEGIN IMMEDIATE")  # the write lock
    # let go after the deadline (0.6 s), while a renewal that took the
    # locked database for "no ticket" would be trying to insert it again
    letting_go = threading.Timer(0.9, blocker.rollback)
    letting_go.start()
    try:
        with pytest.raises(dlock.LockTimeout), statement_deadline(Deadline(0.6), "sqlite"):
            queue.beat(req, ticket)
            time.sleep(1)  # (not reached)
    finally:
        letting_go.join()
        blocker.close()
        queue.done(ticket)
    with connections["sqlite"].cursor() as cur:
        cur.execute("SELECT id, name FROM django_dlock_waiter")
        assert cur.fetchall() == [(ticket, "lock:renewed")]


@pytest.mark.django_db(transaction=True, databases=["sqlite"])
@pytest.mark.parametrize("timeout", [10, None], ids=["timeout", "forever"])
def test_a_sqlite_lease_taken_after_waiting_for_another_writer_is_counted_from_then(timeout):
    """Another connection keeps SQLite's write lock (a writer paused inside
    its transaction) for longer than the lease: the acquire of a free key
    waits for it here, and its lease starts when its statement got the
    write lock. Counted from when the statement was first sent, the lease
    would look run out at once: the renewer would report it lost while the
    database holds it."""
    ttl = 1.0
    losses: list[dlock.LockLost] = []
    writer = connections["sqlite"].copy()
    writer.ensure_connection()
    raw = writer.connection
    raw.execute("BEGIN IMMEDIATE")  # SQLite's one write lock
    result: dict[str, object] = {}
    granted, checked = threading.Event(), threading.Event()

    def take() -> None:
        try:
            lk = dlock.lock(
                "paused-writer", using="sqlite", ttl=ttl, renew=True, on_lost=losses.append
            )
            result["got"] = lk.acquire(timeout=timeout)
            granted.set()
            checked.wait(30)
            result["lost"] = lk.lost
            lk.release()  # LockLost if it was reported lost
            result["released"] = True
        finally:
            granted.set()
            connections.close_all()

    thread = threading.Thread(target=take)
    thread.start()
    try:
        time.sleep(ttl + 0.5)  # the acquire waits for the write lock meanwhile
        assert not granted.is_set()
    finally:
        raw.execute("ROLLBACK")
        writer.close()
    assert granted.wait(30)
    time.sleep(ttl / 2)  # past its first renewal, before its lease could end
    checked.set()
    thread.join(30)
    assert result == {"got": True, "lost": False, "released": True}
    assert losses == []
