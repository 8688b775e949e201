"""How a lease waiter with a ticket waits: one plan for a sync and an async driver.

A waiter holds a ticket in the key's queue (see
:mod:`django_dlock.strategies.queue`). Its wait is a generator of steps
(:func:`plan`): "look" (renew the ticket when due and read how long
the current lease runs), "try" (take the lease with the ticket), "detect"
(past ``DLOCK_DEADLOCK_TIMEOUT``: look for a deadlock, :mod:`.deadlock`)
and "sleep" (park until woken or the pause ends). A :class:`TicketWait` hands them to a
driver, which runs each its own way (``LeaseStrategy.wait_ticket`` in the
calling thread, ``LeaseStrategy.await_ticket`` off the event loop) and
replies with what it got, so both follow the same plan.

One acquiring step of an async caller, in a worker thread, safe against cancellation.

A statement cannot be stopped once it runs. If the task is cancelled
meanwhile (``asyncio.wait_for``, a client that went away), a lease the step
took is given back as soon as the step ends, so a cancelled acquire leaves
no lock behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

from asgiref.sync import sync_to_async
from django.db import connections

from django_dlock import acquire_notes, notify
from django_dlock._threads import start_db_thread
from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DatabaseUnavailable
from django_dlock.retry import OUTAGE_MAX_PAUSE, Deadline, interval, outage_pause
from django_dlock.strategies import queue
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import psycopg3
from django_dlock.strategies.lease import deadlock
from django_dlock.strategies.lease.sql import TABLE, WAITERS, read

logger = logging.getLogger("django_dlock")


class Handoff:
    """What a worker thread's acquiring step and its (maybe cancelled) task share."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.cancelled = False
        self.finished = False
        self.result: Any = None


async def attempt(step: Callable[[], Any], req: Request, release: Callable[[Request], bool]) -> Any:
    """Run ``step`` (an acquiring step for ``req``) in a worker thread; if the task
    is cancelled, ``release(req)`` once the step has taken the lease (returned a
    fencing number)."""
    handoff = Handoff()

    def run() -> Any:
        result = step()
        with handoff.mutex:
            handoff.finished = True
            handoff.result = result
            give_back = handoff.cancelled
        if give_back:
            _give_back(req, result, release)
        return result

    try:
        return await sync_to_async(run)()
    except asyncio.CancelledError:
        with handoff.mutex:
            handoff.cancelled = True
            late = handoff.finished
        if late:  # the step finished but its result never reached us
            start_db_thread(
                functools.partial(_give_back, req, handoff.result, release),
                "django-dlock-give-back",
                alias=req.alias,
            )
        raise


def _give_back(req: Request, result: Any, release: Callable[[Request], bool]) -> None:
    if isinstance(result, int) and not isinstance(result, bool):
        try:
            release(req)
        except Exception:
            logger.exception(
                "django-dlock: could not give back %s after a cancelled acquire",
                req.key.name,
            )


#: longest a PostgreSQL waiter parks between checks when it relies on NOTIFY
MAX_PARK = 2.0
#: margin after a lease's end before a waiter looks again
EXPIRY_MARGIN = 0.005

#: longest pause between looks while the database is unreachable
MAX_OUTAGE_PAUSE = OUTAGE_MAX_PAUSE

# One step of the waiting plan: ("look" | "try" | "sleep", seconds to sleep)
Step = tuple[str, float]

logger = logging.getLogger("django_dlock")


@dataclass
class Look:
    """What a waiter saw: seconds until the lease ends (<= 0: free), and
    whether a live ticket is ahead of its own."""

    left: float
    ahead: bool


@dataclass
class Place:
    """A waiter's ticket, and when (monotonic) it last renewed it."""

    ticket: int
    renewed: float = field(default_factory=time.monotonic)
    #: when its last try was sent: a try that is granted sets the lease
    #: from then on the database clock
    tried_at: float | None = None
    #: its place in the queue was read (for a trace)
    placed: bool = False


class Outage:
    """A waiter's step failed because the database was unreachable."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def listener(alias: str) -> notify.Listener | None:
    """The alias's NOTIFY listener on PostgreSQL; ``None`` elsewhere, and without
    psycopg 3, which the listener's connection needs (waiters poll)."""
    if connections[alias].vendor != "postgresql" or not psycopg3():
        return None
    return notify.listener(alias)


class Turns(Protocol):
    """What a waiter's turns ask of its strategy: a try with the ticket, a look."""

    def try_acquire(self, req: Request, ticket: int | None = None) -> int | None: ...

    def look(self, req: Request, ticket: int) -> Look: ...


class TicketWait:
    """One waiter's wait with its ticket, iterated by a driver.

    Iterating gives the steps of :func:`plan`; the driver runs each (a
    "sleep" on :attr:`waiter`, a "look" or "try" with :meth:`step`) and sets
    :attr:`reply` to what it got before asking for the next. When the
    iteration ends, :attr:`grant` says how the wait ended. The wake-up is
    registered at the first step, before the first look, and unregistered
    when the plan ends or at :meth:`close`.
    """

    place: Place

    def __init__(
        self,
        req: Request,
        ticket: int,
        deadline: Deadline,
        policy: RetryInterval,
        waiter: notify.Waiter,
        turns: Turns,
    ) -> None:
        self.req = req
        self.turns = turns
        self.ticket = ticket
        self.listen = listener(req.alias)
        self.waiter = waiter
        #: what the driver got from the last step
        self.reply: Any = None
        #: the grant once the iteration has ended; ``None``: timed out (or not yet)
        self.grant: Grant | None = None
        self._steps = self._run(deadline, policy)

    def __iter__(self) -> TicketWait:
        return self

    def __next__(self) -> Step:
        reply, self.reply = self.reply, None
        try:
            return self._steps.send(reply)
        except StopIteration as done:
            self.grant = done.value
            raise

    def close(self) -> None:
        """End the wait early (an error, a cancellation): unregister the wake-up."""
        self._steps.close()

    def step(self, kind: str) -> Any:
        """Run a "look" or a "try" step in this thread (see :func:`step`)."""
        return step(kind, self.place, self.req, self.turns)

    def _run(self, deadline: Deadline, policy: RetryInterval) -> Generator[Step, Any, Grant | None]:
        payload = queue.wake_payload(self.ticket)
        if self.listen is not None:
            self.listen.register(payload, self.waiter)
        try:
            self.place = Place(self.ticket)
            fence = yield from plan(deadline, policy, self.listen, deadlock.due())
        finally:
            if self.listen is not None:
                self.listen.unregister(payload, self.waiter)
        return None if fence is None else Grant(fence, self.place.tried_at)


