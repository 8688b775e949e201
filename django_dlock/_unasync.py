"""One flow for sync and async callers.

A flow that waits (acquire, retry, give back) is written once as a
coroutine that awaits its blocking steps. The async caller awaits it with
steps that run off the event loop; the sync caller passes steps that run at
once in its own thread (:func:`blocking`) and drives the coroutine with
:func:`run_to_end`, which needs no event loop because nothing suspends.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

__all__ = ["blocking", "run_to_end"]

P = ParamSpec("P")
T = TypeVar("T")


def run_to_end(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine whose every await completes at once, run
    without an event loop (in the calling thread)."""
    # Iterated, a coroutine that returns None ends without a StopIteration
    # (one exception per call saved): its result is handed out in a list.
    result: list[T] = []

    async def kept() -> None:
        result.append(await coro)

    runner = kept()
    for _ in runner.__await__():
        runner.close()
        raise RuntimeError("a blocking step suspended: it cannot run without an event loop")
    return result[0]


def blocking(func: Callable[P, T]) -> Callable[P, Awaitable[T]]:
    """``func`` as an awaitable step that runs at once in the calling thread."""

    async def step(*args: P.args, **kwargs: P.kwargs) -> T:
        return func(*args, **kwargs)

    return step
