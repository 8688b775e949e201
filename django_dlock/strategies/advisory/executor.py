"""Threads in which async holders run their blocking advisory statements.

Async holders wait in a thread of a small dedicated executor
(:func:`executor`), or in a thread of their own for a wait
(:func:`in_thread`), so a blocking ``pg_advisory_lock`` never blocks the
event loop nor Django's shared sync thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: threads of the executor in which async holders run short advisory statements
#: (a wait runs in a thread of its own: :func:`in_thread`)
WAIT_THREADS = 8

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_mutex = threading.Lock()
_orphans: list[Any] = []


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads in which async holders run short advisory statements."""
    global _executor
    if _executor is None:
        with _executor_mutex:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=WAIT_THREADS, thread_name_prefix="django-dlock-advisory"
                )
    return _executor


def in_thread(
    loop: asyncio.AbstractEventLoop, func: Callable[..., T], *args: Any
) -> asyncio.Future[T]:
    """Run ``func(*args)`` in a new daemon thread; its result as a future of ``loop``.

    For waits, which can last: a thread per wait never starves the executor,
    and a daemon thread never holds up the interpreter's exit.
    """
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = func(*args)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="django-dlock-advisory-wait", daemon=True).start()
    return future


def _after_fork_in_child() -> None:
    # Never shut down (nor use) the parent's executor in the child.
    global _executor, _executor_mutex
    _orphans.append(_executor)
    _executor = None
    _executor_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
