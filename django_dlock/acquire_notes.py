"""What a strategy notes during one acquire, for the acquire's trace.

A waiter's tries and its place in a queue are known only inside the
strategy; the ``dlock.acquire`` span (:mod:`django_dlock.tracing`) reads them
when the acquire ends. While nobody traces, no record is open and each note
is one context-variable read.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Notes", "current", "queued", "tried"]


@dataclass
class Notes:
    """What one acquire noted."""

    #: the context the acquire was called in: the parent of its hold spans
    parent: Any
    attempts: int = 1
    queue_position: int | None = None
    fences: list[int] = field(default_factory=list)


#: the notes of the acquire running in this thread or task (``None``: not traced)
current: ContextVar[Notes | None] = ContextVar("django_dlock_acquire_notes", default=None)


def tried() -> None:
    """A waiter tried once more."""
    notes = current.get()
    if notes is not None:
        notes.attempts += 1


def queued(position: Callable[[], int]) -> None:
    """A waiter took its place in a queue; ``position()`` reads it (1: the head).
    Read only while traced: one query per waiter."""
    notes = current.get()
    if notes is not None and notes.queue_position is None:
        notes.queue_position = position()