def plan(
    deadline: Deadline,
    policy: RetryInterval,
    listen: notify.Listener | None,
    detect_after: float | None = None,
) -> Generator[Step, Any, int | None]:
    """How a waiter with a ticket waits, as steps for a sync or an async driver.

    Each turn tries to take the lease with the ticket (granted only when
    the lease is free and no live ticket is ahead), else renews the
    ticket and reads how long the current lease runs. The first turn
    comes right after the ticket was taken and the wake-up registered,
    so a release in between is never slept through. Between turns, park
    until a NOTIFY addressed to this ticket wakes us (PostgreSQL) or the
    retry interval passes (elsewhere), never past the end of the current
    lease, the deadline, or a quarter of the ticket's own lease.

    A waiter rides out an outage of the database (a restart, a dropped
    connection): it backs off as an acquire that starts during an outage
    does (:func:`~django_dlock.retry.outage_pause`) and looks again until
    its deadline, and then raises :class:`~django_dlock.DatabaseUnavailable`
    rather than report a timeout.

    A waiter that has waited ``detect_after`` seconds looks for a deadlock
    ("detect", see :mod:`.deadlock`), and again every ``detect_after``
    seconds while it waits.
    """
    attempt = 0
    outages = 0  # (looks in a row that could not reach the database)
    woken = False
    detect_at = math.inf if detect_after is None else time.monotonic() + detect_after
    while True:
        # Woken by a NOTIFY addressed to this ticket: try at once.
        look: Look | Outage = Look(0.0, False) if woken else (yield ("look", 0.0))
        if not isinstance(look, Outage) and look.left <= 0 and not look.ahead:
            fence: int | None | Outage = yield ("try", 0.0)
            if isinstance(fence, Outage):
                look = fence
            elif fence is not None:
                return fence
        if isinstance(look, Outage):
            if deadline.expired():
                raise look.error
            yield ("sleep", min(outage_pause(outages), deadline.remaining()))
            outages += 1
            attempt += 1
            woken = False
            continue
        outages = 0
        if deadline.expired():
            return None
        if time.monotonic() >= detect_at:
            yield ("detect", 0.0)  # raises LockDeadlock if this waiter must give up
            detect_at = time.monotonic() + (detect_after or 0.0)
        left = look.left
        if listen is not None and listen.healthy:
            pause = MAX_PARK if left <= 0 else min(MAX_PARK, left + EXPIRY_MARGIN)
        else:
            pause = interval(policy, attempt)
            if left > 0:
                pause = min(pause, left + EXPIRY_MARGIN)
        pause = min(pause, queue.renew_every(), max(0.0, detect_at - time.monotonic()))
        woken = bool((yield ("sleep", max(0.0, min(pause, deadline.remaining())))))
        attempt += 1


def step(kind: str, place: Place, req: Request, turns: Turns) -> Any:
    """A waiter's look ("look": a read, and the ticket's renewal when due) or
    try ("try": take the lease with the ticket); an :class:`Outage` if the
    database is away."""
    try:
        if kind == "detect":
            return deadlock.check(req, place.ticket)
        if kind == "try":
            acquire_notes.tried()
            place.tried_at = time.monotonic()
            return turns.try_acquire(req, place.ticket)
        if not place.placed:
            place.placed = True
            acquire_notes.queued(functools.partial(position, req, place.ticket))
        now = time.monotonic()
        if now - place.renewed >= queue.renew_every():
            queue.beat(req, place.ticket)
            place.renewed = now
        return turns.look(req, place.ticket)
    except DatabaseUnavailable as exc:
        logger.warning("django-dlock: waiting for %s: database unavailable: %s", req.key.name, exc)
        return Outage(exc)


def position(req: Request, ticket: int) -> int:
    """The place of ``ticket`` in its key's queue: live tickets ahead, plus one."""
    found = read(
        req.alias,
        f"SELECT count(*) FROM {WAITERS} w WHERE w.name = %s AND w.expire_at > {{now}} "
        "AND w.id < %s",
        [req.key.name, ticket],
    )
    return 1 + (int(found[0]) if found is not None else 0)


def look(req: Request, ticket: int) -> Look:
    """One read of a lock's waiter: seconds until the lease ends, and whether a
    live ticket is ahead."""
    found = read(
        req.alias,
        f"SELECT (SELECT {{left}} FROM {TABLE} WHERE name = %s), "
        f"CASE WHEN EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = %s "
        "AND w.expire_at > {now} AND w.id < %s) THEN 1 ELSE 0 END",
        [req.key.name, req.key.name, ticket],
    )
    left = -1.0 if found is None or found[0] is None else float(found[0])
    return Look(left, bool(found[1]) if found is not None else False)
