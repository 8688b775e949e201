"""A database server that stops answering (SIGSTOP of every process of a
private PostgreSQL cluster): the holder of a lease hears that it lost the
lock when the lease ran out on its own clock, not when the server answers
again.
"""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections

import django_dlock as dlock

from .pgcluster import attached_cluster

ALIAS = "freezable"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", ALIAS]),
]


cluster = attached_cluster(ALIAS)


def test_a_lease_holder_cut_off_is_told_it_lost_when_the_lease_ran_out(cluster):
    lost = threading.Event()
    lk = dlock.lock("frozen", using=ALIAS, ttl=2, renew=True, on_lost=lambda error: lost.set())
    assert lk.acquire(timeout=0)
    try:
        cluster.freeze()
        frozen_at = time.monotonic()
        # the lease ran out on the database's clock at most ttl after the last
        # renewal was sent: the holder must know by then (and a little after)
        assert lost.wait(30), "the holder was never told"
        told_after = time.monotonic() - frozen_at
        assert lk.lost
        assert not lk.held()  # answered without the database
    finally:
        cluster.thaw()
    assert told_after < 4, f"told {told_after:.1f} s after the server froze (ttl 2 s)"
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_an_acquire_with_a_timeout_ends_near_it_when_the_server_stops_answering(cluster):
    outcome: dict[str, object] = {}
    ready, frozen = threading.Event(), threading.Event()

    def caller() -> None:
        try:
            lk = dlock.lock("frozen-timeout", using=ALIAS, ttl=30)
            with lk:  # the thread's connection is open before the server freezes
                pass
            ready.set()
            assert frozen.wait(30)
            started = time.monotonic()
            try:
                outcome["acquired"] = lk.acquire(timeout=2)
            except dlock.DLockError as exc:
                outcome["error"] = type(exc).__name__
            outcome["seconds"] = time.monotonic() - started
        finally:
            connections[ALIAS].close()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert ready.wait(30)
        cluster.freeze()
        frozen.set()
        thread.join(30)  # a bound against a hang, thawed below either way
    finally:
        cluster.thaw()
        thread.join(30)
    assert outcome.get("acquired") is False, outcome  # not acquired: a timeout
    assert outcome["seconds"] < 5, f"acquire(timeout=2) took {outcome['seconds']:.1f} s"
