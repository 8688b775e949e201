"""Two-phase acquire: :meth:`Lock.enqueue` takes a place, :meth:`Lock.wait` is granted it.

A caller that must not lose its turn (fair hand-over, or a place in the
queue taken before slow work starts) splits ``acquire`` in two:

* ``enqueue()`` tries every key once, in sorted order; at the first busy
  key it takes a place in that key's queue and returns ``False``. On
  ``lease`` the place is a ticket in the waiter table, kept alive by a
  thread of the process while the caller's thread or task runs; on
  ``advisory`` (PostgreSQL) it is a ``pg_advisory_lock`` already waiting in
  PostgreSQL's own lock queue (see the PostgreSQL docs, "Advisory Locks").
* ``wait()`` / ``await_lock()`` is granted that place, then takes the rest
  of the keys in order (all or none).

The place belongs to the holder (thread or task) that took it and is kept
per :class:`~django_dlock.locks.Lock` object until ``wait``, or until
:func:`give_up` (``release()``). A place nobody can wait for any more ends
by itself (see :func:`_wanted`). Keys are taken by the same walk as
``acquire`` (:class:`~django_dlock.acquiring.Attempt`).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.db import connections

from django_dlock.acquiring import Attempt
from django_dlock.exceptions import DLockError, StrategyNotSupported
from django_dlock.identity import Holder, current_holder, holder_alive
from django_dlock.retry import Deadline
from django_dlock.strategies import queue
from django_dlock.strategies._pg import psycopg3
from django_dlock.strategies.base import Grant, Request, Strategy, TakesTickets

if TYPE_CHECKING:
    from django_dlock.locks import Lock
    from django_dlock.strategies.advisory.pending import Pending

__all__ = ["aenqueue", "await_lock", "enqueue", "give_up", "has_place", "wait"]


@dataclass
class Queued:
    """A place taken by :meth:`Lock.enqueue` for ``keys[index]``: a lease ticket,
    or a pending advisory lock."""

    req: Request
    index: int
    ticket: int | None = None
    pending: Pending | None = None


def _two_phase_strategy(lock: Lock, alias: str) -> Strategy:
    if lock._quorum is not None:
        raise StrategyNotSupported(
            f"enqueue()/wait() are not supported on a quorum lock (using="
            f"{list(lock._quorum)!r}): a place in a queue lives on one database. "
            "Use acquire(timeout=...) on the quorum lock, or enqueue() on a lock "
            "on one database"
        )
    strategy = lock._strategy(alias)
    if isinstance(strategy, TakesTickets):
        return strategy
    if connections[alias].vendor == "postgresql" and _advisory_pending(strategy) is not None:
        return strategy
    raise StrategyNotSupported(
        f"enqueue()/wait() need a strategy that keeps a place in a queue (lease, or "
        f"advisory on PostgreSQL); {lock.strategy_name!r} on {alias!r} cannot: "
        "use acquire(timeout=...)"
    )


def _advisory_pending(strategy: Strategy) -> object | None:
    """The PostgreSQL advisory implementation behind ``strategy`` (which keeps a
    place as a pending lock in the server's queue), if it is one. (Imported
    here: the advisory sessions need psycopg, which a site without
    PostgreSQL does not install.)"""
    if not psycopg3():
        return None
    from django_dlock.strategies.advisory.pending import pending_capable

    return pending_capable(strategy, "postgresql")


def _queued_places(lock: Lock) -> dict[str, Queued]:
    found: dict[str, Queued] | None = getattr(lock, "_queued_by_holder", None)
    if found is None:
        found = {}
        lock._queued_by_holder = found
    return found


def _enqueue_begin(lock: Lock, holder: Holder) -> tuple[str, Strategy]:
    lock._check_options()
    alias = lock.alias
    strategy = _two_phase_strategy(lock, alias)
    if holder.token() in _queued_places(lock):
        raise DLockError(f"{lock.name!r} is already queued by this {holder.kind}: call wait()")
    return alias, strategy


def _wanted(lock: Lock) -> Callable[[], bool]:
    """Whether a place the calling holder takes on ``lock`` may still be waited for.

    It may while the thread or task that took it runs, the
    :class:`~django_dlock.locks.Lock` object it was taken with exists (its
    place is kept on it), and for at most the lock's ``ttl`` seconds: a
    place is a lease on a position in the queue. Code that raised between
    ``enqueue()`` and ``wait()`` therefore blocks nobody for long.
    """
    alive = holder_alive()
    lock_ref = weakref.ref(lock)
    until = time.monotonic() + lock.ttl
    return lambda: alive() and lock_ref() is not None and time.monotonic() < until


def _queue_at(lock: Lock, attempt: Attempt, req: Request, ticket: int | None) -> None:
    """Keep the place taken for ``req`` (a lease ticket, else a pending advisory lock)."""
    holder = attempt.holder
    wanted = _wanted(lock)
    if ticket is not None:
        queue.keeper.add(req, ticket, wanted)
        queued = Queued(req, len(attempt.taken), ticket=ticket)
    else:
        from django_dlock.strategies.advisory.pending import Pending, pending_capable

        impl = pending_capable(attempt.strategy, connections[req.alias].vendor)
        assert impl is not None
        queued = Queued(req, len(attempt.taken), pending=Pending(impl, req, holder, wanted))
    _queued_places(lock)[holder.token()] = queued


def enqueue(lock: Lock) -> bool:
    """:meth:`Lock.enqueue`: try each key once; at the first busy one, take a place."""
    holder = current_holder()
    alias, strategy = _enqueue_begin(lock, holder)
    attempt = Attempt(lock, holder, alias, strategy, Deadline(0.0))
    busy = attempt.run(lock.keys, keep=True)
    if busy is None:
        return True
    ticket = strategy.enqueue(busy) if isinstance(strategy, TakesTickets) else None
    _queue_at(lock, attempt, busy, ticket)
    return False


async def aenqueue(lock: Lock) -> bool:
    """:meth:`Lock.aenqueue`: the same walk, its queries off the event loop."""
    holder = current_holder()
    alias, strategy = _enqueue_begin(lock, holder)
    attempt = Attempt(lock, holder, alias, strategy, Deadline(0.0))
    busy = await attempt.arun(lock.keys, keep=True)
    if busy is None:
        return True
    ticket = await strategy.aenqueue(busy) if isinstance(strategy, TakesTickets) else None
    _queue_at(lock, attempt, busy, ticket)
    return False


def _claim(queued: Queued) -> bool:
    """Take the place back from whoever kept it; ``False`` if it was given up meanwhile."""
    if queued.ticket is not None:
        return queue.keeper.remove(queued.ticket)
    assert queued.pending is not None
    return queued.pending.claim()


def _wait_begin(
    lock: Lock, holder: Holder, timeout: float | None
) -> tuple[Queued | None, Deadline, bool]:
    """The caller's place (``None``: ``enqueue`` acquired), the deadline, and
    whether the place is still there to wait for."""
    deadline = Deadline(lock._resolve_timeout(True, timeout))
    queued = _queued_places(lock).pop(holder.token(), None)
    if queued is None and not lock.owned(holder):
        raise DLockError(f"{lock.name!r}: wait() without enqueue() (or after it gave up)")
    return queued, deadline, queued is None or _claim(queued)


def has_place(lock: Lock, holder: Holder) -> bool:
    """Whether ``holder`` has a place on ``lock`` (taken by ``enqueue``, not waited for)."""
    found: dict[str, Queued] | None = getattr(lock, "_queued_by_holder", None)
    return found is not None and holder.token() in found


def give_up(lock: Lock, holder: Holder) -> None:
    """Give up ``holder``'s place on ``lock`` and the keys ``enqueue`` took before it.

    ``release()`` between ``enqueue()`` and ``wait()``: the ticket is
    deleted (the next waiter woken on PostgreSQL), or the pending advisory
    lock cancelled in the server (and given back if it was granted).
    """
    queued = _queued_places(lock).pop(holder.token(), None)
    if queued is None:
        return
    attempt = _attempt_after(lock, holder, queued, Deadline(0.0))
    try:
        if queued.ticket is not None:
            if queue.keeper.remove(queued.ticket):
                queue.leave(queued.req.alias, queued.ticket)
        elif queued.pending is not None:
            queued.pending.give_up()
    finally:
        attempt.undo()


def _attempt_after(lock: Lock, holder: Holder, queued: Queued, deadline: Deadline) -> Attempt:
    """The attempt that holds the keys before ``queued``'s and takes the rest."""
    alias = queued.req.alias
    taken = lock.keys[: queued.index]
    return Attempt(lock, holder, alias, lock._strategy(alias), deadline, taken)


