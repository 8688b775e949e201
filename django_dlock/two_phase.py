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
per :class:`~django_dlock.locks.Lock` object until ``wait``. The sync and
async ``enqueue`` share one plan (:func:`_enqueue_plan`); only the way each
step runs differs.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from asgiref.sync import sync_to_async
from django.db import connections

from django_dlock._threads import to_the_end
from django_dlock.exceptions import DLockError, StrategyNotSupported
from django_dlock.identity import Holder, current_holder, holder_alive
from django_dlock.retry import Deadline
from django_dlock.strategies import queue
from django_dlock.strategies.advisory.pending import Pending, pending_capable
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.lease import LeaseStrategy

if TYPE_CHECKING:
    from django_dlock.locks import Holding, Lock

__all__ = ["aenqueue", "await_lock", "enqueue", "wait"]


@dataclass
class Queued:
    """A place taken by :meth:`Lock.enqueue` for ``keys[index]``: a lease ticket,
    or a pending advisory lock."""

    req: Request
    index: int
    ticket: int | None = None
    pending: Pending | None = None


#: what the enqueue plan asks its driver to do: renew a holding whose lease
#: may have run out, try a key once, or take a lease ticket
_Step = (
    tuple[Literal["renew"], "Holding"]
    | tuple[Literal["acquire"], Request]
    | tuple[Literal["ticket"], Request]
)


def _two_phase_strategy(lock: Lock, alias: str) -> Strategy:
    strategy = lock._strategy(alias)
    if isinstance(strategy, LeaseStrategy):
        return strategy
    if pending_capable(strategy, connections[alias].vendor) is not None:
        return strategy
    raise StrategyNotSupported(
        f"enqueue()/wait() need a strategy that keeps a place in a queue (lease, or "
        f"advisory on PostgreSQL); {lock.strategy_name!r} on {alias!r} cannot: "
        "use acquire(timeout=...)"
    )


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


def _pending(holder: Holder, strategy: Strategy, req: Request) -> Pending:
    impl = pending_capable(strategy, connections[req.alias].vendor)
    assert impl is not None
    return Pending(impl, req, holder)


def _enqueue_plan(
    lock: Lock, holder: Holder, alias: str, strategy: Strategy
) -> Generator[_Step, Any, bool]:
    """The steps of ``enqueue`` for one holder; the driver sends each step's result.

    ``("renew", holding)`` sends nothing back, ``("acquire", req)`` a
    :class:`Grant` or None, ``("ticket", req)`` the ticket number.
    """
    for index, key in enumerate(lock.keys):
        stale = lock._stale(holder, alias, strategy, key)
        if stale is not None:
            yield ("renew", stale)
        if lock._reenter(holder, alias, strategy, key):
            continue
        req = lock._request(holder, alias, key)
        sent_at = time.monotonic()
        grant: Grant | None = yield ("acquire", req)
        if grant is None:
            if isinstance(strategy, LeaseStrategy):
                ticket: int = yield ("ticket", req)
                queue.keeper.add(req, ticket, holder_alive())
                queued = Queued(req, index, ticket=ticket)
            else:
                queued = Queued(req, index, pending=_pending(holder, strategy, req))
            _queued_places(lock)[holder.token()] = queued
            return False
        lock._held(holder, strategy, req, grant.fence, sent_at, 0.0)
    return True


def enqueue(lock: Lock) -> bool:
    """:meth:`Lock.enqueue`: run the plan's steps in the calling thread."""
    holder = current_holder()
    alias, strategy = _enqueue_begin(lock, holder)
    plan = _enqueue_plan(lock, holder, alias, strategy)
    result: object = None
    try:
        while True:
            step = plan.send(result)
            if step[0] == "renew":
                lock._renew_or_lose(step[1], lock._lease_ttl())
                result = None
            elif step[0] == "acquire":
                result = strategy.acquire(step[1], Deadline(0.0), lock.retry_interval)
            else:
                result = queue.enqueue(step[1])
    except StopIteration as done:
        return bool(done.value)


