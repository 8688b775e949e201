"""The drivers of an election: ``run`` (a thread) and ``arun`` (a task).

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
from typing import TYPE_CHECKING, Any, TypeVar

from django_dlock.exceptions import LockLost
from django_dlock.leader.isolation import run_isolated
from django_dlock.leader.leadership import Leadership, _current

if TYPE_CHECKING:
    from django_dlock.leader.election import LeaderElection

logger = logging.getLogger("django_dlock")

T = TypeVar("T")

__all__ = ["arun", "run"]


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
