"""Async acquisition for strategies that hold locks on dedicated sessions.

The PostgreSQL and MySQL/MariaDB ``advisory`` strategies hold each holder's
locks on a database session of its own, with blocking statements. Their
async path is the same, written once here: the first try runs in the small
shared executor, a wait (when the try failed and the timeout allows it) in a
thread of its own, so that a wait in the server's queue blocks neither the
event loop nor Django's shared sync thread, and long waits never starve
other tasks' tries. Cancelling the task interrupts the wait in the server,
and a lock its worker acquired anyway is given back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DLockError
from django_dlock.identity import Holder, current_holder
from django_dlock.retry import Deadline
from django_dlock.strategies.advisory.executor import executor as advisory_executor
from django_dlock.strategies.advisory.executor import in_thread
from django_dlock.strategies.advisory.pool import Pool, session_for
from django_dlock.strategies.advisory.session import Session, SessionLost
from django_dlock.strategies.base import Grant, Request


def on_session(
    req: Request,
    holder: Callable[[], Holder | None],
    acquire_on: Callable[[Session], Grant | None],
    kind: type[Pool] = Pool,
) -> Grant | None:
    """``acquire_on(session)`` on the holder's dedicated session.

    A pooled session that had died in the pool holds nothing: the attempt
    runs once more on a new one. A session that cannot be opened is a
    :class:`DLockError` naming the database.
    """
    for attempt in (1, 2):
        try:
            session = session_for(req.alias, req.token, holder, kind)
        except DLockError:
            raise
        except Exception as exc:
            raise DLockError(
                f"cannot open a session for advisory locks on {req.alias!r}: {exc}"
            ) from exc
        try:
            return acquire_on(session)
        except SessionLost:
            if attempt == 2:
                raise
        finally:
            session.pool.unpin(session)
    raise AssertionError("unreachable")


class AsyncWait:
    """Cancellation of one async acquisition, shared with its worker thread."""

    def __init__(self) -> None:
        self.cancelled = False
        self.session: Session | None = None

    def cancel(self) -> None:
        self.cancelled = True
        session = self.session
        if session is not None:
            session.cancel_wait()


class SessionAsyncAcquire:
    """``aacquire`` for a strategy with a blocking ``_acquire`` and ``release``.

    Its strategies hold session-level locks: not transaction-scoped, and a
    lock ends only when released or when its session ends.
    """

    transaction_scoped = False

    def ended(self, req: Request) -> bool:
        return False

    def _acquire(
        self,
        req: Request,
        deadline: Deadline,
        holder: Callable[[], Holder | None],
        waiter: AsyncWait | None,
    ) -> Grant | None:
        raise NotImplementedError

    def release(self, req: Request) -> bool:
        raise NotImplementedError

    def owned(self, req: Request) -> bool:
        raise NotImplementedError

    def loss_reason(self, req: Request) -> str | None:
        """Nothing to add: a session lock is lost only with its session, which says why."""
        return None

    def extend(self, req: Request, ttl: float) -> bool:
        """Nothing to extend: a session lock has no lease. True while it is held."""
        return self.owned(req)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        holder = current_holder()
        waiter = AsyncWait()
        loop = asyncio.get_running_loop()
        first = loop.run_in_executor(
            advisory_executor(), self._acquire, req, Deadline(0), lambda: holder, waiter
        )
        grant = await self._await(req, first, waiter)
        if grant is not None or deadline.expired():
            return grant
        waiting = in_thread(loop, self._acquire, req, deadline, lambda: holder, waiter)
        return await self._await(req, waiting, waiter)

    async def _await(
        self, req: Request, future: asyncio.Future[Grant | None], waiter: AsyncWait
    ) -> Grant | None:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            waiter.cancel()  # ends a wait in progress, stops one not yet begun
            future.add_done_callback(lambda done: self._give_back_late(req, done))
            raise

    def _give_back_late(self, req: Request, done: asyncio.Future[Grant | None]) -> None:
        # The task was cancelled but its worker acquired the lock anyway.
        if done.cancelled() or done.exception() is not None or done.result() is None:
            return
        advisory_executor().submit(self.release, req)