async def aenqueue(lock: Lock) -> bool:
    """:meth:`Lock.aenqueue`: the same plan, its queries off the event loop."""
    holder = current_holder()
    alias, strategy = _enqueue_begin(lock, holder)
    plan = _enqueue_plan(lock, holder, alias, strategy)
    result: object = None
    try:
        while True:
            step = plan.send(result)
            if step[0] == "renew":
                await sync_to_async(lock._renew_or_lose)(step[1], lock._lease_ttl())
                result = None
            elif step[0] == "acquire":
                result = await strategy.aacquire(step[1], Deadline(0.0), lock.retry_interval)
            else:
                assert isinstance(strategy, LeaseStrategy)
                result = await strategy.aenqueue(step[1])
    except StopIteration as done:
        return bool(done.value)


def _wait_begin(
    lock: Lock, holder: Holder, timeout: float | None
) -> tuple[Queued | None, Deadline]:
    deadline = Deadline(lock._resolve_timeout(True, timeout))
    queued = _queued_places(lock).pop(holder.token(), None)
    if queued is None and not lock.owned(holder):
        raise DLockError(f"{lock.name!r}: wait() without enqueue() (or after it gave up)")
    if queued is not None and queued.ticket is not None:
        queue.keeper.remove(queued.ticket)
    return queued, deadline


def wait(lock: Lock, timeout: float | None) -> bool:
    """:meth:`Lock.wait`: block for the place, then take the remaining keys."""
    holder = current_holder()
    queued, deadline = _wait_begin(lock, holder, timeout)
    if queued is None:
        return True
    req = queued.req
    alias, strategy = req.alias, lock._strategy(req.alias)
    taken = list(lock.keys[: queued.index])
    try:
        sent_at = time.monotonic()
        if queued.pending is not None:
            left = None if deadline.timeout is None else deadline.remaining()
            grant = queued.pending.wait(left)
        else:
            assert isinstance(strategy, LeaseStrategy) and queued.ticket is not None
            grant = strategy.wait_ticket(req, queued.ticket, deadline, lock.retry_interval)
        if grant is None:
            lock._undo(holder, alias, strategy, taken)
            return False
        lock._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
        taken.append(req.key)
        for key in lock.keys[queued.index + 1 :]:
            if not lock._reenter(holder, alias, strategy, key):
                req = lock._request(holder, alias, key)
                sent_at = time.monotonic()
                grant = strategy.acquire(req, deadline, lock.retry_interval)
                if grant is None:
                    lock._undo(holder, alias, strategy, taken)
                    return False
                lock._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
            taken.append(key)
    except BaseException:
        if queued.pending is not None and req is queued.req:
            queued.pending.give_up()
        lock._undo(holder, alias, strategy, taken)
        raise
    return True


async def _await_place(lock: Lock, queued: Queued, deadline: Deadline) -> Grant | None:
    strategy = lock._strategy(queued.req.alias)
    pending = queued.pending
    if pending is None:
        assert isinstance(strategy, LeaseStrategy) and queued.ticket is not None
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
    queued, deadline = await sync_to_async(_wait_begin)(lock, holder, timeout)
    if queued is None:
        return True
    alias, strategy = queued.req.alias, lock._strategy(queued.req.alias)
    taken = list(lock.keys[: queued.index])
    try:
        sent_at = time.monotonic()
        grant = await _await_place(lock, queued, deadline)
        if grant is not None:
            req = queued.req
            lock._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
            taken.append(req.key)
            for key in lock.keys[queued.index + 1 :]:
                if not lock._reenter(holder, alias, strategy, key):
                    req = lock._request(holder, alias, key)
                    sent_at = time.monotonic()
                    grant = await strategy.aacquire(req, deadline, lock.retry_interval)
                    if grant is None:
                        break
                    lock._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
                taken.append(key)
        if grant is None:
            undo = functools.partial(lock._undo, holder, alias, strategy, list(taken))
            await to_the_end(undo, f"giving back {lock.name!r}")
            return False
    except BaseException:
        undo = functools.partial(lock._undo, holder, alias, strategy, list(taken))
        await to_the_end(undo, f"giving back {lock.name!r}")
        raise
    return True
