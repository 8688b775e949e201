"""How a lock takes its keys: one walk for every way of acquiring.

``acquire()``, ``enqueue()`` and the keys that ``wait()`` takes after its
place was granted all take keys the same way: in sorted order, each one
re-entered if the holder still holds it (a lease is renewed first, in one
statement that also checks it is still the holder's, or found lost) or
tried, until one is busy; what the walk
took is given back, all or none, when it fails or raises (a cancelled task
included). A walk that cannot reach the database (a fail-over, a restart)
is walked again after a pause, until the acquire's deadline
(:meth:`Attempt.ride_out`): the one place where an acquire waits for its
database to come back.

:meth:`Attempt.take` is that walk, written once. It acts on the call's
:class:`~django_dlock.options.Options` and the holder, handed down by the
lock; it never calls back into the lock. Its three database steps
(renew, try, give back) are awaited through an :class:`_Steps` object:
:class:`_AsyncSteps` runs them off the event loop; :class:`_SyncSteps` runs
them in the calling thread and never suspends, so :meth:`Attempt.run` drives
the same coroutine to its end without an event loop (:mod:`django_dlock._unasync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterable
from typing import Protocol

from asgiref.sync import sync_to_async

from django_dlock import holdings
from django_dlock._threads import to_the_end
from django_dlock._unasync import run_to_end
from django_dlock.exceptions import DatabaseUnavailable, DLockError, LockReentrantError
from django_dlock.holdings import Holding, Renewal
from django_dlock.identity import Holder
from django_dlock.keys import Key
from django_dlock.options import Options
from django_dlock.retry import Deadline, outage_pause
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import Abandoned, began, statement_deadline

__all__ = ["Attempt", "reenter"]

logger = logging.getLogger("django_dlock")


def reenter(opts: Options, holder: Holder, holding: Holding) -> bool:
    """Count a re-entry of ``holding``, the holder's holding of a key.

    A holding that is lost is not re-entered: the caller contends afresh
    (``False``). (A lease that may have run out was renewed, or found
    lost, just before: see :meth:`Attempt.take`.)

    Raises:
        LockReentrantError: ``reentrant=False``, or an exclusive re-entry of
            a shared holding.
    """
    if holding.lost:
        holding.halt_renewal()
        return False
    name = holding.name
    if not opts.reentrant:
        raise LockReentrantError(
            f"{name!r} is already held by this {holder.kind} and reentrant=False"
        )
    if holding.request.shared and not opts.shared:
        raise LockReentrantError(
            f"{name!r} is held shared by this {holder.kind}: it cannot be "
            "re-entered exclusively (release the shared lock first)"
        )
    holding.count += 1
    return True


class Attempt:
    """One call's attempt to take keys for ``holder``, as ``opts`` says.

    ``taken`` lists the keys held so far by this attempt (re-entered keys
    included: giving back releases one level of them).
    """

    def __init__(
        self,
        opts: Options,
        holder: Holder,
        deadline: Deadline,
        taken: Iterable[Key] = (),
    ) -> None:
        self.opts = opts
        self.holder = holder
        self.deadline = deadline
        self.taken: list[Key] = list(taken)

    async def take(self, keys: Iterable[Key], steps: _Steps, keep: bool) -> Request | None:
        """Walk ``keys``: ``None`` once all are held, else the busy key's request;
        what was taken is given back then unless ``keep``.

        A walk that cannot reach the database rides the outage out (see
        :meth:`ride_out`): what this walk took is given back, and after a
        pause the walk starts again from its first key, until the deadline.
        """
        keys = list(keys)  # (walked again after an outage)
        before = len(self.taken)  # (keys held before this walk stay held)
        outage: _Outage | None = None
        try:
            while True:
                try:
                    busy = await self._walk(keys, steps, keep)
                except DatabaseUnavailable as exc:
                    outage = outage or _Outage(self.opts.name)
                    pause = self.ride_out(exc, outage)
                    if pause is None:
                        raise
                else:
                    if outage is not None:
                        outage.over()
                    return busy
                await steps.undo(self, before)
                await steps.sleep(pause)
        except BaseException:
            await steps.undo(self, 0)
            raise

    def ride_out(self, exc: DatabaseUnavailable, outage: _Outage) -> float | None:
        """How long to pause before walking again after ``exc``; ``None``: raise it.

        An acquire that was given time (a ``timeout`` other than 0) keeps
        trying to reach the database until its deadline, as a waiter already
        in the queue does: a fail-over (a switchover takes seconds) or a
        restart shorter than the timeout costs the caller that wait, not an
        error. The pauses grow from 50 ms to a second, and never end past the
        deadline; once it has passed, the database's error is raised. A
        try-once (``timeout=0``) raises at once, and so does a lock held by
        the caller's transaction (``row``, ``advisory_xact``): that
        transaction ended with its connection, and only the caller can
        start it again.
        """
        deadline = self.deadline
        if deadline.timeout == 0 or self.opts.strategy.transaction_scoped or deadline.expired():
            if outage.tries:
                outage.gave_up(exc)
            return None
        pause = min(outage_pause(outage.tries), deadline.remaining())
        outage.failed(exc)
        return pause

    async def _walk(self, keys: list[Key], steps: _Steps, keep: bool) -> Request | None:
        opts, holder = self.opts, self.holder
        family = opts.strategy.family
        for key in keys:
            held = holdings.current(holder, (opts.alias, family, key.name))
            if held is not None and holdings.confirm_on_reentry(held):
                await steps.renew(self, held)
            if held is not None and reenter(opts, holder, held):
                self.taken.append(key)
                continue
            req = opts.request(holder, key)
            sent_at = time.monotonic()
            try:
                with statement_deadline(self.deadline, opts.alias):
                    grant = await steps.attempt(self, req)
            except Abandoned:  # waited past the deadline for a pooler
                grant = None
            if grant is None:
                if not keep:
                    await steps.undo(self, 0)
                return req
            self.hold(req, grant, sent_at)
        return None

    def hold(self, req: Request, grant: Grant, sent_at: float) -> None:
        """Record the key of ``req`` as acquired by ``grant``, asked for at ``sent_at``.

        A lease is counted from the statement that granted it: the
        grant's own send time when the strategy waited first (a waiter
        granted after a queue wait longer than its ttl must not count its
        lease as run out), else ``sent_at``. A lock without a lease (a
        session's, a transaction's) is counted from now, when it was granted.
        """
        opts = self.opts
        strategy = opts.strategy
        made = Holding(
            req, strategy, grant.fence, opts.signal_sender, on_lost=opts.on_lost, later=grant.later
        )
        renewal = Renewal(opts.ttl, opts.max_hold) if opts.renew else None
        now = time.monotonic()
        wait = now - self.deadline.start  # (deadline.elapsed(), inline)
        if not strategy.leased:
            sent_at = now
        else:  # (SQLite: when the granting statement got the write lock, if later)
            sent_at = began(sent_at if grant.sent_at is None else grant.sent_at)
        holdings.take(self.holder, made, sent_at=sent_at, wait=wait, renewal=renewal)
        self.taken.append(req.key)

    def run(self, keys: Iterable[Key], *, keep: bool = False) -> Request | None:
        """:meth:`take` in the calling thread."""
        return run_to_end(self.take(keys, _SYNC, keep))

    async def arun(self, keys: Iterable[Key], *, keep: bool = False) -> Request | None:
        """:meth:`take` without blocking the event loop."""
        return await self.take(keys, _ASYNC, keep)

    # -- giving back -----------------------------------------------------------

    def undo(self, since: int = 0) -> None:
        """Give back what this attempt took, last first (all or none); with
        ``since``, only what it took after its first ``since`` keys."""
        taken, self.taken = self.taken[since:], self.taken[:since]
        opts = self.opts
        for key in reversed(taken):
            holding = self.holder.holdings.get((opts.alias, opts.strategy.family, key.name))
            if holding is not None:
                with contextlib.suppress(DLockError):
                    holdings.release_one(self.holder, holding)

    async def aundo(self, since: int = 0) -> None:
        """Async :meth:`undo`: runs to the end even if the task is cancelled."""
        await to_the_end(functools.partial(self.undo, since), f"giving back {self.opts.name!r}")


class _Outage:
    """What one acquire has seen of an outage of its database, for the log:
    a warning when it begins, and at most every :data:`_OUTAGE_LOG_EVERY`
    seconds while it lasts; a line when the database answers again."""

    __slots__ = ("name", "tries", "began", "logged")

    def __init__(self, name: str) -> None:
        self.name = name
        self.tries = 0
        self.began = time.monotonic()
        self.logged = -math.inf

    def failed(self, exc: DatabaseUnavailable) -> None:
        self.tries += 1
        now = time.monotonic()
        if now - self.logged >= _OUTAGE_LOG_EVERY:
            self.logged = now
            logger.warning(
                "django-dlock: acquiring %s: %s; trying again until the timeout "
                "(%d tries in %.1fs so far)",
                self.name,
                exc,
                self.tries,
                now - self.began,
            )

    def gave_up(self, exc: DatabaseUnavailable) -> None:
        logger.warning(
            "django-dlock: acquiring %s: the database was still unavailable at the "
            "timeout, after %d tries in %.1fs: %s",
            self.name,
            self.tries + 1,
            time.monotonic() - self.began,
            exc,
        )

    def over(self) -> None:
        logger.info(
            "django-dlock: acquiring %s: the database answered again after %.2fs (%d tries)",
            self.name,
            time.monotonic() - self.began,
            self.tries + 1,
        )


#: at most one warning per this many seconds while an acquire rides out an outage
_OUTAGE_LOG_EVERY = 30.0


class _Steps(Protocol):
    """The database steps of :meth:`Attempt.take`."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None: ...

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None: ...

    async def undo(self, attempt: Attempt, since: int) -> None: ...

    async def sleep(self, seconds: float) -> None: ...


class _SyncSteps:
    """Each step runs in the calling thread (it never suspends)."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None:
        holdings.renew_or_lose(holding, attempt.opts.lease_ttl)

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None:
        opts = attempt.opts
        return opts.strategy.acquire(req, attempt.deadline, opts.retry_interval)

    async def undo(self, attempt: Attempt, since: int) -> None:
        attempt.undo(since)

    async def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class _AsyncSteps:
    """Each step runs off the event loop; a cancelled task still gives back."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None:
        await sync_to_async(holdings.renew_or_lose)(holding, attempt.opts.lease_ttl)

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None:
        opts = attempt.opts
        return await opts.strategy.aacquire(req, attempt.deadline, opts.retry_interval)

    async def undo(self, attempt: Attempt, since: int) -> None:
        await attempt.aundo(since)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


_SYNC = _SyncSteps()
_ASYNC = _AsyncSteps()
