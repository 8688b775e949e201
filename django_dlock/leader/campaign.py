"""The election's state machine, run by its own thread.

A candidate is in one of three states, and :meth:`Campaign._loop` moves it
between them one step at a time:

* **standing by** (no leadership): every ``retry`` seconds (jittered, sooner
  when the lease it saw should have ended, at once when a release is
  heard) it tries to take the lease (:meth:`Campaign._campaign`);
* **leading**: every ``retry`` seconds it renews (:meth:`Campaign._renew`);
  a renewal that fails, is refused, or cannot finish before
  ``renew_deadline`` ends the term at once (:meth:`Campaign._lose`), before
  the lease can run out in the database;
* **stepping down**: a stop was asked; the running target is told to
  finish, the lease is renewed meanwhile, then released
  (:meth:`Campaign._step_down`).

Database calls run on an :class:`~django_dlock.leader.campaign.IOThread`
and are waited for only as long as the current deadline allows; callbacks
and signals run in order on a :class:`~django_dlock.leader.campaign.Dispatcher`.
The drivers (``run``, ``arun``) meet this thread through a condition:
:meth:`Campaign._next_term`, :meth:`Campaign._set_busy` and
:meth:`Campaign._request_stop`.

The election's two helper threads: database I/O, and callback dispatch.

Both run what is posted to them one at a time, in order
(:class:`~django_dlock._threads.SerialThread`), so that the election's own
thread never blocks on the database or on user code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import secrets
import threading
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from django.db import connections

from django_dlock import notify, signals, tracing
from django_dlock._threads import SerialThread, close_thread_connections
from django_dlock.conf import lock_alias
from django_dlock.exceptions import NotMigrated
from django_dlock.identity import worker
from django_dlock.keys import Key
from django_dlock.leader.backends import ADVISORY_TOKEN, _Backend
from django_dlock.leader.leadership import STEPPING_DOWN, Leadership, _now
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import psycopg3

__all__ = ["Campaign", "Dispatcher", "EXPIRY_MARGIN", "IOThread"]


logger = logging.getLogger("django_dlock")

T = TypeVar("T")


class IOThread(SerialThread):
    """A thread that runs the election's database calls, one at a time.

    The election waits for each call only as long as it may; a call that
    hangs (a dead network, a row lock) is abandoned with its thread, which
    ends (and closes its connection) whenever the call returns.
    """

    def __init__(self, alias: str, label: str, backend: _Backend) -> None:
        self.alias = alias
        self.backend = backend
        super().__init__(f"{label}-io", alias=alias, on_exit=self._close_backend)

    def submit(self, func: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(func(*args))
            except BaseException as exc:
                future.set_exception(exc)

        self.post(call)
        return future

    def _close_backend(self) -> None:
        with contextlib.suppress(Exception):
            self.backend.close()


class Dispatcher(SerialThread):
    """Runs callbacks and signal sends in order, off the election's thread."""

    def __init__(self, label: str) -> None:
        super().__init__(f"{label}-callbacks")

    def post(self, call: Callable[[], Any]) -> None:
        def logged() -> None:
            try:
                call()
            except Exception:
                logger.exception("django-dlock: a leader-election callback raised")

        super().post(logged)

    def stop(self, wait: bool) -> None:
        """End after the callbacks already posted; ``wait`` for them unless called from them."""
        self.close()
        if wait:
            self.join()


logger = logging.getLogger("django_dlock")


#: a standby looks again this long after the lease it saw should have ended
EXPIRY_MARGIN = 0.01


class NoAnswer(TimeoutError):
    """A database call of the election was abandoned at its deadline."""


