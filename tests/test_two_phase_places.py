"""Two-phase places at their edges: a renewal racing ``wait()``, a place
nobody waits for, and a place given up on purpose.

Lease places are tickets renewed by the process's keeper thread; advisory
places (PostgreSQL) are ``pg_advisory_lock`` statements waiting in the
server's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django.test import override_settings

import django_dlock as dlock
from django_dlock.strategies import queue

from .helpers import in_thread, wait_until
from .test_two_phase import Holder, _advisory_waiting, _tickets

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


# -- giving a place up ---------------------------------------------------------------

CASES = [
    pytest.param("lease", "default", id="lease-postgresql"),
    pytest.param("lease", "sqlite", id="lease-sqlite"),
    pytest.param("lease", "mysql", id="lease-mariadb"),
    pytest.param("advisory", "default", id="advisory-postgresql"),
]


def _try(alias: str, key: str, strategy: str, timeout: float = 0) -> bool:
    """In a thread of its own: whether a newcomer gets the key (and lets it go)."""

    def run() -> bool:
        lk = dlock.lock(key, using=alias, strategy=strategy)
        if not lk.acquire(timeout=timeout):
            return False
        lk.release()
        return True

    return bool(in_thread(run))


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_release_between_enqueue_and_wait_gives_the_place_up(strategy, alias):
    key = f"tp-give-up-{strategy}"
    holder = Holder(alias, key, strategy)
    result: dict[str, object] = {}

    def waiter() -> None:
        lk = dlock.lock(key, using=alias, strategy=strategy, ttl=30)
        result["enqueued"] = lk.enqueue()
        lk.release()  # changed our mind: no LockNotOwned, the place is gone
        result["owned"] = lk.owned()

    in_thread(waiter)
    holder.release()
    assert result == {"enqueued": False, "owned": False}
    if strategy == "lease":
        assert _tickets(alias, f"lock:{key}") == 0
    assert _try(alias, key, strategy)  # nobody waits, nobody holds it


class _Pooled:
    """A thread that lives on after its job raised (as pool threads do)."""

    def __init__(self, job) -> None:
        self.raised = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(job,))
        self.thread.start()
        assert self.raised.wait(30)

    def _run(self, job) -> None:
        try:
            with contextlib.suppress(ValueError):
                job()
            gc.collect()
            self.raised.set()
            self.stop.wait(60)
        finally:
            connections.close_all()

    def end(self) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_a_place_whose_lock_object_is_gone_blocks_nobody(strategy, alias):
    key = f"tp-dropped-{strategy}"
    holder = Holder(alias, key, strategy)

    def job() -> None:
        lk = dlock.lock(key, using=alias, strategy=strategy, ttl=60)
        assert lk.enqueue() is False
        raise ValueError("the work between enqueue() and wait() failed")

    pooled = _Pooled(job)
    try:
        holder.release()
        # the thread lives on, but its place (and on advisory a lock granted
        # to it, which nobody would release) goes: a newcomer gets the key
        assert _try(alias, key, strategy, timeout=10)
    finally:
        pooled.end()


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_a_place_not_waited_for_within_the_ttl_runs_out(strategy, alias):
    key = f"tp-ttl-{strategy}"
    holder = Holder(alias, key, strategy)
    lk = dlock.lock(key, using=alias, strategy=strategy, ttl=1)
    kept: dict[str, object] = {}
    enqueued, go_on = threading.Event(), threading.Event()

    def waiter() -> None:
        try:
            kept["enqueued"] = lk.enqueue()
            enqueued.set()
            go_on.wait(30)  # the lock object and the thread live on
            kept["waited"] = lk.wait(timeout=0)
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert enqueued.wait(30)
        if strategy == "advisory":  # the place reaches the server's queue on its own
            wait_until(lambda: _advisory_waiting(alias) == 1)
        holder.release()  # the key goes to the place, which runs out after the ttl
        assert _try(alias, key, strategy, timeout=10)
    finally:
        go_on.set()
        thread.join(30)
    assert kept == {"enqueued": False, "waited": False}


# -- the session of an advisory place --------------------------------------------------


def test_statements_behind_a_pending_advisory_place_get_a_named_error_at_once(pg):
    holder = Holder(pg, "tp-busy-a", "advisory")
    outcome: dict[str, object] = {}

    def caller() -> None:
        try:
            other = dlock.lock("tp-busy-b", using=pg, strategy="advisory")
            assert other.acquire(timeout=0)
            place = dlock.lock("tp-busy-a", using=pg, strategy="advisory")
            assert place.enqueue() is False
            started = time.monotonic()
            try:
                dlock.lock("tp-busy-c", using=pg, strategy="advisory").acquire(timeout=3)
            except dlock.DLockError as exc:
                outcome["acquire"] = type(exc).__name__
            try:
                other.release()
            except dlock.DLockError as exc:
                outcome["release"] = type(exc).__name__
            outcome["seconds"] = time.monotonic() - started
            holder.release()
            outcome["waited"] = place.wait(timeout=10)
            place.release()
            other.release()  # the session is free again
            outcome["done"] = True
        finally:
            connections.close_all()

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(20)
    holder.release()  # (if the caller hung: it is let go)
    thread.join(30)
    assert outcome.get("acquire") == "SessionBusy"  # a DLockError
    assert outcome.get("release") == "SessionBusy"
    assert outcome["seconds"] < 2  # a named error at once, not after the wait
    assert outcome.get("waited") is True and outcome.get("done") is True
    assert not dlock.lock("tp-busy-b", using=pg, strategy="advisory").locked()


# -- acquire() and release() behind one's own place ----------------------------------


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_acquire_after_enqueue_waits_for_the_place(strategy, alias):
    key = f"tp-acquire-place-{strategy}"
    holder = Holder(alias, key, strategy)
    queued, let_go = threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def waiter() -> None:
        try:
            lk = dlock.lock(key, using=alias, strategy=strategy, ttl=30)
            result["enqueued"] = lk.enqueue()
            queued.set()
            assert let_go.wait(30)
            started = time.monotonic()
            result["acquired"] = lk.acquire(timeout=10)  # the place is granted
            result["seconds"] = time.monotonic() - started
            result["owned"] = lk.owned()
            lk.release()
            result["locked"] = lk.locked()  # (the lock object still lives)
        except BaseException as exc:
            result["error"] = repr(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert queued.wait(30)
        let_go.set()
        time.sleep(0.5)  # (acquire() is waiting by now)
        holder.release()  # the key goes to the place
    finally:
        let_go.set()
        thread.join(30)
    assert result.get("error") is None
    assert result["enqueued"] is False and result["acquired"] is True
    assert result["owned"] is True and result["locked"] is False
    assert float(result["seconds"]) < 10  # granted the place, not a second queue entry
    assert _try(alias, key, strategy)  # released: nobody holds or waits for it


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_acquire_after_enqueue_that_times_out_gives_the_place_up(strategy, alias):
    key = f"tp-acquire-timeout-{strategy}"
    holder = Holder(alias, key, strategy)
    result: dict[str, object] = {}

    def waiter() -> None:
        lk = dlock.lock(key, using=alias, strategy=strategy, ttl=30)
        result["enqueued"] = lk.enqueue()
        started = time.monotonic()
        try:
            result["acquired"] = lk.acquire(timeout=1)  # held all along: a timeout
        except BaseException as exc:
            result["acquired"] = repr(exc)
        result["seconds"] = time.monotonic() - started
        result["owned"] = lk.owned()

    try:
        in_thread(waiter)
        # the place is given up: no pending lock, no ticket
        if strategy == "advisory":
            assert _advisory_waiting(alias) == 0
        else:
            assert _tickets(alias, f"lock:{key}") == 0
    finally:
        holder.release()
    assert result["enqueued"] is False
    assert result["acquired"] is False  # not SessionBusy: it waited for its place
    assert 0.9 <= float(result["seconds"]) < 1 + 5
    assert result["owned"] is False
    assert _try(alias, key, strategy)


def test_release_gives_an_advisory_place_up_even_if_the_cancel_came_too_early(pg, monkeypatch):
    # The place's statement is held up on its own side, just before it is
    # sent: another statement is in flight on the session (the watcher
    # reading its socket, say). A cancel sent then reaches a server session
    # that runs nothing, and the server ignores it; release() must still
    # give the place up, not wait until the holder lets go.
    from django_dlock.strategies.advisory import postgresql

    key = "tp-early-cancel"
    holder = Holder(pg, key, "advisory")
    seen: dict[str, object] = {}
    held_up, go = threading.Event(), threading.Event()
    real_wait = postgresql.AdvisoryStrategy._wait

    def wait_on_a_busy_session(self, session, req, sql, deadline, waiter):
        if req.key.name == f"lock:{key}" and not held_up.is_set():
            session.mutex.acquire()  # a statement in flight; the test lets it go
            seen["session"], seen["waiter"] = session, waiter
            held_up.set()
        return real_wait(self, session, req, sql, deadline, waiter)

    monkeypatch.setattr(postgresql.AdvisoryStrategy, "_wait", wait_on_a_busy_session)
    result: dict[str, object] = {}

    def waiter() -> None:
        try:
            lk = dlock.lock(key, using=pg, strategy="advisory", ttl=60)
            result["enqueued"] = lk.enqueue()
            assert go.wait(30)
            started = time.monotonic()
            lk.release()  # gives the place up
            result["seconds"] = time.monotonic() - started
            result["owned"] = lk.owned()
        except BaseException as exc:
            result["error"] = repr(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert held_up.wait(30)
        session, place = seen["session"], seen["waiter"]
        try:
            wait_until(lambda: session._waiting)  # the wait is about to be sent
            go.set()  # release(): the cancel goes out now
            wait_until(lambda: place.cancelled)
            with session._wait_mutex:  # (held while a cancel is being sent)
                pass
        finally:
            session.mutex.release()  # the wait statement goes out after its cancel
        thread.join(10)
    finally:
        go.set()
        holder.release()
        thread.join(30)
    assert result.get("error") is None
    assert result["enqueued"] is False and result["owned"] is False
    assert float(result["seconds"]) < 10, f"release() took {result['seconds']:.1f} s"
    assert _advisory_waiting(pg) == 0
    assert _try(pg, key, "advisory")


def test_a_statement_that_slipped_in_before_the_place_is_not_held_behind_it(pg, monkeypatch):
    # The caller's statement (releasing a key it holds) looks for a place on
    # its session just before enqueue()'s thread marks one; it then waits
    # for the session while the place's statement waits in the server.
    # It must get SessionBusy, not wait until the place is granted.
    from django_dlock.strategies.advisory import acquire as advisory_acquire
    from django_dlock.strategies.advisory import sessions

    holder = Holder(pg, "tp-slip-a", "advisory")
    checked, go_caller, go_place = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}
    real_refuse = sessions.Session._refuse_while_placed
    real_on_session = advisory_acquire.on_session

    def refuse_then_pause(self):  # the caller, held between its look and the session
        real_refuse(self)
        if seen.get("armed") and threading.get_ident() == seen["caller"] and not checked.is_set():
            seen["session"] = self
            checked.set()
            assert go_caller.wait(30)

    def place_paused(req, holder_of, acquire_on, kind=sessions.Pool):
        if req.key.name == "lock:tp-slip-a" and threading.get_ident() != seen.get("caller"):
            assert go_place.wait(30)  # enqueue()'s thread, before it marks the session
        return real_on_session(req, holder_of, acquire_on, kind)

    monkeypatch.setattr(sessions.Session, "_refuse_while_placed", refuse_then_pause)
    monkeypatch.setattr(advisory_acquire, "on_session", place_paused)
    result: dict[str, object] = {}

    def caller() -> None:
        try:
            other = dlock.lock("tp-slip-b", using=pg, strategy="advisory")
            assert other.acquire(timeout=0)
            place = dlock.lock("tp-slip-a", using=pg, strategy="advisory", ttl=60)
            seen["caller"] = threading.get_ident()
            result["enqueued"] = place.enqueue()
            seen["armed"] = True
            started = time.monotonic()
            try:
                other.release()
            except dlock.DLockError as exc:
                result["release"] = type(exc).__name__
            result["seconds"] = time.monotonic() - started
            holder.release()
            result["waited"] = place.wait(timeout=10)
            place.release()
            other.release()  # the session is free again
        except BaseException as exc:
            result["error"] = repr(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert checked.wait(30)
        go_place.set()  # the place marks the session and waits in the server
        session = seen["session"]
        wait_until(lambda: session._waiting and _advisory_waiting(pg) == 1)
        go_caller.set()
        thread.join(10)
    finally:
        go_place.set()
        go_caller.set()
        holder.release()
        thread.join(30)
    assert result.get("error") is None
    assert result["enqueued"] is False
    assert result.get("release") == "SessionBusy"
    assert float(result["seconds"]) < 10, f"release() took {result['seconds']:.1f} s"
    assert result["waited"] is True
    assert not dlock.lock("tp-slip-b", using=pg, strategy="advisory").locked()


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_async_acquire_after_aenqueue_waits_for_the_place(strategy, alias):
    key = f"tp-aacquire-place-{strategy}"
    holder = Holder(alias, key, strategy)

    async def main() -> dict[str, object]:
        lk = dlock.lock(key, using=alias, strategy=strategy, ttl=30)
        enqueued = await lk.aenqueue()
        await asyncio.to_thread(holder.release)  # the key goes to the place
        acquired = await lk.aacquire(timeout=3)
        owned = await lk.aowned()
        if acquired:
            await lk.arelease()
        locked = await sync_to_async(lk.locked)()  # (the lock object still lives)
        await sync_to_async(connections.close_all)()
        return {"enqueued": enqueued, "acquired": acquired, "owned": owned, "locked": locked}

    try:
        result = asyncio.run(main())
    finally:
        holder.release()
    assert result == {"enqueued": False, "acquired": True, "owned": True, "locked": False}
    assert _try(alias, key, strategy)
