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
in the :class:`Places` of the lock object it was taken with until ``wait``,
or until :func:`give_up` (``release()``). A place nobody can wait for any more ends
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
from django_dlock.options import Options
from django_dlock.retry import Deadline
from django_dlock.strategies import queue
from django_dlock.strategies.base import Grant, Request, Strategy, TakesTickets
from django_dlock.strategies.connection import psycopg3

if TYPE_CHECKING:
    from django_dlock.strategies.advisory.pending import Pending

__all__ = ["Places", "Queued", "aenqueue", "await_lock", "enqueue", "give_up", "wait"]


@dataclass
class Queued:
    """A place taken by ``enqueue()`` for ``opts.keys[index]``: a lease ticket,
    or a pending advisory lock."""

    opts: Options
    req: Request
    index: int
    ticket: int | None = None
    pending: Pending | None = None


class Places:
    """The places taken with one lock object, by holder token (not yet waited for).

    A place is wanted only while its ``Places`` exists (see :func:`_wanted`):
    a lock object that is dropped gives its places up.
    """

    __slots__ = ("__weakref__", "_by_token")

    def __init__(self) -> None:
        self._by_token: dict[str, Queued] = {}

    def has(self, holder: Holder) -> bool:
        """Whether ``holder`` has a place here."""
        return bool(self._by_token) and holder.token() in self._by_token

    def pop(self, holder: Holder) -> Queued | None:
        """Take ``holder``'s place out (``None``: it has none)."""
        if not self._by_token:
            return None
        return self._by_token.pop(holder.token(), None)

    def keep(self, holder: Holder, queued: Queued) -> None:
        self._by_token[holder.token()] = queued


