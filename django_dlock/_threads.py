"""Daemon threads that use the database, and close what they opened.

Django opens one connection per thread and alias, and closes it only at the
end of a request. A background thread (a renewer, the leader election's
I/O thread, a release that must outlive a cancelled task) has no request:
it must close its own connections when it ends, or each one leaks a
database session until the garbage collector finds it. Every such thread of
the package starts here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from asgiref.sync import sync_to_async
from django.db import connections

from django_dlock.strategies.connection import close_private_connections

__all__ = ["SerialThread", "close_thread_connections", "closing", "start_db_thread", "to_the_end"]

logger = logging.getLogger("django_dlock")


def close_thread_connections(alias: str | None = None) -> None:
    """Close the calling thread's connections: ``alias``'s (or all) and the private ones."""
    if alias is None:
        connections.close_all()
    else:
        connections[alias].close()
    close_private_connections()


def closing(func: Callable[[], object], alias: str | None = None) -> Callable[[], None]:
    """``func`` wrapped so that its thread's connections are closed when it returns."""

    def run() -> None:
        try:
            func()
        finally:
            close_thread_connections(alias)

    return run


def start_db_thread(
    func: Callable[[], object], name: str, *, alias: str | None = None, daemon: bool = True
) -> threading.Thread:
    """Start a thread that runs ``func``, then closes its connections (see :func:`closing`)."""
    thread = threading.Thread(target=closing(func, alias), name=name, daemon=daemon)
    thread.start()
    return thread


async def to_the_end(func: Callable[[], None], what: str) -> None:
    """Run ``func`` in a worker thread, to the end even if the task is cancelled.

    A release must not be dropped because the task was cancelled before the
    worker thread started it (``asyncio.wait_for``, a client that went
    away): then it runs in a thread of its own, and its errors are logged.
    """
    mutex = threading.Lock()
    state = {"started": False, "cancelled": False}

    def run() -> None:
        with mutex:
            if state["cancelled"]:
                return
            state["started"] = True
        func()

    try:
        await sync_to_async(run)()
    except asyncio.CancelledError:
        with mutex:
            state["cancelled"] = True
            started = state["started"]
        if not started:
            start_db_thread(lambda: _run_logged(func, what), "django-dlock-release")
        raise


def _run_logged(func: Callable[[], None], what: str) -> None:
    try:
        func()
    except Exception:
        logger.exception("django-dlock: %s after a cancellation failed", what)


class SerialThread:
    """A database thread that runs the calls posted to it one at a time, in order.

    :meth:`close` lets it finish the calls already posted, then end and
    close its connections. ``on_exit`` runs first when it ends (e.g. to
    close a dedicated session).
    """

    def __init__(
        self, name: str, *, alias: str | None = None, on_exit: Callable[[], None] | None = None
    ) -> None:
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._on_exit = on_exit
        self._thread = start_db_thread(self._serve, name, alias=alias)

    def post(self, call: Callable[[], None]) -> None:
        self._queue.put(call)

    def close(self) -> None:
        """End after the calls already posted (returns at once)."""
        self._queue.put(None)

    def join(self, timeout: float | None = None) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _serve(self) -> None:
        try:
            while (call := self._queue.get()) is not None:
                call()
        finally:
            if self._on_exit is not None:
                self._on_exit()
