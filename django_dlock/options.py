"""``Options``: what one call of a lock asks for, decided once and handed down.

:class:`~django_dlock.locks.Lock` is the front: it reads its arguments and
the settings they default to, resolves the database alias and the strategy,
and builds one immutable :class:`Options` per call (``acquire``, ``enqueue``,
``wait``). Everything below it (the acquiring walk, two-phase places,
holdings, metrics) takes that value and the holder; none of it imports
``Lock`` or calls back into it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import LockLost
from django_dlock.keys import Key
from django_dlock.strategies.base import Request, Strategy

if TYPE_CHECKING:
    from django_dlock.identity import Holder

__all__ = ["Options"]


class Options(NamedTuple):
    """One call's lock options, resolved: keys, database, strategy and policy.

    Immutable. A named tuple, not a frozen dataclass: one is built for every
    acquire, and a frozen dataclass's ``__init__`` costs about three times
    as much (it sets each field through ``object.__setattr__``).
    """

    #: the keys, in the order they are taken (sorted, no duplicates)
    keys: tuple[Key, ...]
    #: the database alias (a quorum's first alias)
    alias: str
    #: the strategy that acts on ``alias`` (a quorum's: on every database)
    strategy: Strategy
    #: its name as given to ``lock(strategy=...)``, for messages and metrics
    strategy_name: str
    #: the databases of a quorum lock, else ``None``
    quorum: tuple[str, ...] | None
    #: the lease length in seconds
    ttl: float
    #: with ``renew``: stop renewing this long after the grant
    max_hold: float | None
    #: renew the lease in the background
    renew: bool
    #: a holder that holds a key may acquire it again (counted)
    reentrant: bool
    #: a shared (read) lock
    shared: bool
    #: an upgradeable read lock (``shared`` too)
    upgradeable: bool
    #: on release, keep the lease until ``acquired_at + hold_at_least`` (TaskLock)
    hold_at_least: float
    #: the waiting policy when the database cannot wake waiters
    retry_interval: RetryInterval
    #: called once with the :class:`LockLost` when a holding is lost
    on_lost: Callable[[LockLost], None] | None
    #: the sender of the lock signals
    signal_sender: type
    #: whether its waiters take tickets in a queue of its own (``lease``)
    queues_waiters: bool

    @property
    def name(self) -> str:
        """The stored names of the keys, e.g. ``"lock:invoice:42"``."""
        return ", ".join(key.name for key in self.keys)

    @property
    def lease_ttl(self) -> float:
        """The lease length of one grant: ``ttl``, or ``max_hold`` when shorter."""
        return self.ttl if self.max_hold is None else min(self.ttl, self.max_hold)

    def request(self, holder: Holder, key: Key, alias: str | None = None) -> Request:
        """What the strategy needs to act for ``holder`` on ``key``."""
        return Request(
            key=key,
            alias=self.alias if alias is None else alias,
            token=holder.token(),
            owner=holder.owner(),
            ttl=self.ttl if self.max_hold is None else min(self.ttl, self.max_hold),
            shared=self.shared,
            upgradeable=self.upgradeable,
            hold_at_least=self.hold_at_least,
            row=key.name,
        )
