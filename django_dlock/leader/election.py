"""``LeaderElection``: the election's state machine, its threads and ``run``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import math
import queue
import random
import secrets
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections, router

from django_dlock import notify, signals
from django_dlock.exceptions import LockLost, StrategyNotSupported
from django_dlock.identity import worker
from django_dlock.keys import make_key
from django_dlock.leader.backends import (
    ADVISORY_TOKEN,
    _AdvisoryBackend,
    _Backend,
    _LeaseBackend,
    _read_record,
)
from django_dlock.leader.isolation import TargetDied, _isolated_main, _stop_process
from django_dlock.leader.leadership import (
    STEPPING_DOWN,
    LeaderRecord,
    Leadership,
    _current,
    _now,
)
from django_dlock.strategies.base import Request, close_private_connections

logger = logging.getLogger("django_dlock")

T = TypeVar("T")

#: strategies a LeaderElection can use
STRATEGIES = ("lease", "advisory")
#: Kubernetes' jitter factor: renew_deadline must exceed retry * JITTER
JITTER = 1.2
#: a standby looks again this long after the lease it saw should have ended
EXPIRY_MARGIN = 0.01

__all__ = ["LeaderElection", "validate_timing"]


class _IOThread:
    """A thread that runs the election's database calls, one at a time.

    The election waits for each call only as long as it may; a call that
    hangs (a dead network, a row lock) is abandoned with its thread, which
    ends (and closes its connection) whenever the call returns.
    """

    def __init__(self, alias: str, label: str, backend: _Backend) -> None:
        self.alias = alias
        self.backend = backend
        self._queue: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{label}-io", daemon=True)
        self._thread.start()

    def submit(self, func: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((future, func, args))
        return future

    def close(self) -> None:
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                future, func, args = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(func(*args))
                except BaseException as exc:
                    future.set_exception(exc)
        finally:
            with contextlib.suppress(Exception):
                self.backend.close()
            connections[self.alias].close()
            close_private_connections()


class _Dispatcher:
    """Runs callbacks and signal sends in order, off the election's thread."""

    def __init__(self, label: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{label}-callbacks", daemon=True)
        self._thread.start()

    def post(self, func: Callable[[], Any]) -> None:
        self._queue.put(func)

    def close(self, wait: bool) -> None:
        self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                func = self._queue.get()
                if func is None:
                    return
                try:
                    func()
                except Exception:
                    logger.exception("django-dlock: a leader-election callback raised")
        finally:
            connections.close_all()


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def validate_timing(
    lease: object, renew_deadline: object, retry: object
) -> tuple[float, float, float]:
    """Check ``lease > renew_deadline > retry * 1.2``; return the three as floats.

    Raises:
        ValueError: a value is not a positive number, or the rule is broken.
    """
    lease_s = _seconds(lease, "lease")
    deadline_s = _seconds(renew_deadline, "renew_deadline")
    retry_s = _seconds(retry, "retry")
    if not lease_s > deadline_s:
        raise ValueError(
            f"lease ({lease_s:g} s) must be greater than renew_deadline ({deadline_s:g} s): "
            "a leader must give up before its lease can be taken over"
        )
    if not deadline_s > retry_s * JITTER:
        raise ValueError(
            f"renew_deadline ({deadline_s:g} s) must be greater than retry * {JITTER} "
            f"({retry_s * JITTER:g} s): a leader must get more than one renewal attempt "
            "before its deadline"
        )
    return lease_s, deadline_s, retry_s


class LeaderElection:
    """Campaign for leadership of ``name``; at most one process leads at a time.

    Args:
        name: the election's name (stored as ``leader:<name>``).
        lease: seconds a leadership lasts unless renewed (``LeaseDuration``).
        renew_deadline: seconds a leader keeps trying to renew before it
            stops leading (``RenewDeadline``); must be < ``lease``.
        retry: seconds between attempts, to acquire or to renew
            (``RetryPeriod``); ``renew_deadline > retry * 1.2``.
        strategy: ``"lease"`` (any database) or ``"advisory"`` (PostgreSQL:
            a killed leader is replaced at once).
        using: database alias (default: the router's write database for
            :class:`django_dlock.models.Lock`).
        identity: how this candidate is named in the database and the
            admin (default: ``"<host> pid=<pid>"``).
        on_started_leading: ``f(term)``, when this process becomes leader.
        on_stopped_leading: ``f()``, when it stops (lost or stepped down).
        on_new_leader: ``f(identity)``, when a different leader (or term) is
            observed, this process included.

    Callbacks run in order on a thread of the election (never the one that
    renews); keep them short, and do the leader's work in :meth:`run`.

    Raises:
        ValueError: the timings break ``lease > renew_deadline > retry * 1.2``
            or are not positive numbers; ``using`` is unknown.
        StrategyNotSupported: the strategy is unknown, not available, or not
            supported by the database.
        InvalidLockKey: the name is not a valid key.
    """

    namespace = "leader"

    def __init__(
        self,
        name: Any,
        *,
        lease: float = 15.0,
        renew_deadline: float = 10.0,
        retry: float = 2.0,
        strategy: str = "lease",
        using: str | None = None,
        identity: str | None = None,
        on_started_leading: Callable[[int], Any] | None = None,
        on_stopped_leading: Callable[[], Any] | None = None,
        on_new_leader: Callable[[str], Any] | None = None,
    ) -> None:
        self.key = make_key(name, self.namespace)
        self.name = name if isinstance(name, str) else self.key.name.partition(":")[2]
        self.lease, self.renew_deadline, self.retry = validate_timing(lease, renew_deadline, retry)
        if strategy not in STRATEGIES:
            raise StrategyNotSupported(
                f"LeaderElection cannot use the strategy {strategy!r}; "
                f"choose one of {', '.join(STRATEGIES)}"
            )
        if using is not None and not isinstance(using, str):
            raise ValueError(
                f"LeaderElection takes one database alias, not {using!r}: elections on a "
                "quorum of databases are not supported yet (locks and TaskLock are)"
            )
        if using is not None and using not in connections:
            raise ValueError(f"unknown database alias {using!r}")
        if identity is not None and (not isinstance(identity, str) or not identity.strip()):
            raise ValueError("identity must be a non-empty string")
        self.strategy = strategy
        self.using = using
        self._identity = identity[:255] if identity else None
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.on_new_leader = on_new_leader
        if strategy == "advisory" and connections[self.alias].vendor != "postgresql":
            raise StrategyNotSupported(
                f"the advisory election needs PostgreSQL; database {self.alias!r} is "
                f"{connections[self.alias].vendor}: use the lease strategy "
                '(strategy="lease", runworker --strategy lease), which works on every database'
            )
        self._backend: _Backend
        if strategy == "advisory":
            self._backend = _AdvisoryBackend(self._session_lost)
        else:
            self._backend = _LeaseBackend()
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
        self._io: _IOThread | None = None
        self._dispatcher: _Dispatcher | None = None
        #: why the last leadership ended: "stepped down" or "lost: <reason>"
        self.stopped_reason: str | None = None

    # -- configuration and state -------------------------------------------------

    @property
    def alias(self) -> str:
        if self.using is not None:
            return self.using
        from django_dlock.models import Lock as LockRow

        return router.db_for_write(LockRow) or "default"

    @property
    def identity(self) -> str:
        """This candidate's identity (as stored in the ``owner`` column)."""
        return self._identity or worker().label

    @property
    def is_leader(self) -> bool:
        """Whether this process leads now (no query: judged by the renew deadline)."""
        with self._mutex:
            held = self._leadership
            return held is not None and not held.ended and _now() < self._valid_until

    @property
    def term(self) -> int | None:
        """The current term if this process leads, else ``None``."""
        with self._mutex:
            held = self._leadership
        return held.term if held is not None and not held.ended else None

    @property
    def stop_requested(self) -> bool:
        """True once :meth:`stop` (or SIGTERM/SIGINT in :meth:`run`) asked to stop."""
        return self._stop_requested

    def leader(self) -> LeaderRecord | None:
        """The current leader as the database records it (``None``: no leader)."""
        return _read_record(self.alias, self.key, self.lease)

    async def aleader(self) -> LeaderRecord | None:
        """Async :meth:`leader`."""
        return await sync_to_async(self.leader)()

    # -- start and stop --------------------------------------------------------------

    def start(self) -> None:
        """Start campaigning in background threads (returns at once)."""
        with self._mutex:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop_requested = False
            self._force = False
            self._error = None
            self._leadership = None
            self._observed = None
            self.stopped_reason = None
            self._wake.clear()
            label = f"django-dlock-elect {self.key.name}"
            self._dispatcher = _Dispatcher(label)
            self._thread = threading.Thread(target=self._main, name=label, daemon=True)
        self._thread.start()

    def stop(self, *, force: bool = False, timeout: float | None = None) -> None:
        """Stop campaigning; if leading, step down and release the lease at once.

        A target running under :meth:`run` is told to finish first (its
        :class:`Leadership` ends) and the lease is kept, and renewed, until it
        returns; ``force=True`` releases without waiting for it.

        Raises:
            Exception: what the election's thread failed with, if it failed.
        """
        self._request_stop(force)
        thread = self._thread
        current = threading.current_thread()
        if thread is None or current is thread:
            return
        if self._busy and current is self._target_thread:
            return  # called from the running target: run() finishes the stop
        thread.join(timeout)
        if not thread.is_alive() and self._dispatcher is not None:
            self._dispatcher.close(wait=True)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _request_stop(self, force: bool = False) -> None:
        with self._changed:
            self._stop_requested = True
            self._force = self._force or force
            self._changed.notify_all()
        self._wake.wake()
        self._poke()

    def __enter__(self) -> LeaderElection:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.stop()

    async def astart(self) -> None:
        """Async :meth:`start`."""
        self.start()

    async def astop(self, *, force: bool = False) -> None:
        """Async :meth:`stop` (waits in a worker thread)."""
        await sync_to_async(self.stop, thread_sensitive=False)(force=force)

    async def __aenter__(self) -> LeaderElection:
        await self.astart()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self.astop()

    # -- run a target while leading --------------------------------------------------

    def run(
        self,
        target: Callable[[Leadership], T],
        *,
        handle_signals: bool = True,
        isolate: bool = False,
    ) -> T | None:
        """Campaign, and call ``target(leadership)`` each time this process leads.

        Blocks until :meth:`stop` is called (or SIGTERM/SIGINT arrives, when
        ``handle_signals`` and called from the main thread; a second signal
        acts as if none were handled). The target runs in the calling thread
        and must return soon after ``leadership.ended`` becomes true (use
        ``leadership.wait(seconds)`` to sleep). When a term is lost, the
        process stands by and campaigns again; the target is called again on
        its next term (a :class:`LockLost` raised by
        :meth:`Leadership.check` after the term ended counts as returning).
        When the target returns while still leading, the process steps down
        and ``run`` returns its value; any other exception steps down and
        propagates. Returns ``None`` when stopped.

        ``isolate=True`` runs each term's target in a child process (started
        with ``multiprocessing``'s ``spawn`` method, which sets Django up
        again from ``DJANGO_SETTINGS_MODULE``): a target that holds the GIL,
        or blocks in C code, cannot starve the renewals of this process.
        When the term is lost the child is stopped (SIGTERM, then SIGKILL);
        on a graceful stop its ``Leadership`` ends and it may finish. The
        target must be picklable (a module-level function, or a
        ``functools.partial`` of one), and so must what it returns or raises.
        """
        restore = self._handle_signals() if handle_signals else None
        self.start()
        try:
            while True:
                leadership = self._next_term()
                if leadership is None:
                    return None
                self._set_busy(True)
                self._target_thread = threading.current_thread()
                context = _current.set(leadership)
                try:
                    if isolate:
                        result = self._run_isolated(target, leadership)
                    else:
                        result = target(leadership)
                except LockLost:
                    if leadership.ended:
                        continue
                    raise
                finally:
                    _current.reset(context)
                    self._target_thread = None
                    self._set_busy(False)
                if not leadership.ended:
                    return result
        finally:
            if restore is not None:
                restore()
            self.stop()

    def _run_isolated(self, target: Callable[[Leadership], T], leadership: Leadership) -> T:
        """Run ``target`` for ``leadership`` in a child process (see :meth:`run`)."""
        import multiprocessing
        import multiprocessing.connection
        import os

        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        child = context.Process(
            target=_isolated_main,
            args=(
                theirs,
                os.environ.get("DJANGO_SETTINGS_MODULE", ""),
                target,
                (leadership.name, leadership.term, leadership.identity),
                leadership._valid_until,
            ),
            name=f"django-dlock-isolated {self.key.name}",
            daemon=True,
        )
        child.start()
        theirs.close()
        sent_until = leadership._valid_until
        told_to_finish = False
        grace = min(1.0, (self.lease - self.renew_deadline) / 2)
        try:
            while True:
                ready = multiprocessing.connection.wait([ours, child.sentinel], timeout=0.05)
                if ours in ready:
                    try:
                        kind, value = ours.recv()
                    except (EOFError, OSError):
                        kind, value = "died", None
                    if kind == "returned":
                        result: T = value
                        return result
                    if kind == "raised":
                        assert isinstance(value, BaseException)
                        raise value
                elif child.sentinel in ready and not ours.poll():
                    kind = "died"
                else:
                    kind = ""
                if kind == "died":
                    child.join(grace)
                    if leadership.ended:
                        leadership.check()
                    raise TargetDied(
                        f"the isolated target of {self.key.name!r} (pid {child.pid}) ended "
                        f"without an answer (exit code {child.exitcode})"
                    )
                if leadership.ended and not leadership.stepping_down:
                    logger.warning(
                        "django-dlock: %s: term %s is over; stopping its isolated target (pid %s)",
                        self.key.name,
                        leadership.term,
                        child.pid,
                    )
                    _stop_process(child, grace)
                    leadership.check()
                with contextlib.suppress(OSError):
                    if leadership._valid_until != sent_until:
                        sent_until = leadership._valid_until
                        ours.send(("until", sent_until))
                    if leadership.stepping_down and not told_to_finish:
                        told_to_finish = True
                        ours.send(("end", leadership.reason))
        finally:
            ours.close()
            if child.is_alive():
                _stop_process(child, grace)

    async def arun(
        self, target: Callable[[Leadership], Awaitable[T]], *, handle_signals: bool = True
    ) -> T | None:
        """Async :meth:`run`: ``await target(leadership)`` as a task while leading.

        The task is cancelled the moment the term ends (lost, or a graceful
        stop); the lease is released once it has finished. SIGTERM/SIGINT
        stop the election when ``handle_signals`` and running in the main
        thread's event loop.
        """
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()

        def poke() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(changed.set)

        self._watchers.append(poke)
        restore = self._handle_async_signals(loop) if handle_signals else None
        self.start()
        try:
            while True:
                leadership = await self._anext_term(changed)
                if leadership is None:
                    return None
                self._set_busy(True)
                try:
                    task = asyncio.ensure_future(self._call_target(target, leadership))
                    ended = asyncio.ensure_future(leadership.wait_ended())
                    try:
                        await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        ended.cancel()
                        if not task.done():
                            task.cancel()
                            await asyncio.gather(task, return_exceptions=True)
                finally:
                    self._set_busy(False)
                if task.cancelled():
                    continue
                error = task.exception()
                if error is not None:
                    if isinstance(error, LockLost) and leadership.ended:
                        continue
                    raise error
                if not leadership.ended:
                    return task.result()
        finally:
            self._watchers.remove(poke)
            if restore is not None:
                restore()
            await self.astop()

    @staticmethod
    async def _call_target(
        target: Callable[[Leadership], Awaitable[T]], leadership: Leadership
    ) -> T:
        _current.set(leadership)  # this task's own context
        return await target(leadership)

    def _next_term(self) -> Leadership | None:
        with self._changed:
            while True:
                if self._stop_requested:
                    return None
                self._raise_if_dead()
                held = self._leadership
                if held is not None and not held.ended:
                    return held
                self._changed.wait(0.5)

    async def _anext_term(self, changed: asyncio.Event) -> Leadership | None:
        while True:
            changed.clear()
            with self._mutex:
                if self._stop_requested:
                    return None
                self._raise_if_dead()
                held = self._leadership
                if held is not None and not held.ended:
                    return held
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

    def _handle_signals(self) -> Callable[[], None] | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        previous: dict[int, Any] = {}

        def restore() -> None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            previous.clear()

        def on_signal(signum: int, frame: Any) -> None:
            restore()  # a second signal acts as if we had not been here
            logger.info(
                "django-dlock: %s: %s, stepping down",
                self.key.name,
                signal.Signals(signum).name,
            )
            self._request_stop()

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
        return restore

    def _handle_async_signals(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        installed: dict[int, Any] = {}

        def restore() -> None:
            for signum, previous in installed.items():
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(signum)
                    if previous is not None:
                        signal.signal(signum, previous)
            installed.clear()

        def on_signal(signum: int) -> None:
            restore()
            logger.info(
                "django-dlock: %s: %s, stepping down", self.key.name, signal.Signals(signum).name
            )
            self._request_stop()

        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(signum)
            try:
                loop.add_signal_handler(signum, on_signal, signum)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
            installed[signum] = previous
        return restore

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
            key=self.key, alias=self.alias, token=token, owner=self.identity, ttl=self.lease
        )

    def _main(self) -> None:
        label = f"django-dlock-elect {self.key.name}"
        self._io = _IOThread(self.alias, label, self._backend)
        self._req = self._new_request()
        listen: notify.Listener | None = None
        try:
            if connections[self.alias].vendor == "postgresql":
                listen = notify.listener(self.alias)
                listen.register(self.key.name, self._wake)
            self._loop()
        except BaseException as exc:
            self._error = exc
            logger.exception("django-dlock: the election %s failed", self.key.name)
            if self._leadership is not None:
                self._end_term(f"the election failed: {exc}", graceful=False)
        finally:
            if listen is not None:
                listen.unregister(self.key.name, self._wake)
            self._io.close()
            connections.close_all()
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
        except concurrent.futures.TimeoutError:
            old_io, old_req = self._io, self._req
            old_io.submit(self._backend.release, old_req)
            old_io.close()
            label = f"django-dlock-elect {self.key.name}"
            self._io = _IOThread(self.alias, label, self._backend)
            self._req = self._new_request()
            waited = _now() - submitted
            return False, TimeoutError(f"the database did not answer within {waited:.3g} s")
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
        if _now() >= deadline or isinstance(result, TimeoutError):
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
                LeaderElection, name=self.key.name, leader=identity, term=term, election=self
            )
        )

    def _begin_term(self, term: int, started: float) -> None:
        leadership = Leadership(self.name, term, self.identity)
        with self._changed:
            self._leadership = leadership
            self._valid_until = started + self.renew_deadline
            leadership._valid_until = self._valid_until
            self._changed.notify_all()
        logger.info("django-dlock: %s: became leader (term %s)", self.key.name, term)
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
        assert self._req is not None
        started = _now()
        ok, result = self._call(self._backend.release, self._req, until=started + self.retry)
        if not ok:
            logger.warning("django-dlock: %s: release failed: %s", self.key.name, result)
        logger.info("django-dlock: %s: stepped down", self.key.name)
        self._end_term("stepped down", graceful=True)

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
        self._observed = None
        callback = self.on_stopped_leading
        if callback is not None:
            self._post(callback)
        self._post(
            lambda: signals.leader_changed.send(
                LeaderElection, name=self.key.name, leader=None, term=None, election=self
            )
        )
        self._poke()

    def __repr__(self) -> str:
        return (
            f"<LeaderElection {self.key.name} lease={self.lease:g} "
            f"renew_deadline={self.renew_deadline:g} retry={self.retry:g} "
            f"strategy={self.strategy}>"
        )