def wait(lock: Lock, timeout: float | None) -> bool:
    """:meth:`Lock.wait`: block for the place, then take the remaining keys."""
    holder = current_holder()
    queued, deadline, kept = _wait_begin(lock, holder, timeout)
    if queued is None:
        return True
    attempt = _attempt_after(lock, holder, queued, deadline)
    if not kept:  # the place ran out before wait() (see _wanted)
        attempt.undo()
        return False
    sent_at = time.monotonic()
    try:
        if queued.pending is not None:
            left = None if deadline.timeout is None else deadline.remaining()
            grant = queued.pending.wait(left)
        else:
            strategy = attempt.strategy
            assert isinstance(strategy, TakesTickets) and queued.ticket is not None
            grant = strategy.wait_ticket(queued.req, queued.ticket, deadline, lock.retry_interval)
    except BaseException:
        if queued.pending is not None:
            queued.pending.give_up()
        attempt.undo()
        raise
    if grant is None:
        attempt.undo()
        return False
    attempt.hold(queued.req, grant, sent_at)
    return attempt.run(lock.keys[queued.index + 1 :]) is None


async def _await_place(lock: Lock, queued: Queued, deadline: Deadline) -> Grant | None:
    strategy = lock._strategy(queued.req.alias)
    pending = queued.pending
    if pending is None:
        assert isinstance(strategy, TakesTickets) and queued.ticket is not None
        return await strategy.await_ticket(queued.req, queued.ticket, deadline, lock.retry_interval)
    left = None if deadline.timeout is None else deadline.remaining()
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), left)
    except asyncio.TimeoutError:
        await sync_to_async(pending.give_up, thread_sensitive=False)()
        return None
    except asyncio.CancelledError:
        await asyncio.shield(sync_to_async(pending.give_up, thread_sensitive=False)())
        raise


async def await_lock(lock: Lock, timeout: float | None) -> bool:
    """:meth:`Lock.await_lock`: cancelling it gives the place up and leaves no lock."""
    holder = current_holder()
    queued, deadline, kept = await sync_to_async(_wait_begin)(lock, holder, timeout)
    if queued is None:
        return True
    attempt = _attempt_after(lock, holder, queued, deadline)
    if not kept:  # the place ran out before await_lock() (see _wanted)
        await attempt.aundo()
        return False
    sent_at = time.monotonic()
    try:
        grant = await _await_place(lock, queued, deadline)
    except BaseException:
        await attempt.aundo()
        raise
    if grant is None:
        await attempt.aundo()
        return False
    attempt.hold(queued.req, grant, sent_at)
    return await attempt.arun(lock.keys[queued.index + 1 :]) is None
