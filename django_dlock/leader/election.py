"""``LeaderElection``: the public object, its configuration, start and stop.

The state machine that campaigns and leads is
:class:`~django_dlock.leader.campaign.Campaign` (the election's own thread);
``run`` and ``arun`` are below.

The drivers of an election: ``run`` (a thread) and ``arun`` (a task).

Each waits for a term, calls the target with its :class:`Leadership`, and
stands by again when the term is lost, until the target returns while
leading, raises, or a stop is asked (SIGTERM/SIGINT included). Documented on
:meth:`LeaderElection.run <django_dlock.leader.LeaderElection.run>` and
:meth:`LeaderElection.arun <django_dlock.leader.LeaderElection.arun>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import connections

from django_dlock.exceptions import LockLost, StrategyNotSupported
from django_dlock.keys import make_key
from django_dlock.leader import election as drivers
from django_dlock.leader.backends import _AdvisoryBackend, _Backend, _LeaseBackend, read_record
from django_dlock.leader.campaign import EXPIRY_MARGIN, Campaign, Dispatcher
from django_dlock.leader.isolation import run_isolated
from django_dlock.leader.leadership import LeaderRecord, Leadership, _current, _now
from django_dlock.leader.quorum import QuorumBackend
from django_dlock.strategies.quorum import quorum_aliases, quorum_strategy
from django_dlock.validation import JITTER, alias_error, validate_timing, validated

__all__ = [
    "EXPIRY_MARGIN",
    "JITTER",
    "LeaderElection",
    "STRATEGIES",
    "arun",
    "run",
    "validate_timing",
]


logger = logging.getLogger("django_dlock")

T = TypeVar("T")


def run(
    election: LeaderElection,
    target: Callable[[Leadership], T],
    *,
    handle_signals: bool,
    isolate: bool,
) -> T | None:
    """:meth:`LeaderElection.run`: the target in the calling thread, term after term."""
    restore = _handle_signals(election.key.name, election._request_stop) if handle_signals else None
    election.start()
    try:
        while True:
            leadership = election._next_term()
            if leadership is None:
                return None
            election._set_busy(True)
            election._target_thread = threading.current_thread()
            context = _current.set(leadership)
            try:
                if isolate:
                    result = run_isolated(target, leadership, election.key.name, _grace(election))
                else:
                    result = target(leadership)
            except LockLost:
                if leadership.ended:
                    continue
                raise
            finally:
                _current.reset(context)
                election._target_thread = None
                election._set_busy(False)
            if not leadership.ended:
                return result
    finally:
        if restore is not None:
            restore()
        election.stop()


def _grace(election: LeaderElection) -> float:
    """How long an isolated target may take to end before it is killed."""
    return min(1.0, (election.lease - election.renew_deadline) / 2)


async def arun(
    election: LeaderElection,
    target: Callable[[Leadership], Awaitable[T]],
    *,
    handle_signals: bool,
) -> T | None:
    """:meth:`LeaderElection.arun`: the target as a task, cancelled when its term ends."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def poke() -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(changed.set)

    election._watchers.append(poke)
    restore = (
        _handle_async_signals(loop, election.key.name, election._request_stop)
        if handle_signals
        else None
    )
    election.start()
    try:
        while True:
            leadership = await election._anext_term(changed)
            if leadership is None:
                return None
            election._set_busy(True)
            try:
                task = asyncio.ensure_future(_call_target(target, leadership))
                ended = asyncio.ensure_future(leadership.wait_ended())
                try:
                    await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ended.cancel()
                    if not task.done():
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
            finally:
                election._set_busy(False)
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
        election._watchers.remove(poke)
        if restore is not None:
            restore()
        await election.astop()


async def _call_target(target: Callable[[Leadership], Awaitable[T]], leadership: Leadership) -> T:
    _current.set(leadership)  # this task's own context
    return await target(leadership)


def _handle_signals(name: str, request_stop: Callable[[], None]) -> Callable[[], None] | None:
    """Step down on SIGTERM/SIGINT (main thread only); returns what restores the handlers."""
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
            name,
            signal.Signals(signum).name,
        )
        request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous[signum] = signal.signal(signum, on_signal)
    return restore


