"""Two-phase places at their edges: a renewal racing ``wait()``, a place
nobody waits for, and a place given up on purpose.

Lease places are tickets renewed by the process's keeper thread; advisory
places (PostgreSQL) are ``pg_advisory_lock`` statements waiting in the
server's queue.
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections
from django.test import override_settings

import django_dlock as dlock
from django_dlock.strategies import queue

from .helpers import in_thread
from .test_two_phase import Holder, _tickets

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


# -- a renewal in flight when wait() takes the ticket -------------------------------


def test_a_renewal_in_flight_never_puts_back_a_ticket_wait_used(pg, monkeypatch):
    entered, go, finished = threading.Event(), threading.Event(), threading.Event()
    real_beat = queue.beat

    def slow_beat(req, ticket):  # the keeper's renewal, held at its start by the test
        if req.key.name != "lock:tp-race" or go.is_set():
            return real_beat(req, ticket)
        entered.set()
        go.wait(30)
        try:
            return real_beat(req, ticket)
        finally:
            finished.set()

    monkeypatch.setattr(queue, "beat", slow_beat)
    holder = Holder(pg, "tp-race")
    proceed, result = threading.Event(), {}

    def waiter() -> None:
        try:
            lk = dlock.lock("tp-race", using=pg, ttl=30)
            assert lk.enqueue() is False
            proceed.wait(30)
            result["waited"] = lk.wait(timeout=30)
            lk.release()
        except BaseException as exc:
            result["error"] = exc
        finally:
            connections.close_all()

    with override_settings(DLOCK_QUEUE_TICKET_TTL=0.4):  # renewed every 0.1 s
        thread = threading.Thread(target=waiter)
        thread.start()
        try:
            assert entered.wait(30)  # a renewal of the ticket is in flight
            holder.release()
            proceed.set()  # wait() takes the ticket while the renewal is stuck
            thread.join(1.0)  # time enough for wait() to use the ticket (if it may)
        finally:
            go.set()  # the renewal goes on
            thread.join(30)
    assert finished.wait(30)
    assert result == {"waited": True}
    # no ticket came back for the key: a newcomer takes the free key at once
    assert _tickets(pg, "lock:tp-race", live_only=True) == 0
    assert in_thread(lambda: dlock.lock("tp-race", using=pg).acquire(timeout=0)) is True
