"""PostgreSQL restarted while a lease is held and a waiter waits.

Runs on a private cluster created by the test (never the shared service).
Lease rows are durable, so the holder keeps its lease across the restart:
its renewals and its own statements reconnect, the waiter keeps waiting
(its LISTEN connection reconnects too) and gets the lock on release.

The restart comes once the waiter has its place in the queue: a waiter in
the queue rides out an outage, while an acquire whose first statement
cannot reach the database raises ``DatabaseUnavailable`` (documented in
"When the database cannot be reached").
"""

from __future__ import annotations

import threading

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import notify
from django_dlock.models import Waiter

from .helpers import wait_until
from .pgcluster import attached_cluster

ALIAS = "restartable"


cluster = attached_cluster(ALIAS)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", ALIAS])
def test_restart_while_held_and_waited_for(cluster):
    holder = dlock.lock("restart", using=ALIAS, ttl=2.0, renew=True)
    holder.acquire()
    renewer = holder._holdings()[0].renewer
    result: dict[str, object] = {}

    def waiter():
        try:
            lk = dlock.lock("restart", using=ALIAS, timeout=120)
            result["acquired"] = lk.acquire()
            result["fence"] = lk.fence
            lk.release()
        except BaseException as exc:
            result["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: notify.listener(ALIAS).healthy, timeout=30)
    wait_until(lambda: Waiter.objects.using(ALIAS).filter(name="lock:restart").exists(), 30)

    cluster.restart()

    before = renewer.renewals
    wait_until(lambda: renewer.renewals >= before + 2, timeout=60)
    assert not holder.lost and holder.owned()
    assert thread.is_alive() and "acquired" not in result, result  # still waiting
    fence = holder.fence
    holder.release()
    thread.join(120)
    assert result.get("acquired") is True, result
    assert result["fence"] > fence
