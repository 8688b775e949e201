"""A database server that stops answering (SIGSTOP of every process of a
private PostgreSQL cluster): the holder of a lease hears that it lost the
lock when the lease ran out on its own clock, not when the server answers
again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

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


@pytest.mark.parametrize("strategy", ["lease", "advisory"])
@pytest.mark.parametrize("timeout", [0, 2])
def test_an_acquire_with_a_timeout_ends_near_it_when_the_server_stops_answering(
    cluster, strategy, timeout
):
    # The caller's connection (lease) or advisory session (pooled, idle) is
    # open before the server freezes.
    outcome = _acquire_on_frozen(
        cluster,
        lambda: dlock.lock(f"frozen-{strategy}-{timeout}", using=ALIAS, ttl=30, strategy=strategy),
        timeout,
    )
    assert outcome.get("acquired") is False, outcome  # not acquired: a timeout
    assert outcome["seconds"] < timeout + 3, (
        f"acquire(timeout={timeout}) took {outcome['seconds']:.1f} s"
    )


def test_an_async_advisory_acquire_ends_near_its_timeout_when_the_server_stops_answering(
    cluster,
):
    # The async path waits in worker threads: the deadline reaches them.
    import asyncio

    lk = dlock.lock("frozen-async", using=ALIAS, strategy="advisory")

    async def attempt() -> bool:
        return await lk.aacquire(timeout=2)

    outcome = _acquire_on_frozen(cluster, lambda: lk, 2, run=lambda lk: asyncio.run(attempt()))
    assert outcome.get("acquired") is False, outcome
    assert outcome["seconds"] < 5, f"aacquire(timeout=2) took {outcome['seconds']:.1f} s"


def test_a_new_advisory_session_to_a_frozen_server_ends_near_the_timeout(cluster):
    # No idle session to reuse: the new connection itself gets no answer.
    from django_dlock.strategies.advisory.sessions import close_all

    close_all()
    cluster.freeze()
    try:
        started = time.monotonic()
        acquired = dlock.lock("frozen-new", using=ALIAS, strategy="advisory").acquire(timeout=2)
        seconds = time.monotonic() - started
    finally:
        cluster.thaw()
    assert acquired is False
    assert seconds < 6, f"acquire(timeout=2) took {seconds:.1f} s"
    assert dlock.lock("frozen-new", using=ALIAS, strategy="advisory").acquire(timeout=10)
    close_all()


def _acquire_on_frozen(
    cluster: Any,
    make: Callable[[], dlock.Lock],
    timeout: float,
    run: Callable[[dlock.Lock], bool] | None = None,
) -> dict[str, Any]:
    """Acquire ``make()`` in a thread whose connection was open before the server
    froze; what it returned (or raised) and how long it took."""
    outcome: dict[str, Any] = {}
    ready, frozen = threading.Event(), threading.Event()

    def caller() -> None:
        try:
            lk = make()
            with lk:
                pass
            ready.set()
            assert frozen.wait(30)
            started = time.monotonic()
            try:
                outcome["acquired"] = run(lk) if run else lk.acquire(timeout=timeout)
            except dlock.DLockError as exc:
                outcome["error"] = f"{type(exc).__name__}: {exc}"
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
    return outcome
