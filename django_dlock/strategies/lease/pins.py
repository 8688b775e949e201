"""A lease row pinned by its holder's own open transaction.

``Lock.guard()`` share-locks the lease row in the caller's transaction
(:meth:`~django_dlock.strategies.lease.LeaseStrategy.pin`). Inside an outer
``transaction.atomic`` (a view under ``ATOMIC_REQUESTS``) that transaction
stays open after the guarded block, and the row stays locked until it ends.
A release or extend of that lease on any other session would wait for the
row, that is for the caller itself: they run in the caller's transaction
instead (:func:`pinned_by_caller`, :func:`in_caller_transaction`), and the
holder's background renewer, on a thread of its own, tries again later
(:class:`RowPinned`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.exceptions import DatabaseUnavailable
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import thread_connection

__all__ = [
    "PINNED",
    "CallerGone",
    "RowPinned",
    "in_caller_transaction",
    "pinned_by_caller",
    "remember_pin",
]


@dataclass(eq=False)
class _Pins:
    """The lease rows a connection's open transaction pinned (see
    :meth:`LeaseStrategy.pin`), and which transaction that is: the driver's
    connection and the transaction's outermost ``atomic`` block."""

    raw: Any
    outermost: Any
    rows: set[tuple[str, str]]
    connection: weakref.ref[BaseDatabaseWrapper]

    def current(self) -> bool:
        """Whether the transaction that pinned the rows is still open (read
        from any thread: a guess that can only be late)."""
        connection = self.connection()
        return (
            connection is not None
            and connection.in_atomic_block
            and self.raw is connection.connection
            and self.outermost is _outermost(connection)
        )


#: (alias, row, token) -> the pins of the open transaction that pinned that
#: lease row; an entry goes with its transaction's pins (replaced by the
#: next transaction's on the same connection)
PINNED: weakref.WeakValueDictionary[tuple[str, str, str], _Pins] = weakref.WeakValueDictionary()


class RowPinned(Exception):
    """The lease row is locked by its holder's own open transaction, on
    another thread's connection: a statement from here would wait for it."""


def _outermost(connection: BaseDatabaseWrapper) -> Any:
    blocks = connection.atomic_blocks
    return blocks[0] if blocks else None


def remember_pin(connection: BaseDatabaseWrapper, req: Request) -> None:
    """Note that ``connection``'s open transaction share-locks ``req``'s lease row."""
    raw, outermost = connection.connection, _outermost(connection)
    pins: _Pins | None = connection.__dict__.get("_dlock_pins")  # (kept on the wrapper)
    if pins is None or pins.raw is not raw or pins.outermost is not outermost:
        pins = _Pins(raw, outermost, set(), weakref.ref(connection))
        connection.__dict__["_dlock_pins"] = pins
    pins.rows.add((req.row, req.token))
    PINNED[(req.alias, req.row, req.token)] = pins


def pinned_by_caller(req: Request) -> BaseDatabaseWrapper | None:
    """The calling thread's connection when its open transaction pinned
    ``req``'s lease row (a guard inside the caller's ``atomic`` block).

    A release or extend on any other connection would wait for that row
    until the caller's transaction ends: for the caller itself. A
    transaction is told apart by its driver connection and its outermost
    ``atomic`` block; one that reuses both (a function decorated with
    ``atomic``, called again) may count as the same, and then a release
    waits for nothing but joins the caller's transaction all the same.
    """
    connection = thread_connection(req.alias)
    if not connection.in_atomic_block:  # (asked at every release: the cheap question first)
        return None
    pins: _Pins | None = connection.__dict__.get("_dlock_pins")
    if (
        pins is None
        or pins.raw is not connection.connection
        or pins.outermost is not _outermost(connection)
        or (req.row, req.token) not in pins.rows
    ):
        return None
    return connection


class CallerGone(Exception):
    """The caller's transaction ended with its session (and its pins with it)."""


def session_gone(connection: BaseDatabaseWrapper) -> bool:
    raw = connection.connection
    if raw is None:
        return True
    if connection.vendor == "mysql":  # (the driver may not have noticed yet: a ping)
        try:
            return not connection.is_usable()
        except Exception:
            return True
    return bool(getattr(raw, "closed", False))


@contextlib.contextmanager
def in_caller_transaction(caller: BaseDatabaseWrapper) -> Iterator[None]:
    """A savepoint of the caller's transaction that pinned a lease row;
    :class:`CallerGone` if that transaction ended with its session (a
    holder frozen past its idle bound, a server that ended it): the pin went
    with it, and the statement can run the usual way."""
    try:
        with transaction.atomic(using=caller.alias):
            yield
    except (DatabaseError, DatabaseUnavailable) as exc:
        if not session_gone(caller):
            raise
        caller.__dict__.pop("_dlock_pins", None)
        raise CallerGone from exc
