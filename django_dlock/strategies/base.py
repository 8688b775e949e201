"""The small protocol every strategy implements: :class:`Strategy`, its
:class:`Request` and :class:`Grant`.

The helpers strategies share live next to it: lock connections in
:mod:`django_dlock.strategies.connection`, the client-side statement
deadline for poolers in :mod:`django_dlock.strategies.connection`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol, TypeGuard, runtime_checkable

from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import RetryInterval
from django_dlock.keys import Key
from django_dlock.retry import Deadline

__all__ = [
    "HELD",
    "CountsPermits",
    "DrawsFences",
    "ExplainsBusy",
    "Grant",
    "Guards",
    "Request",
    "SharesApart",
    "Strategy",
    "TakesTickets",
    "Upgrades",
]

#: how a busy key is described when nothing more is known
HELD = "is held by someone else"


class Grant(NamedTuple):
    """A successful acquisition: the fencing number, if the strategy issues one.

    (A named tuple: one is made per acquire, and a frozen dataclass's
    ``__init__`` costs several times as much.)
    """

    fence: int | None
    #: monotonic time the statement that granted a lease was sent, when it
    #: was not the acquire's first (a waiter's last try, a quorum's last
    #: round): the lease is counted from it. ``None``: from the acquire's start.
    sent_at: float | None = None
    #: the fencing number is drawn when first read, not with the lock (``fence``
    #: is then ``None``): the strategy is a :class:`DrawsFences`
    later: bool = False


@dataclass(slots=True)
class Request:
    """What a strategy needs to act for one holder on one key."""

    key: Key
    alias: str
    token: str
    owner: str
    ttl: float
    shared: bool = False
    #: an upgradeable read lock (see :class:`Upgrades`)
    upgradeable: bool = False
    #: on release, keep the lease until ``acquired_at + hold_at_least`` seconds
    #: (database time): :class:`~django_dlock.TaskLock`'s ``min_hold``. Only
    #: leased strategies honour it.
    hold_at_least: float = 0.0
    #: the name of the lease row the holding occupies: the key's name for a
    #: lock; for a semaphore, the row of the permit it was granted (set by
    #: the strategy with the grant)
    row: str = field(kw_only=True)
    #: the lease rows whose ``queued`` flag tells that somebody may wait in
    #: the key's queue, when they are not the key's own row: a semaphore's
    #: permits (set by the strategy before it takes a ticket)
    queue_rows: tuple[str, ...] = field(default=(), kw_only=True)


@runtime_checkable
class ExplainsBusy(Protocol):
    """A strategy that can say in words why a key is busy (for the log line of a
    timed-out acquire): held by someone, or free but kept for queued waiters."""

    def busy_reason(self, alias: str, key: Key) -> str: ...


@runtime_checkable
class Guards(Protocol):
    """A strategy whose holding can be checked, and kept, inside a transaction
    on its database (``Lock.guard()``): ``lease``."""

    def pin(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        """In ``connection``'s open transaction (on ``req.alias``): ``True`` if
        ``req``'s holding is still the caller's on the database clock, and
        nobody can take it over until that transaction ends; ``False`` if
        it is lost."""
        ...

    def pin_query(self, connection: BaseDatabaseWrapper, req: Request) -> tuple[str, list[str]]:
        """:meth:`pin` as one ``SELECT`` (PostgreSQL, MySQL/MariaDB) and its
        parameters: a row while ``req``'s holding is the caller's, locked
        against a take-over until the transaction ends; no row if lost."""
        ...


_GUARDS: dict[type, bool] = {}


def guards(strategy: object) -> TypeGuard[Guards]:
    """Whether ``strategy`` implements :class:`Guards` (answered once per class:
    a runtime protocol check is slow enough to show in a guarded write)."""
    kind = type(strategy)
    found = _GUARDS.get(kind)
    if found is None:
        found = _GUARDS[kind] = isinstance(strategy, Guards)
    return found


@runtime_checkable
class TakesTickets(Protocol):
    """A strategy with a waiter queue of its own (``lease``): a caller takes a
    ticket (:meth:`enqueue`, what ``Lock.enqueue()`` keeps), and a waiter
    with a ticket is served in ticket order (:meth:`wait_ticket`)."""

    def enqueue(self, req: Request) -> int: ...

    async def aenqueue(self, req: Request) -> int: ...

    def wait_ticket(
        self, req: Request, ticket: int, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None: ...

    async def await_ticket(
        self, req: Request, ticket: int, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None: ...


@runtime_checkable
class DrawsFences(Protocol):
    """A strategy whose fencing number costs nothing until it is read: its
    grants say ``later``, and the holding asks :meth:`draw_fence` the first
    time its number is read (``row`` and ``advisory_xact`` on PostgreSQL)."""

    def draw_fence(self, req: Request) -> int | None:
        """A number above every earlier holder's, that no crash of the server
        can issue again, drawn now, from the holder's thread, while ``req`` is
        held; ``None`` if the database no longer holds it (no number is given)."""
        ...


@runtime_checkable
class CountsPermits(Protocol):
    """A strategy that can let several holders hold one key, up to a count
    (a semaphore's permits): ``lease``, where each permit is a lease row.

    ``permits_by`` names, as ``"module:function"``, the function that gives
    the strategy handing out ``permits`` holdings of a key at once
    (``function(permits) -> Strategy``); it is imported on first use, like
    the strategies of the registry.
    """

    permits_by: str


@runtime_checkable
class SharesApart(Protocol):
    """A strategy whose shared holdings (``shared=True``: many readers or one
    writer) are kept by another strategy object: ``lease``, where each reader
    holds a row of its own and the key's row says that readers hold it.

    ``shared_by`` names, as ``"module:attribute"``, that strategy; it is
    imported on first use, like the strategies of the registry. A strategy
    that ``shares`` without it grants shared holdings itself (PostgreSQL's
    advisory locks).
    """

    shared_by: str


@runtime_checkable
class Upgrades(Protocol):
    """A strategy whose upgradeable read holdings (``upgradeable=True``) can
    become the write holding of their key with no writer in between: the
    ``lease`` strategy's shared form."""

    def upgrade(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> int | Literal[False] | None:
        """Wait until ``req`` is the key's only reader, then hold the key
        exclusively: the new fencing number; ``None`` if other readers still
        held it at ``deadline``; ``False`` if ``req``'s read holding is lost."""
        ...


class Strategy(Protocol):
    """One way of holding a lock. All methods are synchronous and blocking."""

    #: name used by ``lock(strategy=...)``
    name: str
    #: holdings of strategies with the same family are the same lock for
    #: re-entrancy (a holder that holds "x" by ``lease`` re-enters "x" by lease)
    family: str
    #: held until the caller's transaction ends (``row``, ``advisory_xact``):
    #: needs ``transaction.atomic``, and cannot be released early
    transaction_scoped: bool
    #: a holding runs out on its own ``ttl`` after the statement that set it
    #: (``lease``, its quorum): the holder counts its lease from when it sent it
    leased: bool
    #: grants ``shared=True`` holdings beside each other (many readers or one
    #: writer): ``lease`` (see :class:`SharesApart`), PostgreSQL's ``advisory``
    #: and ``advisory_xact``
    shares: bool

    def ended(self, req: Request) -> bool:
        """Whether the database has dropped the lock on its own (no query).

        True once the transaction of a transaction-scoped holding has ended;
        always False for the other strategies.
        """

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        """Raise :class:`StrategyNotSupported` if ``connection`` cannot do it."""

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        """Acquire, waiting until ``deadline``; ``None`` when it passed."""

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Async :meth:`acquire`: must not block the event loop while waiting."""

    def try_acquire(self, req: Request) -> int | None:
        """One attempt: the fencing number if acquired, else ``None``."""

    def release(self, req: Request) -> bool:
        """Release; ``False`` if the database says the caller no longer holds it."""

    def extend(self, req: Request, ttl: float) -> bool:
        """Renew the lease; ``False`` if the caller no longer holds it."""

    def locked(self, alias: str, key: Key) -> bool:
        """Whether anyone holds ``key`` now."""

    def owned(self, req: Request) -> bool:
        """Whether the caller holds ``key`` now, according to the database."""

    def loss_reason(self, req: Request) -> str | None:
        """Why the caller no longer holds ``key``, if the strategy can tell (may query).

        ``None`` when it has nothing to add to what the caller saw.
        """
