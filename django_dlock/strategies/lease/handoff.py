"""One acquiring step of an async caller, in a worker thread, safe against cancellation.

A statement cannot be stopped once it runs. If the task is cancelled
meanwhile (``asyncio.wait_for``, a client that went away), a lease the step
took is given back as soon as the step ends, so a cancelled acquire leaves
no lock behind.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from asgiref.sync import sync_to_async

from django_dlock._threads import start_db_thread
from django_dlock.strategies.base import Request

logger = logging.getLogger("django_dlock")


class Handoff:
    """What a worker thread's acquiring step and its (maybe cancelled) task share."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.cancelled = False
        self.finished = False
        self.result: Any = None


async def attempt(step: Callable[[], Any], req: Request, release: Callable[[Request], bool]) -> Any:
    """Run ``step`` (an acquiring step for ``req``) in a worker thread; if the task
    is cancelled, ``release(req)`` once the step has taken the lease (returned a
    fencing number)."""
    handoff = Handoff()

    def run() -> Any:
        result = step()
        with handoff.mutex:
            handoff.finished = True
            handoff.result = result
            give_back = handoff.cancelled
        if give_back:
            _give_back(req, result, release)
        return result

    try:
        return await sync_to_async(run)()
    except asyncio.CancelledError:
        with handoff.mutex:
            handoff.cancelled = True
            late = handoff.finished
        if late:  # the step finished but its result never reached us
            start_db_thread(
                functools.partial(_give_back, req, handoff.result, release),
                "django-dlock-give-back",
                alias=req.alias,
            )
        raise


def _give_back(req: Request, result: Any, release: Callable[[Request], bool]) -> None:
    if isinstance(result, int) and not isinstance(result, bool):
        try:
            release(req)
        except Exception:
            logger.exception(
                "django-dlock: could not give back %s after a cancelled acquire",
                req.key.name,
            )