def _two_phase_strategy(opts: Options) -> Strategy:
    if opts.quorum is not None:
        raise StrategyNotSupported(
            f"enqueue()/wait() are not supported on a quorum lock (using="
            f"{list(opts.quorum)!r}): a place in a queue lives on one database. "
            "Use acquire(timeout=...) on the quorum lock, or enqueue() on a lock "
            "on one database"
        )
    strategy, alias = opts.strategy, opts.alias
    if isinstance(strategy, TakesTickets):
        return strategy
    if connections[alias].vendor == "postgresql" and _advisory_pending(strategy) is not None:
        return strategy
    raise StrategyNotSupported(
        f"enqueue()/wait() need a strategy that keeps a place in a queue (lease, or "
        f"advisory on PostgreSQL); {opts.strategy_name!r} on {alias!r} cannot: "
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


def _enqueue_begin(opts: Options, places: Places, holder: Holder) -> Strategy:
    strategy = _two_phase_strategy(opts)
    if places.has(holder):
        raise DLockError(f"{opts.name!r} is already queued by this {holder.kind}: call wait()")
    return strategy


def _wanted(opts: Options, places: Places) -> Callable[[], bool]:
    """Whether a place the calling holder takes in ``places`` may still be waited for.

    It may while the thread or task that took it runs, the lock object it
    was taken with exists (its places are kept on it), and for at most the
    lock's ``ttl`` seconds: a place is a lease on a position in the queue.
    Code that raised between ``enqueue()`` and ``wait()`` therefore blocks
    nobody for long.
    """
    alive = holder_alive()
    places_ref = weakref.ref(places)
    until = time.monotonic() + opts.ttl
    return lambda: alive() and places_ref() is not None and time.monotonic() < until


def _queue_at(places: Places, attempt: Attempt, req: Request, ticket: int | None) -> None:
    """Keep the place taken for ``req`` (a lease ticket, else a pending advisory lock)."""
    holder, opts = attempt.holder, attempt.opts
    wanted = _wanted(opts, places)
    if ticket is not None:
        queue.keeper.add(req, ticket, wanted)
        queued = Queued(opts, req, len(attempt.taken), ticket=ticket)
    else:
        from django_dlock.strategies.advisory.pending import Pending, pending_capable

        impl = pending_capable(opts.strategy, connections[req.alias].vendor)
        assert impl is not None
        pending = Pending(impl, req, holder, wanted)
        queued = Queued(opts, req, len(attempt.taken), pending=pending)
    places.keep(holder, queued)


def enqueue(opts: Options, places: Places) -> bool:
    """``Lock.enqueue()``: try each key once; at the first busy one, take a place."""
    holder = current_holder()
    strategy = _enqueue_begin(opts, places, holder)
    attempt = Attempt(opts, holder, Deadline(0.0))
    busy = attempt.run(opts.keys, keep=True)
    if busy is None:
        return True
    ticket = strategy.enqueue(busy) if isinstance(strategy, TakesTickets) else None
    _queue_at(places, attempt, busy, ticket)
    return False


async def aenqueue(opts: Options, places: Places) -> bool:
    """``Lock.aenqueue()``: the same walk, its queries off the event loop."""
    holder = current_holder()
    strategy = _enqueue_begin(opts, places, holder)
    attempt = Attempt(opts, holder, Deadline(0.0))
    busy = await attempt.arun(opts.keys, keep=True)
    if busy is None:
        return True
    ticket = await strategy.aenqueue(busy) if isinstance(strategy, TakesTickets) else None
    _queue_at(places, attempt, busy, ticket)
    return False


def _claim(queued: Queued) -> bool:
    """Take the place back from whoever kept it; ``False`` if it was given up meanwhile."""
    if queued.ticket is not None:
        return queue.keeper.remove(queued.ticket)
    assert queued.pending is not None
    return queued.pending.claim()


def give_up(queued: Queued, holder: Holder) -> None:
    """Give up ``holder``'s place and the keys ``enqueue`` took before it.

    ``release()`` between ``enqueue()`` and ``wait()``: the ticket is
    deleted (the next waiter woken on PostgreSQL), or the pending advisory
    lock cancelled in the server (and given back if it was granted).
    """
    attempt = _attempt_after(queued, holder, Deadline(0.0))
    try:
        if queued.ticket is not None:
            if queue.keeper.remove(queued.ticket):
                queue.leave(queued.req.alias, queued.ticket)
        elif queued.pending is not None:
            queued.pending.give_up()
    finally:
        attempt.undo()


def _attempt_after(queued: Queued, holder: Holder, deadline: Deadline) -> Attempt:
    """The attempt that holds the keys before ``queued``'s and takes the rest."""
    return Attempt(queued.opts, holder, deadline, queued.opts.keys[: queued.index])


def wait(queued: Queued, holder: Holder, deadline: Deadline) -> bool:
    """``Lock.wait()``: block for the place, then take the remaining keys."""
    attempt = _attempt_after(queued, holder, deadline)
    if not _claim(queued):  # the place ran out before wait() (see _wanted)
        attempt.undo()
        return False
    opts = queued.opts
    sent_at = time.monotonic()
    try:
        if queued.pending is not None:
            left = None if deadline.timeout is None else deadline.remaining()
            grant = queued.pending.wait(left)
        else:
            strategy = opts.strategy
            assert isinstance(strategy, TakesTickets) and queued.ticket is not None
            grant = strategy.wait_ticket(queued.req, queued.ticket, deadline, opts.retry_interval)
    except BaseException:
        if queued.pending is not None:
            queued.pending.give_up()
        attempt.undo()
        raise
    if grant is None:
        attempt.undo()
        return False
    attempt.hold(queued.req, grant, sent_at)
    return attempt.run(opts.keys[queued.index + 1 :]) is None


async def _await_place(queued: Queued, deadline: Deadline) -> Grant | None:
    opts = queued.opts
    pending = queued.pending
    if pending is None:
        strategy = opts.strategy
        assert isinstance(strategy, TakesTickets) and queued.ticket is not None
        return await strategy.await_ticket(queued.req, queued.ticket, deadline, opts.retry_interval)
    left = None if deadline.timeout is None else deadline.remaining()
    try:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), left)
    except asyncio.TimeoutError:
        await sync_to_async(pending.give_up, thread_sensitive=False)()
        return None
    except asyncio.CancelledError:
        await asyncio.shield(sync_to_async(pending.give_up, thread_sensitive=False)())
        raise


async def await_lock(queued: Queued, holder: Holder, deadline: Deadline) -> bool:
    """``Lock.await_lock()``: cancelling it gives the place up and leaves no lock."""
    attempt = _attempt_after(queued, holder, deadline)
    if not await sync_to_async(_claim)(queued):  # the place ran out (see _wanted)
        await attempt.aundo()
        return False
    sent_at = time.monotonic()
    try:
        grant = await _await_place(queued, deadline)
    except BaseException:
        await attempt.aundo()
        raise
    if grant is None:
        await attempt.aundo()
        return False
    attempt.hold(queued.req, grant, sent_at)
    return await attempt.arun(queued.opts.keys[queued.index + 1 :]) is None
