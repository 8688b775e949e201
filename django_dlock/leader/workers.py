"""The election's two helper threads: database I/O, and callback dispatch.

Both run what is posted to them one at a time, in order
(:class:`~django_dlock._threads.SerialThread`), so that the election's own
thread never blocks on the database or on user code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from django_dlock._threads import SerialThread
from django_dlock.leader.backends import _Backend

logger = logging.getLogger("django_dlock")

T = TypeVar("T")

__all__ = ["Dispatcher", "IOThread"]


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
