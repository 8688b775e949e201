"""How a lock takes its keys: one walk for every way of acquiring.

``acquire()``, ``enqueue()`` and the keys that ``wait()`` takes after its
place was granted all take keys the same way: in sorted order, each one
re-entered if the holder still holds it (a lease is renewed first, in one
statement that also checks it is still the holder's, or found lost) or
tried, until one is busy; what the walk
took is given back, all or none, when it fails or raises (a cancelled task
included).

:meth:`Attempt.take` is that walk, written once. Its three database steps
(renew, try, give back) are awaited through an :class:`_Steps` object:
:class:`_AsyncSteps` runs them off the event loop; :class:`_SyncSteps` runs
them in the calling thread and never suspends, so :meth:`Attempt.run` drives
the same coroutine to its end without an event loop (:mod:`django_dlock._unasync`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

from asgiref.sync import sync_to_async

from django_dlock import holdings
from django_dlock._threads import to_the_end
from django_dlock._unasync import run_to_end
from django_dlock.exceptions import DLockError
from django_dlock.holdings import Holding, Renewal
from django_dlock.identity import Holder
from django_dlock.keys import Key
from django_dlock.retry import Deadline
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.deadline import Abandoned, statement_deadline

if TYPE_CHECKING:
    from django_dlock.locks import Lock

__all__ = ["Attempt"]


class Attempt:
    """One call's attempt to take keys of ``lock`` for ``holder`` on ``alias``.

    ``taken`` lists the keys held so far by this attempt (re-entered keys
    included: giving back releases one level of them).
    """

    def __init__(
        self,
        lock: Lock,
        holder: Holder,
        alias: str,
        strategy: Strategy,
        deadline: Deadline,
        taken: Iterable[Key] = (),
    ) -> None:
        self.lock = lock
        self.holder = holder
        self.alias = alias
        self.strategy = strategy
        self.deadline = deadline
        self.taken: list[Key] = list(taken)

    async def take(self, keys: Iterable[Key], steps: _Steps, keep: bool) -> Request | None:
        """Walk ``keys``: ``None`` once all are held, else the busy key's request;
        what was taken is given back then unless ``keep``."""
        lock, holder = self.lock, self.holder
        try:
            for key in keys:
                held = holdings.current(holder, (self.alias, self.strategy.family, key.name))
                if held is not None and holdings.confirm_on_reentry(held):
                    await steps.renew(self, held)
                if held is not None and lock._reenter(holder, held):
                    self.taken.append(key)
                    continue
                req = lock._request(holder, self.alias, key)
                sent_at = time.monotonic()
                try:
                    with statement_deadline(self.deadline, self.alias):
                        grant = await steps.attempt(self, req)
                except Abandoned:  # waited past the deadline for a pooler
                    grant = None
                if grant is None:
                    if not keep:
                        await steps.undo(self)
                    return req
                self.hold(req, grant, sent_at)
        except BaseException:
            await steps.undo(self)
            raise
        return None

    def hold(self, req: Request, grant: Grant, sent_at: float) -> None:
        """Record the key of ``req`` as acquired by a statement sent at ``sent_at``."""
        lock = self.lock
        made = Holding(req, self.strategy, grant.fence, lock.signal_sender, on_lost=lock.on_lost)
        renewal = Renewal(lock.ttl, lock.max_hold) if lock.renew else None
        wait = self.deadline.elapsed()
        holdings.take(self.holder, made, sent_at=sent_at, wait=wait, renewal=renewal)
        self.taken.append(req.key)

    def run(self, keys: Iterable[Key], *, keep: bool = False) -> Request | None:
        """:meth:`take` in the calling thread."""
        return run_to_end(self.take(keys, _SYNC, keep))

    async def arun(self, keys: Iterable[Key], *, keep: bool = False) -> Request | None:
        """:meth:`take` without blocking the event loop."""
        return await self.take(keys, _ASYNC, keep)

    # -- giving back -----------------------------------------------------------

    def undo(self) -> None:
        """Give back what this attempt took, last first (all or none)."""
        taken, self.taken = self.taken, []
        for key in reversed(taken):
            holding = self.holder.holdings.get((self.alias, self.strategy.family, key.name))
            if holding is not None:
                with contextlib.suppress(DLockError):
                    holdings.release_one(self.holder, holding)

    async def aundo(self) -> None:
        """Async :meth:`undo`: runs to the end even if the task is cancelled."""
        await to_the_end(self.undo, f"giving back {self.lock.name!r}")


class _Steps(Protocol):
    """The database steps of :meth:`Attempt.take`."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None: ...

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None: ...

    async def undo(self, attempt: Attempt) -> None: ...


class _SyncSteps:
    """Each step runs in the calling thread (it never suspends)."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None:
        holdings.renew_or_lose(holding, attempt.lock._lease_ttl())

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None:
        return attempt.strategy.acquire(req, attempt.deadline, attempt.lock.retry_interval)

    async def undo(self, attempt: Attempt) -> None:
        attempt.undo()


class _AsyncSteps:
    """Each step runs off the event loop; a cancelled task still gives back."""

    async def renew(self, attempt: Attempt, holding: Holding) -> None:
        await sync_to_async(holdings.renew_or_lose)(holding, attempt.lock._lease_ttl())

    async def attempt(self, attempt: Attempt, req: Request) -> Grant | None:
        strategy, lock = attempt.strategy, attempt.lock
        return await strategy.aacquire(req, attempt.deadline, lock.retry_interval)

    async def undo(self, attempt: Attempt) -> None:
        await attempt.aundo()


_SYNC = _SyncSteps()
_ASYNC = _AsyncSteps()
