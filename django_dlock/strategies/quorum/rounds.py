"""One quorum round: the same operation on every database at once, and what they answered.

:func:`run_round` hands an operation to each database's workers and waits
until a majority has decided (accepted, or refused and failed so that no
majority can accept any more), or until the round's time is up. The
:class:`Round` it returns says which databases accepted (with their
answers), refused, failed (with the error) or stayed silent.

:func:`give_back` undoes what a round took: the leases already taken at
once, those still on their way when their answer arrives.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.strategies.quorum.workers import submit

__all__ = ["Round", "give_back", "give_back_when_done", "run_round"]

logger = logging.getLogger("django_dlock")

#: how a lease is given back on one database's connection
Release = Callable[[BaseDatabaseWrapper], Any]


@dataclasses.dataclass
class Round:
    """What each database answered in one round (``None``: no answer in time)."""

    futures: dict[str, concurrent.futures.Future[Any]]
    accepted: dict[str, Any] = dataclasses.field(default_factory=dict)
    refused: set[str] = dataclasses.field(default_factory=set)
    failed: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    #: the round's time ran out (the silent databases count as down)
    timed_out: bool = False

    @property
    def silent(self) -> set[str]:
        return set(self.futures) - set(self.accepted) - self.refused - set(self.failed)

    def unreachable(self) -> list[str]:
        return sorted(set(self.failed) | self.silent)

    def why(self) -> str:
        parts = [
            f"{alias}: {str(exc).strip() or type(exc).__name__}"
            for alias, exc in sorted(self.failed.items())
        ]
        parts += [f"{alias}: no answer in time" for alias in sorted(self.silent)]
        return "; ".join(parts)


def run_round(
    aliases: Sequence[str],
    ttl: float,
    end: float,
    op: Callable[[str], Callable[[BaseDatabaseWrapper], Any]],
    accepts: Callable[[Any], bool],
    need: int,
    wait_all: bool = False,
) -> Round:
    """Send ``op`` to every database at once; return when a majority has decided or at ``end``."""
    budget = max(0.0, end - time.monotonic())
    futures = {alias: submit(alias, ttl, budget, op(alias)) for alias in aliases}
    result = Round(futures)
    pending = set(futures.values())
    by_future = {future: alias for alias, future in futures.items()}
    while pending:
        done, pending = concurrent.futures.wait(
            pending,
            timeout=max(0.0, end - time.monotonic()),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        for future in done:
            alias = by_future[future]
            exc = future.exception()
            if exc is not None:
                result.failed[alias] = exc
            elif accepts(future.result()):
                result.accepted[alias] = future.result()
            else:
                result.refused.add(alias)
        decided = len(result.accepted) >= need or (
            len(result.refused) + len(result.failed) > len(aliases) - need
        )
        if decided and not wait_all:
            break
        if not done:  # the round's time is up
            result.timed_out = True
            break
    return result


def accepted(future: concurrent.futures.Future[Any]) -> bool:
    """Whether an acquire's answer took the lease (a fencing number came back)."""
    return not future.cancelled() and future.exception() is None and future.result() is not None


def give_back_when_done(
    alias: str, future: concurrent.futures.Future[Any], ttl: float, budget: float, release: Release
) -> None:
    """Give ``alias``'s lease back when its acquire answers, if it took it."""

    def done(answer: concurrent.futures.Future[Any]) -> None:
        if accepted(answer):
            submit(alias, ttl, budget, release)

    future.add_done_callback(done)


def give_back(
    futures: dict[str, concurrent.futures.Future[Any]], ttl: float, budget: float, release: Release
) -> None:
    """Give back what a round without a majority took: the leases already
    taken now (waiting up to ``budget`` seconds), the others on arrival."""
    taken = []
    for alias, future in futures.items():
        if not future.done():
            give_back_when_done(alias, future, ttl, budget, release)
        elif accepted(future):
            taken.append(alias)
    if not taken:
        return
    end = time.monotonic() + budget
    done = run_round(taken, ttl, end, lambda alias: release, bool, len(taken), wait_all=True)
    if done.failed or done.silent:
        logger.warning(
            "django-dlock: could not give back a lease of a round without a majority "
            "(%s); it runs out within %g s",
            done.why(),
            ttl,
        )