def _handle_async_signals(
    loop: asyncio.AbstractEventLoop, name: str, request_stop: Callable[[], None]
) -> Callable[[], None] | None:
    """:func:`_handle_signals` for an event loop in the main thread."""
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
        logger.info("django-dlock: %s: %s, stepping down", name, signal.Signals(signum).name)
        request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(signum)
        try:
            loop.add_signal_handler(signum, on_signal, signum)
        except (NotImplementedError, RuntimeError, ValueError):
            continue
        installed[signum] = previous
    return restore


#: strategies a LeaderElection can use
STRATEGIES = ("lease", "advisory")


class LeaderElection(Campaign):
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
            :class:`django_dlock.models.Lock`), or a list of aliases of
            independent databases: the leadership is then a lease held on a
            majority of them (the lease strategy only; see the quorum docs).
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
            or are not positive numbers; ``using`` is unknown, an empty list,
            names an alias twice, or two aliases of one database.
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
        using: str | list[str] | tuple[str, ...] | None = None,
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
        quorum: tuple[str, ...] | None = None
        if using is not None and not isinstance(using, str):
            quorum = quorum_aliases(using)
            quorum_strategy(strategy, quorum)  # only the lease strategy can
            using = quorum[0] if len(quorum) == 1 else None
            quorum = None if len(quorum) == 1 else quorum
        if using is not None:
            validated(alias_error(using))
        if identity is not None and (not isinstance(identity, str) or not identity.strip()):
            raise ValueError("identity must be a non-empty string")
        self.strategy = strategy
        self.using = using
        #: the databases of an election on a quorum (``using=[...]``), else ``None``
        self.quorum = quorum
        self._identity = identity[:255] if identity else None
        self.on_started_leading = on_started_leading
        self.on_stopped_leading = on_stopped_leading
        self.on_new_leader = on_new_leader
        if strategy == "advisory" and connections[self.alias].vendor != "postgresql":
            raise StrategyNotSupported(
                f"the advisory election needs PostgreSQL; database {self.alias!r} is "
                f"{connections[self.alias].vendor}: use the lease strategy "
                '(strategy="lease", dlock_runworker --strategy lease), which works on every '
                "database"
            )
        self._backend: _Backend
        if quorum is not None:
            self._backend = QuorumBackend(quorum, self.retry)
        elif strategy == "advisory":
            self._backend = _AdvisoryBackend(self._session_lost, self.retry)
        else:
            self._backend = _LeaseBackend(self.retry)
        self._init_state()

    # -- configuration and state -------------------------------------------------

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
        """The current leader as the database records it (``None``: no leader).

        On a quorum: the candidate whose lease is live on a majority of the
        databases, with its term.

        Raises:
            QuorumUnavailable: on a quorum, a majority of the databases did not answer.
        """
        if isinstance(self._backend, QuorumBackend):
            return self._backend.record(self.key, self.lease)
        return read_record(self.alias, self.key, self.lease)

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
            self._dispatcher = Dispatcher(label)
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
            self._dispatcher.stop(wait=True)
        if self._error is not None:
            error, self._error = self._error, None
            raise error

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
        return drivers.run(self, target, handle_signals=handle_signals, isolate=isolate)

    async def arun(
        self, target: Callable[[Leadership], Awaitable[T]], *, handle_signals: bool = True
    ) -> T | None:
        """Async :meth:`run`: ``await target(leadership)`` as a task while leading.

        The task is cancelled the moment the term ends (lost, or a graceful
        stop); the lease is released once it has finished. SIGTERM/SIGINT
        stop the election when ``handle_signals`` and running in the main
        thread's event loop.
        """
        return await drivers.arun(self, target, handle_signals=handle_signals)

    def __repr__(self) -> str:
        return (
            f"<LeaderElection {self.key.name} lease={self.lease:g} "
            f"renew_deadline={self.renew_deadline:g} retry={self.retry:g} "
            f"strategy={self.strategy}>"
        )


LeaderElection.signal_sender = LeaderElection
