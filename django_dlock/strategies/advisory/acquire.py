"""The flow shared by strategies that hold locks on dedicated sessions.

The PostgreSQL and MySQL/MariaDB ``advisory`` strategies hold each holder's
locks on a database session of its own, with blocking statements. Their
flow is written once here: the holder's session (a pooled session that died
in the pool is replaced once), try then wait, settling a failed acquisition
so that the session holds nothing, recording a lock just acquired, release
and ownership checks, and the async path. Each vendor supplies only its
statements (``_take``, ``_holds``, ``_unlock``) and its driver's errors.

Async, the first try runs in the small shared executor, a wait (when the
try failed and the timeout allows it) in a thread of its own, so that a wait
in the server's queue blocks neither the event loop nor Django's shared sync
thread, and long waits never starve other tasks' tries. Cancelling the task
interrupts the wait in the server, and a lock its worker acquired anyway is
given back.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DatabaseUnavailable, DLockError, SessionBusy
from django_dlock.identity import Holder, current_holder
from django_dlock.retry import Deadline
from django_dlock.strategies.advisory.sessions import (
    Pool,
    Session,
    SessionLost,
    SessionSwitched,
    ensure_watcher,
    in_thread,
    session_for,
)
from django_dlock.strategies.advisory.sessions import executor as advisory_executor
from django_dlock.strategies.advisory.sessions import find as find_session
from django_dlock.strategies.base import Grant, Request


def on_session(
    req: Request,
    holder: Callable[[], Holder | None],
    acquire_on: Callable[[Session], Grant | None],
    kind: type[Pool] = Pool,
) -> Grant | None:
    """``acquire_on(session)`` on the holder's dedicated session.

    A pooled session that had died in the pool holds nothing: the attempt
    runs once more on a new one, and the pool's other idle sessions, which
    whatever ended it (a restart, an administrator) has likely ended too,
    are closed first. A session that cannot be opened is a
    :class:`DatabaseUnavailable` naming the database (the driver's error
    chained), as is a session that ended again on the second try.
    """
    for attempt in (1, 2):
        try:
            session = session_for(req.alias, req.token, holder, kind)
        except DLockError:  # (Abandoned too: no answer by the deadline)
            raise
        except Exception as exc:
            raise DatabaseUnavailable(
                f"cannot open a session for advisory locks on {req.alias!r}: {exc}"
            ) from exc
        try:
            return acquire_on(session)
        except SessionLost:
            if attempt == 2:
                raise
            session.pool.close_idle()
        finally:
            session.pool.unpin(session)
    raise AssertionError("unreachable")


class AsyncWait:
    """Cancellation of one async acquisition, shared with its worker thread."""

    def __init__(self, place: bool = False) -> None:
        self.cancelled = False
        self.session: Session | None = None
        #: a two-phase place (``enqueue()``): the session runs nothing else meanwhile
        self.place = place

    def cancel(self) -> None:
        self.cancelled = True
        session = self.session
        if session is not None:
            session.cancel_wait()


class SessionAsyncAcquire:
    """The flow of a strategy that holds locks on dedicated sessions.

    ``acquire``, ``try_acquire`` and ``aacquire`` all come down to
    ``_acquire``: on the holder's dedicated session (from ``pool_kind``),
    the vendor's ``_take`` tries once and, if the deadline allows it, waits
    in the server; a failed acquisition is settled so that the session holds
    nothing. ``release`` and ``owned`` run the vendor's ``_unlock`` and
    ``_holds`` on the holder's session. Its strategies hold session-level
    locks: not transaction-scoped, and a lock ends only when released or
    when its session ends.
    """

    transaction_scoped = False
    leased = False
    #: the pool the strategy's dedicated sessions come from
    pool_kind: type[Pool] = Pool

    def ended(self, req: Request) -> bool:
        return False

    def refuse_unsupported(self, req: Request) -> None:
        """Raise if the strategy cannot take ``req`` at all (nothing by default)."""

    # -- acquire -----------------------------------------------------------------

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        self.refuse_unsupported(req)
        return self._acquire(req, deadline, current_holder, None)

    def try_acquire(self, req: Request) -> int | None:
        self.refuse_unsupported(req)
        grant = self._acquire(req, Deadline(0), current_holder, None)
        if grant is None:
            return None
        return 0 if grant.fence is None else grant.fence

    def _acquire(
        self,
        req: Request,
        deadline: Deadline,
        holder: Callable[[], Holder | None],
        waiter: AsyncWait | None,
    ) -> Grant | None:
        if waiter is not None and waiter.cancelled:
            return None
        return on_session(
            req,
            holder,
            lambda session: self._acquire_on(session, req, deadline, waiter),
            self.pool_kind,
        )

    def _acquire_on(
        self, session: Session, req: Request, deadline: Deadline, waiter: AsyncWait | None
    ) -> Grant | None:
        """Acquire on ``session``; after a failure, make sure it holds nothing.

        A statement that fails (or is interrupted) may leave the lock taken
        all the same: :meth:`_settle` gives it back. A session that is gone
        holds nothing to settle.
        """
        if waiter is not None:
            waiter.session = session  # cancelling the task interrupts the wait
        try:
            if waiter is not None and waiter.place:
                session.place = (req.key.name, threading.get_ident())
            try:
                grant = self._take(session, req, deadline, waiter)
            finally:
                if waiter is not None and waiter.place:
                    session.place = None
        except (SessionLost, SessionSwitched):
            raise  # the session is gone: it holds nothing
        except SessionBusy:
            raise  # nothing was sent: nothing to settle
        except BaseException as exc:
            self._settle(session, req)
            if isinstance(exc, self._database_error()):
                raise self._failed(req, exc) from exc
            raise
        if grant is None:
            return None
        session.held[req.key.name] = req.shared
        if waiter is not None and waiter.cancelled:
            self.release(req)  # the task is gone: give it back
            return None
        ensure_watcher()
        return grant

    def _settle(self, session: Session, req: Request) -> None:
        """After a failed acquisition: make sure ``session`` does not hold the key."""
        if session.lost is not None or req.key.name in session.held:
            return
        try:
            if self._holds(session, req):
                self._unlock(session, req)
        except Exception as exc:
            # In doubt: end the session, which frees whatever it holds.
            session.fail(f"could not settle a failed acquisition of {req.key.name!r}: {exc}")

    # -- release, extend, inspect --------------------------------------------------

    def _session(self, req: Request) -> Session | None:
        """The holder's session on ``req.alias`` if it holds ``req.key``."""
        session = find_session(req.alias, req.token)
        if session is None or req.key.name not in session.held:
            return None
        return session

    def release(self, req: Request) -> bool:
        session = self._session(req)
        if session is None:
            return False
        try:
            released = self._unlock(session, req)
        except (SessionLost, SessionSwitched):
            return False
        except self._database_error() as exc:
            session.fail(f"releasing {req.key.name!r} failed: {exc}")
            return False
        session.held.pop(req.key.name, None)
        session.pool.done(session)
        return released

    def owned(self, req: Request) -> bool:
        session = self._session(req)
        if session is None or session.lost is not None:
            return False
        try:
            return self._holds(session, req)
        except (SessionLost, SessionSwitched):
            return False
        except self._database_error() as exc:
            session.fail(f"checking {req.key.name!r} failed: {exc}")
            return False

    def loss_reason(self, req: Request) -> str | None:
        """Nothing to add: a session lock is lost only with its session, which says why."""
        return None

    def extend(self, req: Request, ttl: float) -> bool:
        """Nothing to extend: a session lock has no lease. True while it is held."""
        return self.owned(req)

    # -- the vendor's statements ---------------------------------------------------

    def _take(
        self, session: Session, req: Request, deadline: Deadline, waiter: AsyncWait | None
    ) -> Grant | None:
        """Try once, then wait in the server until ``deadline``; the grant or ``None``."""
        raise NotImplementedError

    def _holds(self, session: Session, req: Request) -> bool:
        """Whether ``session`` holds the lock of ``req`` (asking the server)."""
        raise NotImplementedError

    def _unlock(self, session: Session, req: Request) -> bool:
        """Release the lock of ``req`` on ``session``; false if it was not held."""
        raise NotImplementedError

    def _database_error(self) -> type[Exception]:
        """The database driver's base error class."""
        raise NotImplementedError

    def _failed(self, req: Request, exc: Exception) -> DLockError:
        """The error to raise when acquiring ``req`` failed with ``exc`` (a driver error)."""
        raise NotImplementedError

    # -- async ---------------------------------------------------------------------

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        self.refuse_unsupported(req)
        holder = current_holder()
        waiter = AsyncWait()
        loop = asyncio.get_running_loop()
        # (in the context of this task, as asyncio.to_thread does: the statement
        # deadline of the acquire reaches the worker threads)
        first = loop.run_in_executor(
            advisory_executor(),
            contextvars.copy_context().run,
            self._acquire,
            req,
            Deadline(0),
            lambda: holder,
            waiter,
        )
        grant = await self._await(req, first, waiter)
        if grant is not None or deadline.expired():
            return grant
        waiting = in_thread(
            loop,
            contextvars.copy_context().run,
            self._acquire,
            req,
            deadline,
            lambda: holder,
            waiter,
        )
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