class Campaign:
    """The election's state and the thread that campaigns, leads and steps down.

    :class:`~django_dlock.leader.LeaderElection` sets the configuration
    (validated) and calls :meth:`_init_state`; this class owns everything
    that changes while the election runs.
    """

    #: the sender of ``leader_changed`` (the public ``LeaderElection`` class)
    signal_sender: ClassVar[type[Any]]

    # -- configuration, set by LeaderElection ----------------------------------
    key: Key
    name: str
    lease: float
    renew_deadline: float
    retry: float
    strategy: str
    using: str | None
    _identity: str | None
    _backend: _Backend
    on_started_leading: Callable[[int], Any] | None
    on_stopped_leading: Callable[[], Any] | None
    on_new_leader: Callable[[str], Any] | None

    def _init_state(self) -> None:
        self._lost_session: str | None = None
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)
        self._thread: threading.Thread | None = None
        self._leadership: Leadership | None = None
        self._valid_until = 0.0
        self._stop_requested = False
        self._force = False
        self._busy = False
        self._target_thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._watchers: list[Callable[[], None]] = []
        self._wake = notify.Waiter()
        self._observed: tuple[str, int] | None = None
        self._req: Request | None = None
        self._io: IOThread | None = None
        self._dispatcher: Dispatcher | None = None
        #: why the last leadership ended: "stepped down" or "lost: <reason>"
        self.stopped_reason: str | None = None
        #: the current term's span and its tracer, while traced
        self._term_span: tuple[Any, Any] | None = None

    quorum: tuple[str, ...] | None

    @property
    def alias(self) -> str:
        """The election's database (on a quorum: the first one, for the I/O thread)."""
        return self.quorum[0] if self.quorum else lock_alias(self.using)

    def _listened(self) -> list[str]:
        """The databases whose release notifications wake this candidate.

        None on a quorum: a refused or failed round gives back the leases it
        took, and each give-back notifies, which would wake the candidate
        itself at once, again and again. Quorum candidates look every
        ``retry`` period (and when the lease they saw should have ended).
        """
        if self.quorum or connections[self.alias].vendor != "postgresql" or not psycopg3():
            return []
        return [self.alias]

    @property
    def identity(self) -> str:
        """This candidate's identity (as stored in the ``owner`` column)."""
        return self._identity or worker().label

    # -- meeting the drivers (run, arun, stop) ----------------------------------------

    def _request_stop(self, force: bool = False) -> None:
        with self._changed:
            self._stop_requested = True
            self._force = self._force or force
            self._changed.notify_all()
        self._wake.wake()
        self._poke()

    def _term_or_wait(self) -> tuple[bool, Leadership | None]:
        """Under the mutex: ``(True, term)`` to lead, ``(True, None)`` when stopped, else wait."""
        if self._stop_requested:
            return True, None
        self._raise_if_dead()
        held = self._leadership
        if held is not None and not held.ended:
            return True, held
        return False, None

    def _next_term(self) -> Leadership | None:
        with self._changed:
            while True:
                done, term = self._term_or_wait()
                if done:
                    return term
                self._changed.wait(0.5)

    async def _anext_term(self, changed: asyncio.Event) -> Leadership | None:
        while True:
            changed.clear()
            with self._mutex:
                done, term = self._term_or_wait()
            if done:
                return term
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), 0.5)

    def _raise_if_dead(self) -> None:
        thread = self._thread
        if self._error is not None or (thread is not None and not thread.is_alive()):
            error = self._error or RuntimeError("the election thread ended")
            self._error = None
            raise error

    def _set_busy(self, busy: bool) -> None:
        with self._changed:
            self._busy = busy
            self._changed.notify_all()
        self._wake.wake()

    # -- the election's thread ------------------------------------------------------

    def _poke(self) -> None:
        for watcher in list(self._watchers):
            watcher()

    def _post(self, func: Callable[[], Any]) -> None:
        if self._dispatcher is not None:
            self._dispatcher.post(func)

    def _session_lost(self, reason: str) -> None:
        # From the advisory session watcher's thread: the leader's session ended.
        self._lost_session = reason
        self._wake.wake()

    def _new_request(self) -> Request:
        prefix = ADVISORY_TOKEN if self.strategy == "advisory" else ""
        token = f"{prefix}{worker().bits}-{secrets.token_hex(8)}"
        return Request(
            key=self.key,
            alias=self.alias,
            token=token,
            owner=self.identity,
            ttl=self.lease,
            row=self.key.name,
        )

    def _main(self) -> None:
        label = f"django-dlock-elect {self.key.name}"
        self._io = IOThread(self.alias, label, self._backend)
        self._req = self._new_request()
        listening: list[notify.Listener] = []
        try:
            for alias in self._listened():
                listen = notify.listener(alias)
                listen.register(self.key.name, self._wake)
                listening.append(listen)
            self._loop()
        except BaseException as exc:
            self._error = exc
            if isinstance(exc, NotMigrated):  # the message says all: no traceback
                logger.error("django-dlock: the election %s failed: %s", self.key.name, exc)
            else:
                logger.exception("django-dlock: the election %s failed", self.key.name)
            if self._leadership is not None:
                self._end_term(f"the election failed: {exc}", graceful=False)
        finally:
            for listen in listening:
                listen.unregister(self.key.name, self._wake)
            self._io.close()
            close_thread_connections()
            with self._changed:
                self._changed.notify_all()
            self._poke()

    def _loop(self) -> None:
        next_renew = 0.0
        while True:
            with self._mutex:
                stop, force, busy = self._stop_requested, self._force, self._busy
                held = self._leadership
            if held is None:
                if stop:
                    return
                if busy:  # the last term's target is still finishing
                    self._pause(self.retry)
                    continue
                pause = self._campaign()
                if self._leadership is not None:
                    next_renew = _now() + self.retry
                self._pause(pause)
                continue
            if stop and (force or not busy):
                self._step_down()
                return
            if stop:
                held._end(STEPPING_DOWN)  # tell the target; keep renewing meanwhile
            if self._lost_session is not None:
                self._lose(f"the advisory lock's session ended: {self._lost_session}")
                continue
            if _now() >= self._valid_until:
                self._lose("the renew deadline passed before a renewal could start")
                continue
            wait = next_renew - _now()
            if wait > 0:
                self._pause(wait)
                continue
            pause = self._renew()
            next_renew = _now() + pause

    def _pause(self, seconds: float) -> None:
        if seconds > 0:
            self._wake.thread_event.wait(seconds)
        self._wake.clear()

    def _call(
        self, func: Callable[..., T], *args: Any, until: float
    ) -> tuple[bool, T | BaseException]:
        """Run ``func`` on the I/O thread; wait for it until ``until`` (monotonic).

        A call still running then is abandoned: its thread is retired (it
        will release our token's lease when the call returns) and the
        candidate takes a new token, so nothing the late call does can be
        mistaken for the next term.
        """
        assert self._io is not None and self._req is not None
        submitted = _now()
        future = self._io.submit(func, *args)
        try:
            return True, future.result(timeout=max(0.0, until - submitted))
        except concurrent.futures.TimeoutError as exc:
            if future.done():  # the call itself raised a TimeoutError (a LockTimeout)
                return False, exc
            old_io, old_req = self._io, self._req
            old_io.submit(self._backend.release, old_req)
            old_io.close()
            label = f"django-dlock-elect {self.key.name}"
            self._io = IOThread(self.alias, label, self._backend)
            self._req = self._new_request()
            waited = _now() - submitted
            return False, NoAnswer(f"the database did not answer within {waited:.3g} s")
        except Exception as exc:
            return False, exc

    def _campaign(self) -> float:
        """One attempt to lead; returns how long to wait before the next step."""
        assert self._req is not None
        started = _now()
        wait = self._jittered()
        self._lost_session = None
        ok, result = self._call(
            self._backend.acquire, self._req, wait, until=started + self.renew_deadline
        )
        if not ok:
            if isinstance(result, NotMigrated):
                raise result  # no attempt can succeed: the election fails (dlock_runworker exits 1)
            logger.warning("django-dlock: %s: campaign attempt failed: %r", self.key.name, result)
            return self._jittered()
        if result is not None:
            assert isinstance(result, int)
            if _now() >= started + self.renew_deadline:
                self._call(self._backend.release, self._req, until=started + self.lease)
                return self._jittered()
            self._begin_term(result, started)
            return 0.0
        ok, seen = self._call(
            self._backend.observe, self._req, self.lease, until=_now() + self.retry
        )
        # A backend that waited for the leadership already spent the pause.
        pause = max(0.0, wait - (_now() - started))
        if ok:
            assert isinstance(seen, tuple)
            record, left = seen
            if record is not None:
                self._observe(record.identity, record.term)
            pause = min(pause, max(left, 0.0) + EXPIRY_MARGIN)
        return pause

    def _jittered(self) -> float:
        return self.retry * random.uniform(0.8, 1.0)

    def _renew(self) -> float:
        """One renewal; returns how long to wait before the next one."""
        assert self._req is not None
        started = _now()
        deadline = self._valid_until
        ok, result = self._call(self._backend.renew, self._req, until=deadline)
        if ok and result is True:
            with self._mutex:
                held = self._leadership
                # A term whose deadline has passed stays over, even if a
                # renewal started in time answers late: its target may have
                # seen it end already.
                expired = _now() >= deadline
                if not expired:
                    self._valid_until = started + self.renew_deadline
                    if held is not None:
                        held._valid_until = self._valid_until
            if expired:
                self._lose("the renew deadline passed while a renewal was answering")
                return 0.0
            return self.retry
        if ok:
            self._lose(
                "the advisory lock or the lease was lost (session ended, taken over or "
                "force-released)"
                if self.strategy == "advisory"
                else "the lease was taken over or force-released"
            )
            return 0.0
        if _now() >= deadline or isinstance(result, NoAnswer):
            self._lose(
                f"could not renew within renew_deadline ({self.renew_deadline:g} s): {result}"
            )
            return 0.0
        logger.warning("django-dlock: %s: renewal failed, retrying: %s", self.key.name, result)
        return min(self.retry, max(0.05, (deadline - _now()) / 3))

    def _observe(self, identity: str, term: int) -> None:
        if self._observed == (identity, term):
            return
        self._observed = (identity, term)
        callback = self.on_new_leader
        if callback is not None:
            self._post(lambda: callback(identity))
        self._post(
            lambda: signals.leader_changed.send(
                self.signal_sender, name=self.key.name, leader=identity, term=term, election=self
            )
        )

    def _begin_term(self, term: int, started: float) -> None:
        leadership = Leadership(self.name, term, self.identity)
        if self._backend.guards is not None and self._req is not None:
            leadership._pin = (self._backend.guards, self._req)
        with self._changed:
            self._leadership = leadership
            self._valid_until = started + self.renew_deadline
            leadership._valid_until = self._valid_until
            self._changed.notify_all()
        logger.info("django-dlock: %s: became leader (term %s)", self.key.name, term)
        if tracing.tracer is not None:
            span = tracing.tracer.term_started(
                self.key.name, self.strategy, self.signal_sender, self.alias, term
            )
            self._term_span = (tracing.tracer, span)
        self._observe(self.identity, term)
        callback = self.on_started_leading
        if callback is not None:
            self._post(lambda: callback(term))
        self._poke()

    def _lose(self, reason: str) -> None:
        """Stop leading at once (the lease may still be ours in the database)."""
        assert self._req is not None
        logger.warning("django-dlock: %s: lost leadership: %s", self.key.name, reason)
        self._end_term(f"lost: {reason}", graceful=False)
        # Give back what we may still hold, and campaign under a new token so
        # that a later win is a new term.
        assert self._io is not None
        self._io.submit(self._backend.release, self._req)
        self._req = self._new_request()

    def _step_down(self) -> None:
        """End the term, then give the lease back: the leadership has ended (and
        ``on_stopped_leading`` has run, if it returns within ``retry``) before
        anyone else can take the lease."""
        assert self._req is not None
        started = _now()
        self._end_term("stepped down", graceful=True)
        self._callbacks_done(until=started + self.retry)
        ok, result = self._call(self._backend.release, self._req, until=started + self.retry)
        if not ok:
            logger.warning("django-dlock: %s: release failed: %s", self.key.name, result)
        logger.info("django-dlock: %s: stepped down", self.key.name)

    def _callbacks_done(self, until: float) -> None:
        """Wait (at most until ``until``) for the callbacks posted so far to run."""
        if self._dispatcher is None:
            return
        done = threading.Event()
        self._dispatcher.post(done.set)
        done.wait(max(0.0, until - _now()))

    def _end_term(self, reason: str, graceful: bool) -> None:
        with self._changed:
            held = self._leadership
            self._leadership = None
            self._valid_until = 0.0
            self.stopped_reason = reason
            self._changed.notify_all()
        if held is None:
            return
        held._end(reason)
        if self._term_span is not None:
            tracer, span = self._term_span
            self._term_span = None
            tracer.term_ended(span, reason, graceful)
        self._observed = None
        callback = self.on_stopped_leading
        if callback is not None:
            self._post(callback)
        self._post(
            lambda: signals.leader_changed.send(
                self.signal_sender, name=self.key.name, leader=None, term=None, election=self
            )
        )
        self._poke()
