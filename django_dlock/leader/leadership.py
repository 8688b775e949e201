"""One term of leadership: :class:`Leadership`, :class:`LeaderRecord`, the clock."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django_dlock.exceptions import LockLost
from django_dlock.strategies.base import Request, Strategy

__all__ = ["LeaderRecord", "Leadership", "current_leadership"]


#: the reason of a graceful end of a term
STEPPING_DOWN = "stepping down"


def _now() -> float:
    """Seconds on a clock that keeps counting while the process (or the machine) sleeps.

    ``CLOCK_BOOTTIME`` where it exists (Linux): a leader frozen by SIGSTOP, a
    debugger or a suspended machine must find its deadline passed when it
    runs again. It is system-wide, so a child process can compare with it.
    """
    return time.clock_gettime(_CLOCK)


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)

_current: contextvars.ContextVar[Leadership | None] = contextvars.ContextVar(
    "django_dlock_leadership", default=None
)


def current_leadership() -> Leadership | None:
    """The :class:`Leadership` whose target is running in this thread or task.

    Set by :meth:`LeaderElection.run` / :meth:`LeaderElection.arun` (and so by
    ``manage.py dlock_runworker`` for its jobs): a job can read its ``term`` to
    fence its writes. ``None`` outside a leader's target.
    """
    return _current.get()


@dataclass(frozen=True)
class LeaderRecord:
    """The current leader of an election, as the database records it.

    Attributes:
        identity: the leader's identity (``"host pid=123"`` by default).
        term: the leadership's term (its fencing number).
        since: when this term began (database time, aware datetime).
        renewed: when the lease was last renewed (``expires - lease``, with
            the ``lease`` of the election that read the record).
        expires: when the lease ends unless renewed (database time).
    """

    identity: str
    term: int
    since: dt.datetime | None
    renewed: dt.datetime
    expires: dt.datetime


class Leadership:
    """One term of leadership of this process, handed to the target.

    The term is valid until its *renew deadline* (``renew_deadline`` seconds
    after the start of the last successful renewal), judged on this
    process's own clock. :attr:`ended` becomes true the moment that deadline
    passes, even before the election's thread has noticed (after the process
    was frozen, for example): check it right before each write that only the
    leader may make, and fence the write with :attr:`term`.

    Attributes:
        name: the election's name.
        term: the term number (fencing number): strictly greater than every
            earlier term of the election.
        identity: this process's identity.
    """

    def __init__(self, name: str, term: int, identity: str) -> None:
        self.name = name
        self.term = term
        self.identity = identity
        self.reason = ""
        self._ended = threading.Event()
        self._mutex = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        #: the renew deadline (:func:`_now` seconds); the election moves it on
        self._valid_until = math.inf
        #: what :meth:`guard` checks: the strategy and request of the term's
        #: lease row (``None``: a quorum's, or a term seen from another process)
        self._pin: tuple[Strategy, Request] | None = None

    @property
    def ended(self) -> bool:
        """True once this term is over (or is being handed over): stop working.

        Also true as soon as the renew deadline has passed on this process's
        clock, before the election has confirmed the loss.
        """
        return self._ended.is_set() or self._expired()

    @property
    def stepping_down(self) -> bool:
        """True when the term ends gracefully: the lease is kept until the target returns."""
        return self._ended.is_set() and self.reason == STEPPING_DOWN and not self._expired()

    def _expired(self) -> bool:
        return _now() >= self._valid_until

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds; return True as soon as the term ends.

        The loop of a leader's work: ``while not leadership.wait(interval): ...``.
        """
        end = None if timeout is None else _now() + timeout
        while True:
            now = _now()
            left = self._valid_until - now
            if left <= 0:
                if self._expired():
                    return True
                continue  # the deadline has just moved on
            step = left if end is None else min(left, end - now)
            if step <= 0:
                return self.ended
            if self._ended.wait(step):
                return True

    def guard(self, using: str | None = None) -> contextlib.AbstractContextManager[None]:
        """A transaction whose writes commit only while this term lasts.

        Like :meth:`django_dlock.Lock.guard`: the term's lease row is checked
        at the end of the block, in its transaction (still this term's,
        unexpired on the database clock), and kept until it commits, so the
        next leader's term begins after the writes, never before. A term
        found over rolls the block back and raises :class:`LockLost`::

            def lead(leadership):
                while not leadership.wait(60):
                    report = build_report()            # may take long
                    with leadership.guard():           # only while we lead
                        Report.objects.filter(pk=1).update(data=report)

        Raises:
            LockLost: the term is over; nothing of the block was written.
            GuardNotSupported: an election on a quorum of databases, or a
                target isolated in a child process (``run(isolate=True)``):
                fence the writes with :attr:`term` instead; or ``using`` is
                another database than the election's.
        """
        from django_dlock.exceptions import GuardNotSupported
        from django_dlock.guard import pinned, same_database
        from django_dlock.strategies.base import guards

        names = repr(f"leader:{self.name}")
        strategy, req = self._pin or (None, None)
        if not guards(strategy) or req is None:
            raise GuardNotSupported(
                f"the leadership of {self.name!r} is not kept by a transaction of this "
                "process (an election on a quorum of databases, or a target isolated in a "
                "child process): pass the term to the writes and refuse older ones "
                "(see Fencing in the django-dlock docs)"
            )
        same_database(names, req.alias, using)
        if self.ended and not self.stepping_down:  # a graceful stop keeps the lease
            raise LockLost(
                f"the guarded writes under {names} were not made: term {self.term} is over "
                f"({self.reason or 'its renew deadline passed'})"
            )

        def lost(_: Request) -> str:
            return "the term's lease was taken over, released or ran out"

        return pinned(strategy, [req], names, lost, lambda: None)

    def check(self) -> None:
        """Raise :class:`LockLost` if this term is over.

        :meth:`LeaderElection.run` treats that ``LockLost`` as the normal
        end of a term and campaigns again.
        """
        if self.ended:
            reason = self.reason or "its renew deadline passed"
            raise LockLost(f"leadership of {self.name!r} (term {self.term}) ended: {reason}")

    async def wait_ended(self) -> None:
        """Await the end of this term (asyncio)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            def settle() -> None:
                if not done.done():
                    done.set_result(None)

            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(settle)

        self._add_callback(wake)
        await done

    def _add_callback(self, callback: Callable[[], None]) -> None:
        with self._mutex:
            if not self._ended.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _end(self, reason: str) -> None:
        with self._mutex:
            if self._ended.is_set():
                return
            self.reason = reason
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def __repr__(self) -> str:
        state = f"ended: {self.reason or 'renew deadline passed'}" if self.ended else "active"
        return f"<Leadership {self.name!r} term={self.term} {state}>"
