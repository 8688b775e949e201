"""Running a coroutine to its end without an event loop (the sync side of
every flow written once for sync and async callers): no database."""

from __future__ import annotations

import asyncio

import pytest

from django_dlock._unasync import blocking, run_to_end


def test_the_coroutines_result_is_returned():
    async def flow() -> int:
        step = blocking(lambda a, b: a + b)
        return await step(40, 2)

    assert run_to_end(flow()) == 42


def test_a_result_of_none_is_returned():
    async def flow() -> None:
        return None

    assert run_to_end(flow()) is None


def test_an_exception_of_the_flow_is_raised_as_it_is():
    async def flow() -> None:
        raise KeyError("the flow's own")

    with pytest.raises(KeyError, match="the flow's own"):
        run_to_end(flow())


def test_a_step_that_suspends_is_refused_and_the_flow_is_closed():
    closed = []

    async def flow() -> None:
        try:
            await asyncio.sleep(0)  # suspends: needs an event loop
        finally:
            closed.append(True)

    with pytest.raises(RuntimeError, match="suspended"):
        run_to_end(flow())
    assert closed == [True]
