"""``Semaphore`` / ``semaphore()``: at most N holders of a key at a time.

A semaphore is a lock that ``permits`` callers may hold at once::

    with dlock.semaphore("exports", permits=3, timeout=30):
        export()                 # never more than 3 exports at a time, anywhere

It is the same object as a :class:`~django_dlock.Lock` (context manager,
async context manager, decorator, ``acquire``/``release``, ``extend``,
``renew``, ``owned()``, ``on_lost``, ``guard()``, ``enqueue``/``wait``),
in its own namespace (``semaphore:exports``), and every permit is a lease
of its own on the database clock: a holder that dies frees its permit
when its lease runs out. Waiters are served in arrival order; a newcomer
never takes a permit a waiter is queued for.

Only the ``lease`` strategy counts permits. The others are refused with
:class:`~django_dlock.SemaphoreNotSupported`: a PostgreSQL advisory lock
waits on one key, so a waiter queued on one permit would sleep while
another is free; a quorum of databases could agree on each permit but not
on one count of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from django_dlock.conf import UNSET, RetryInterval
from django_dlock.exceptions import LockLost, SemaphoreNotSupported
from django_dlock.keys import LockKey
from django_dlock.locks import Lock, OnFail
from django_dlock.strategies import counts_permits, no_permits, supported, with_permits
from django_dlock.strategies.base import Strategy
from django_dlock.validation import permits_error, strategy_error, validated

__all__ = ["Semaphore", "semaphore", "semaphore_error"]

F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING:
    from typing_extensions import TypeVar as _TypeVarWithDefault

    _OnFailT = _TypeVarWithDefault("_OnFailT", bound=OnFail, covariant=True, default=OnFail)
else:
    _OnFailT = TypeVar("_OnFailT", bound=OnFail, covariant=True)


def semaphore_error(*, strategy: object, using: object) -> SemaphoreNotSupported | None:
    """The error for a semaphore asked with these explicit options, or ``None``:
    a quorum (``using=[...]``), or a strategy that cannot count permits. Reads
    no setting (an unknown strategy is left to the lock's own check)."""
    if using is not None and not isinstance(using, str):
        return SemaphoreNotSupported(
            "a semaphore cannot be a quorum lock (using=[...]): a majority of "
            "databases can agree on each permit, but not on how many are held"
        )
    known = isinstance(strategy, str) and strategy_error(strategy) is None
    if known and not counts_permits(str(strategy)):
        return no_permits(str(strategy))
    return None


class Semaphore(Lock[_OnFailT]):
    """A lock that up to ``permits`` holders hold at once (see :class:`~django_dlock.Lock`
    for every other argument).

    Args:
        key: a string, a two-part tuple or a saved model instance (stored
            as ``semaphore:<key>``); omitted when decorating.
        permits: how many holders at most (1 to 1000). The count is the
            caller's: callers that disagree each respect their own (see the
            Semaphores page).

    A holder (thread or task) holds at most one permit of a semaphore:
    acquiring it again re-enters the permit it holds. ``fence`` is the
    fencing number of that permit's lease. :meth:`locked` is true when
    every permit is held (an acquire would wait).

    Raises:
        ValueError: ``permits`` is not a whole number from 1 to 1000, or
            another argument is out of range.
        SemaphoreNotSupported: the strategy is not ``lease``, or ``using``
            names several databases (a quorum).
    """

    namespace = "semaphore"

    @overload
    def __init__(
        self: Semaphore[Literal["raise"]],
        key: LockKey | None = None,
        *,
        permits: int,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: Literal["raise"] = "raise",
    ) -> None: ...

    @overload
    def __init__(
        self: Semaphore[Literal["skip"]],
        key: LockKey | None = None,
        *,
        permits: int,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: Literal["skip"],
    ) -> None: ...

    def __init__(
        self,
        key: LockKey | None = None,
        *,
        permits: int,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: str = "raise",
    ) -> None:
        validated(permits_error(permits))
        self.permits = permits
        refused = semaphore_error(strategy=strategy, using=using)
        if refused is not None:
            raise refused
        # Lock's overloads type on_fail by the instance's type parameter
        cast(Any, Lock).__init__(
            self,
            key,
            strategy=strategy,
            ttl=ttl,
            timeout=timeout,
            using=using,
            renew=renew,
            max_hold=max_hold,
            reentrant=reentrant,
            retry_interval=retry_interval,
            on_lost=on_lost,
            on_fail=on_fail,
        )

    def _strategy(self, alias: str) -> Strategy:
        return with_permits(supported(self.strategy_name, alias), self.permits)

    def __repr__(self) -> str:
        keys = "<decorator>" if self._keys is None else self.name
        return f"<Semaphore {keys} permits={self.permits}>"


@overload
def semaphore(
    key: LockKey | None = None,
    *,
    permits: int,
    strategy: str | None = None,
    ttl: float | None = None,
    timeout: float | None = UNSET,
    using: str | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    reentrant: bool = True,
    retry_interval: RetryInterval | None = None,
    on_lost: Callable[[LockLost], None] | None = None,
    on_fail: Literal["raise"] = "raise",
) -> Semaphore[Literal["raise"]]: ...


@overload
def semaphore(
    key: LockKey | None = None,
    *,
    permits: int,
    strategy: str | None = None,
    ttl: float | None = None,
    timeout: float | None = UNSET,
    using: str | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    reentrant: bool = True,
    retry_interval: RetryInterval | None = None,
    on_lost: Callable[[LockLost], None] | None = None,
    on_fail: Literal["skip"],
) -> Semaphore[Literal["skip"]]: ...


def semaphore(key: LockKey | None = None, **options: Any) -> Semaphore[Any]:
    """Create a :class:`Semaphore` (see its arguments): ``permits`` is required."""
    return Semaphore(key, **options)


Semaphore.signal_sender = Semaphore
