"""``Lock`` / ``lock()``: the one front object of django-dlock.

One object serves as context manager (sync and async), decorator and
explicit API::

    with dlock.lock("invoice:42", timeout=5, ttl=30): ...
    async with dlock.lock("sync-catalog"): ...

    @dlock.lock(timeout=0, on_fail="skip")      # key: "module.qualname"
    def nightly_report(): ...

    lk = dlock.lock(("order", 42))
    if lk.acquire(timeout=0):
        try: ...
        finally: lk.release()

A ``Lock`` object holds no lock state of its own: what is held belongs to the
*holder* that acquired it (the current thread, or the current asyncio task;
see :mod:`django_dlock.identity`). One ``Lock`` object can therefore be shared
freely, for instance as a decorator called from many threads, and its
properties (``fence``, ``lost``, ``token``) answer for the calling holder.

This module is the API; the work is done below it: :mod:`django_dlock.holdings`
(what a holder holds: re-entry, renewal, loss, release),
:mod:`django_dlock.acquiring` (taking keys in order, all or none, sync or
async) and :mod:`django_dlock.two_phase` (``enqueue`` / ``wait``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from asyncio import _get_running_loop
from collections.abc import Awaitable, Callable, Coroutine
from contextvars import ContextVar
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    ParamSpec,
    TypedDict,
    TypeVar,
    overload,
)

from asgiref.sync import sync_to_async
from django.db import DatabaseError, connections

from django_dlock import holdings, metrics, signals, tracing, two_phase
from django_dlock._threads import to_the_end
from django_dlock.acquiring import Attempt
from django_dlock.conf import UNSET, FromSetting, RetryInterval, checked, conf, lock_alias
from django_dlock.exceptions import (
    DatabaseUnavailable,
    DLockError,
    GuardNotSupported,
    InvalidLockKey,
    LockLost,
    LockNotOwned,
    LockTimeout,
    StrategyNotSupported,
    SyncInAsyncContext,
)
from django_dlock.guard import guarded
from django_dlock.holdings import Holding
from django_dlock.identity import Holder, current_holder
from django_dlock.keys import Key, LockKey, make_key
from django_dlock.options import Options
from django_dlock.retry import Deadline
from django_dlock.strategies import for_shared, supported, traits
from django_dlock.strategies.base import HELD, ExplainsBusy, Request, Strategy, Upgrades
from django_dlock.strategies.connection import statement_deadline
from django_dlock.validation import (
    alias_error,
    retry_interval_error,
    seconds_or_none,
    strategy_error,
    timeout_error,
    ttl_error,
    validated,
)

__all__ = ["Lock", "LockOptions", "OnFail", "lock"]

logger = logging.getLogger("django_dlock")

F = TypeVar("F", bound=Callable[..., Any])
P = ParamSpec("P")
R = TypeVar("R")

#: what a lock used as a decorator does when its key stays held: raise
#: :class:`LockTimeout`, or skip the call (it returns ``None``)
OnFail = Literal["raise", "skip"]


class LockOptions(TypedDict, total=False):
    """The options of :class:`Lock` but ``using`` and ``on_fail``, for ``**options``.

    For a function that passes its keyword arguments on to :func:`lock`,
    annotated ``**options: Unpack[LockOptions]`` (``Unpack`` from
    ``typing``, or ``typing_extensions`` before Python 3.11), so that a type
    checker still reports an unknown option.
    """

    strategy: str | None
    ttl: float | None
    timeout: float | None
    renew: bool
    max_hold: float | None
    reentrant: bool
    retry_interval: RetryInterval | None
    on_lost: Callable[[LockLost], None] | None
    shared: bool
    upgradeable: bool


if TYPE_CHECKING:
    # A default (PEP 696): a plain ``Lock`` annotation means a lock of either kind.
    from typing_extensions import TypeVar as _TypeVarWithDefault

    _OnFailT = _TypeVarWithDefault("_OnFailT", bound=OnFail, covariant=True, default=OnFail)
else:
    _OnFailT = TypeVar("_OnFailT", bound=OnFail, covariant=True)


def _quorum_of(using: object, strategy: str | None) -> tuple[str, ...]:
    """The aliases of a quorum lock (``using=[...]``), checked."""
    from django_dlock.strategies.quorum import quorum_aliases, quorum_strategy

    aliases = quorum_aliases(using)
    if strategy is not None:
        quorum_strategy(strategy, aliases)  # only the lease strategy can
    return aliases


#: set while a ``with`` block or a decorated function is being left
_LEAVING: ContextVar[bool] = ContextVar("django_dlock_leaving", default=False)
#: why the last acquire of this thread or task found its key busy (log wording)
_WHY_BUSY: ContextVar[str] = ContextVar("django_dlock_why_busy", default=HELD)


def _observed(opts: Options, deadline: Deadline, attempt: Callable[[], bool]) -> bool:
    """Run ``attempt`` (one acquire) inside its span (tracing) and its metrics."""
    if tracing.tracer is not None:
        attempt = functools.partial(tracing.tracer.acquire, opts, deadline, attempt)
    if metrics.observer is not None:
        observe = metrics.observer.acquire
        return observe(opts.strategy_name, opts.queues_waiters, deadline, attempt)
    return attempt()


async def _aobserved(
    opts: Options, deadline: Deadline, attempt: Callable[[], Awaitable[bool]]
) -> bool:
    """Async :func:`_observed`."""
    if tracing.tracer is not None:
        attempt = functools.partial(tracing.tracer.aacquire, opts, deadline, attempt)
    if metrics.observer is not None:
        observe = metrics.observer.aacquire
        return await observe(opts.strategy_name, opts.queues_waiters, deadline, attempt)
    return await attempt()


def _refuse_in_event_loop(lock: Lock, call: str, instead: str) -> None:
    """Raise :class:`SyncInAsyncContext` if this thread runs an event loop.

    Django refuses synchronous database access there, with a bare
    ``SynchronousOnlyOperation`` raised deep in the lock's first query;
    this says which async call to use instead, before anything runs. Like
    Django, it allows the call when ``DJANGO_ALLOW_ASYNC_UNSAFE`` is set.
    (``held()`` and ``owned()`` need no check: they query off the loop.)
    ``asyncio._get_running_loop()`` (``None`` outside a loop) costs about
    0.1 µs; ``get_running_loop()`` raises there and costs several times more.
    """
    if _get_running_loop() is None or os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE"):
        return
    raise SyncInAsyncContext(
        f"{call} of {lock!r} was called from async code (an event loop runs in this "
        "thread), where Django refuses synchronous database access and a waiting lock "
        f"would block every task of the loop: use {instead} (for a block, "
        "`async with dlock.lock(...)`), or run the synchronous code with "
        "`asgiref.sync.sync_to_async`"
    )


def why_busy() -> str:
    """How the last failed acquire of this thread or task saw its key, for a log line.

    ``"is held by someone else"``, or on ``lease`` ``"is free, but other
    waiters are queued ahead"`` when only their tickets kept the caller out.
    """
    return _WHY_BUSY.get()


class Lock(Generic[_OnFailT]):
    """A distributed lock on one key, or on several keys at once.

    Args:
        key: a string, a two-part tuple ``(a, b)``, a saved model instance, or
            a *list* of those to lock all of them (acquired in sorted order,
            all or none). Omit it when decorating: the key is then the
            function's ``module.qualname``.
        strategy: ``"lease"`` (default: ``DLOCK_DEFAULT_STRATEGY``),
            ``"row"``, ``"advisory"`` or ``"advisory_xact"``.
        ttl: lease length in seconds (``DLOCK_DEFAULT_TTL``).
        timeout: how long ``acquire``/``with`` waits: ``None`` forever,
            ``0`` one try, ``n`` up to n seconds (``DLOCK_DEFAULT_TIMEOUT``);
            more than 10**9 seconds (about 31 years, ``float("inf")``
            included) waits forever too.
        using: database alias (default: the router's write database for
            :class:`django_dlock.models.Lock`), or a list of aliases of
            independent databases for a quorum lock: a lease on a majority
            of them (``lease`` strategy only; see the Quorum locks page).
        renew: renew the lease in the background at about ``ttl / 3``.
        max_hold: with ``renew``, stop renewing this many seconds after
            the acquisition; the lease then runs out.
        reentrant: if false, acquiring a key the caller already holds
            raises :class:`LockReentrantError` instead of counting.
        retry_interval: waiting policy when the database cannot wake
            waiters: seconds (jittered) or a function of the attempt number.
        on_lost: called once with a :class:`LockLost` when the lock is lost
            (from the renewal thread, or from the call that found the loss).
        on_fail: for the decorator: ``"raise"`` (:class:`LockTimeout`) or
            ``"skip"`` (return ``None`` without calling the function; logged
            at INFO). A ``with`` block refuses ``"skip"`` (``ValueError``).
        shared: take a shared (read) lock: many shared holders at once, or
            one exclusive. The ``lease`` strategy has them (first come, first
            served with writers), and ``advisory`` and ``advisory_xact`` on
            PostgreSQL; the others refuse ``shared=True`` with
            :class:`StrategyNotSupported`.
        upgradeable: take an upgradeable read lock (``lease`` only; implies
            ``shared``): at most one holder at a time holds the key
            upgradeable, beside the readers, and :meth:`upgrade` turns it
            into the write lock once the other readers have left, with no
            writer in between.

    Arguments given are checked at once. Values that come from settings
    (``DLOCK_DEFAULT_*``, ``DLOCK_RETRY_INTERVAL``) are read when the lock is
    used, so that a module declaring locks always imports; a bad setting then
    raises the same named error before any SQL (and the system checks report
    it at startup).

    Raises:
        InvalidLockKey: the key is not a valid key.
        ValueError: ``ttl``, ``timeout``, ``max_hold`` or another argument
            is out of range.
        StrategyNotSupported: the strategy is unknown.
    """

    namespace = "lock"
    signal_sender: type[Lock]
    #: on release, keep the lease until ``acquired_at + _hold_at_least``
    #: seconds (a :class:`~django_dlock.TaskLock`'s ``min_hold``)
    _hold_at_least = 0.0

    # The type records ``on_fail``: the decorator's calls may return None
    # only when it is "skip".
    @overload
    def __init__(
        self: Lock[Literal["raise"]],
        key: LockKey | None = None,
        *,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | list[str] | tuple[str, ...] | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: Literal["raise"] = "raise",
        shared: bool = False,
        upgradeable: bool = False,
    ) -> None: ...

    @overload
    def __init__(
        self: Lock[Literal["skip"]],
        key: LockKey | None = None,
        *,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | list[str] | tuple[str, ...] | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: Literal["skip"],
        shared: bool = False,
        upgradeable: bool = False,
    ) -> None: ...

    def __init__(
        self,
        key: LockKey | None = None,
        *,
        strategy: str | None = None,
        ttl: float | None = None,
        timeout: float | None = UNSET,
        using: str | list[str] | tuple[str, ...] | None = None,
        renew: bool = False,
        max_hold: float | None = None,
        reentrant: bool = True,
        retry_interval: RetryInterval | None = None,
        on_lost: Callable[[LockLost], None] | None = None,
        on_fail: str = "raise",
        shared: bool = False,
        upgradeable: bool = False,
    ) -> None:
        self._raw_key = key
        self._keys: list[Key] | None = None if key is None else self._make_keys(key)
        # Explicit arguments are checked now; values that come from settings
        # are read and checked when the lock is used, so that importing code
        # that declares locks never fails on a setting (the system checks
        # report bad settings).
        if strategy is not None:
            problem = strategy_error(strategy)
            if problem is not None:
                raise StrategyNotSupported(problem)
        self._strategy_name_arg = strategy
        # (each check inline: a lock is made per call, and a call costs)
        if ttl is not None and (problem := ttl_error(ttl)) is not None:
            raise ValueError(problem)
        self._ttl_arg = None if ttl is None else float(ttl)
        if timeout is not UNSET and (problem := timeout_error(timeout)) is not None:
            raise ValueError(problem)
        self._timeout_arg = timeout
        if retry_interval is not None:
            validated(retry_interval_error(retry_interval))
        self._retry_interval_arg = retry_interval
        self.max_hold = (
            None if max_hold is None else seconds_or_none(max_hold, "max_hold", allow_zero=False)
        )
        if on_fail not in ("raise", "skip"):
            raise ValueError(f'on_fail must be "raise" or "skip", got {on_fail!r}')
        #: the databases of a quorum lock (``using=[...]``), else None
        self.using: str | None
        if using is None or isinstance(using, str):
            self._quorum = None
            self.using = using
        else:
            self._quorum = _quorum_of(using, strategy)
            self.using = self._quorum[0]
        if self.using is not None:
            validated(alias_error(self.using))
        self.renew = bool(renew)
        self.reentrant = bool(reentrant)
        self.on_lost = on_lost
        self.on_fail = on_fail
        self.upgradeable = bool(upgradeable)
        self.shared = bool(shared) or self.upgradeable
        #: places taken by :meth:`enqueue`, not yet waited for (made by the first)
        self._places: two_phase.Places | None = None

    # -- options that default to settings (read and checked at use) ---------

    strategy_name = FromSetting[str]("DLOCK_DEFAULT_STRATEGY")
    """The strategy's name (``DLOCK_DEFAULT_STRATEGY`` unless given)."""
    timeout = FromSetting[float | None]("DLOCK_DEFAULT_TIMEOUT", unset=UNSET)
    """How long to wait (``DLOCK_DEFAULT_TIMEOUT`` unless given)."""
    retry_interval = FromSetting[RetryInterval]("DLOCK_RETRY_INTERVAL")
    """The waiting policy (``DLOCK_RETRY_INTERVAL`` unless given)."""

    @property
    def ttl(self) -> float:
        """The lease length in seconds (``DLOCK_DEFAULT_TTL`` unless given)."""
        value: float = checked("DLOCK_DEFAULT_TTL") if self._ttl_arg is None else self._ttl_arg
        return value

    def _options(self) -> Options:
        """This call's options: every one that comes from settings read and
        checked (before any SQL), the database and the strategy resolved."""
        alias = self.using if self.using is not None else lock_alias()
        name = self.strategy_name
        strategy = self._strategy(alias)  # (a semaphore's: with its permits)
        if self.shared:
            if self._quorum is not None:
                raise StrategyNotSupported(
                    f"a quorum lock (using={list(self._quorum)!r}: a lease on a majority of "
                    "those databases) has no shared locks: shared=True needs one database "
                    "(the lease strategy, or advisory or advisory_xact on PostgreSQL); take "
                    "the quorum lock exclusively instead"
                )
            if not strategy.shares:
                raise StrategyNotSupported(
                    f"the {self.strategy_name} strategy on {alias!r} has no shared locks: "
                    "shared=True needs the lease strategy (one database), or advisory or "
                    "advisory_xact on PostgreSQL (many readers or one writer); take the "
                    "lock exclusively instead"
                )
            strategy = for_shared(strategy)
            if self.upgradeable and not isinstance(strategy, Upgrades):
                raise StrategyNotSupported(
                    f"the {self.strategy_name} strategy on {alias!r} has no upgradeable "
                    "read locks: upgradeable=True needs the lease strategy (one database)"
                )
        return Options(
            keys=tuple(self._keys if self._keys is not None else self.keys),  # (.keys: no key)
            alias=alias,
            strategy=strategy,
            strategy_name=name,
            quorum=self._quorum,
            ttl=self.ttl,
            max_hold=self.max_hold,
            renew=self.renew,
            reentrant=self.reentrant,
            shared=self.shared,
            upgradeable=self.upgradeable,
            hold_at_least=self._hold_at_least,
            retry_interval=self.retry_interval,
            on_lost=self.on_lost,
            signal_sender=self.signal_sender,
            queues_waiters=self._quorum is None and traits(name)[2],
        )

    # -- keys ----------------------------------------------------------------

    def _make_keys(self, key: LockKey) -> list[Key]:
        if isinstance(key, (list, set, frozenset)):
            if not key:
                raise InvalidLockKey("a list of keys must not be empty")
            keys = {made.name: made for made in (make_key(k, self.namespace) for k in key)}
            return [keys[name] for name in sorted(keys)]
        return [make_key(key, self.namespace)]

    @property
    def keys(self) -> list[Key]:
        if self._keys is None:
            raise InvalidLockKey(
                "this lock has no key; give one, or use it as a decorator "
                "(the key is then the function's module.qualname)"
            )
        return self._keys

    @property
    def name(self) -> str:
        """The stored (namespaced) name, e.g. ``"lock:invoice:42"``."""
        return ", ".join(key.name for key in self.keys)

    @property
    def alias(self) -> str:
        if self.using is not None:
            return self.using
        return lock_alias()

    def _strategy(self, alias: str) -> Strategy:
        if self._quorum is not None:
            strategy = self._quorum_strategy(self._quorum)
            strategy.check_supported(connections[alias])
            return strategy
        return supported(self.strategy_name, alias)

    def _quorum_strategy(self, aliases: tuple[str, ...]) -> Strategy:
        """The strategy's quorum over the databases of ``using=[...]``."""
        from django_dlock.strategies.quorum import quorum_strategy

        return quorum_strategy(self.strategy_name, aliases)

    # -- the calling holder's view -----------------------------------------

    def _holdings(self, holder: Holder | None = None) -> list[Holding]:
        holder = holder or current_holder()
        alias = self.using if self.using is not None else lock_alias()
        if self._quorum is not None:
            family = self._quorum_strategy(self._quorum).family
        else:
            family = traits(self.strategy_name)[0]
        found = []
        for key in self._keys if self._keys is not None else self.keys:  # (.keys: no key)
            holding = holdings.current(holder, (alias, family, key.name))
            if holding is not None:
                found.append(holding)
        return found

    @property
    def token(self) -> str:
        """The calling thread's or task's token (what the database stores)."""
        return current_holder().token()

    @property
    def fence(self) -> int | None:
        """Fencing number of the calling holder's holding (``None`` if not held).

        For a lock on several keys use :attr:`fences`. ``row`` and
        ``advisory_xact`` on PostgreSQL draw it now, the first time it is
        read (once per holding): a lock whose number is never read costs no
        statement for it.

        Raises:
            LockLost: its number was not drawn yet, and the lock is no longer
                held (its transaction is gone): no number is given.
            DatabaseUnavailable: the number could not be drawn.
        """
        if len(self.keys) != 1:
            raise DLockError("this lock has several keys: use .fences")
        held = self._holdings()
        return held[0].fence if held else None

    @property
    def fences(self) -> dict[str, int | None]:
        """Fencing number per key name of the calling holder's holdings (drawn
        as :attr:`fence` draws it)."""
        return {h.name: h.fence for h in self._holdings()}

    @property
    def lost(self) -> bool:
        """True when a lock the caller holds has been lost (not yet released)."""
        return any(h.lost for h in self._holdings())

    def held(self) -> bool:
        """Whether the calling holder holds every key.

        Answered in memory, without a query, while the lease surely runs
        (the lock was acquired or extended less than ``ttl`` seconds ago).
        Past that point only the database knows: one query, and a lease
        that has run out or was taken over is reported lost and not held.
        A lost lock is never reported as held.
        """
        return self._held_by(current_holder(), off_loop=True)

    async def aheld(self) -> bool:
        """Async :meth:`held`, for the calling task."""
        holder = current_holder()
        return bool(await sync_to_async(self._held_by)(holder, off_loop=False))

    def _held_by(self, holder: Holder, off_loop: bool) -> bool:
        held = self._holdings(holder)
        if len(held) != len(self.keys):
            return False
        for holding in held:
            if not holding.lost and holding.may_have_expired():
                holdings.confirm(holding, off_loop=off_loop)
        return not any(h.lost for h in held)

    # -- acquire ---------------------------------------------------------------

    def _resolve_timeout(self, blocking: bool, timeout: float | None) -> float | None:
        if not blocking:
            return 0.0
        if timeout is UNSET:
            return self.timeout
        validated(timeout_error(timeout))
        return timeout

    def acquire(self, blocking: bool = True, timeout: float | None = UNSET) -> bool:
        """Acquire the lock; ``True`` if acquired, ``False`` on timeout.

        ``timeout`` overrides the lock's timeout for this call (``None``
        waits forever, ``0`` tries once); ``blocking=False`` is ``timeout=0``.
        Acquiring a lock the caller already holds counts one more level
        (re-entry); if that holding was lost meanwhile, the loss is reported
        (``lock_lost``, ``on_lost``) and the call contends like any other.
        After :meth:`enqueue` took a place, it waits for that place, as
        :meth:`wait` does (``False``: the place is given up).

        Raises:
            DatabaseUnavailable: the database could not be reached, and
                with a timeout still not when it ended (until then the call
                keeps trying to reconnect); the lock is not acquired (see
                "When the database cannot be reached" in the strategies
                documentation for what may be left).
        """
        if _get_running_loop() is not None:
            _refuse_in_event_loop(self, "acquire() (or a `with` block)", "`await lk.aacquire()`")
        if blocking and timeout is UNSET:
            deadline = Deadline(self.timeout)
        else:
            deadline = Deadline(self._resolve_timeout(blocking, timeout))
        opts = self._options()
        if metrics.observer is None and tracing.tracer is None:
            return self._acquire(opts, deadline)
        return _observed(opts, deadline, functools.partial(self._acquire, opts, deadline))

    def _acquire(self, opts: Options, deadline: Deadline) -> bool:
        holder = current_holder()
        queued = self._take_place(holder)
        if queued is not None:  # enqueue() took a place: acquiring waits for it
            acquired = two_phase.wait(queued, holder, deadline)
            if not acquired:
                _WHY_BUSY.set(HELD)
                self._contended(queued.req.key, deadline, opts.strategy_name)
            return acquired
        busy = Attempt(opts, holder, deadline).run(opts.keys)
        if busy is not None:
            _WHY_BUSY.set(self._busy_reason(opts.strategy, busy))
            self._contended(busy.key, deadline, opts.strategy_name)
        return busy is None

    async def aacquire(self, blocking: bool = True, timeout: float | None = UNSET) -> bool:
        """Async :meth:`acquire`: waits without blocking the event loop.

        Cancelling the task while it waits leaves no lock behind.
        """
        deadline = Deadline(self._resolve_timeout(blocking, timeout))
        opts = self._options()
        if metrics.observer is None and tracing.tracer is None:
            return await self._aacquire(opts, deadline)
        attempt = functools.partial(self._aacquire, opts, deadline)
        return await _aobserved(opts, deadline, attempt)

    async def _aacquire(self, opts: Options, deadline: Deadline) -> bool:
        holder = current_holder()
        queued = self._take_place(holder)
        if queued is not None:  # aenqueue() took a place: acquiring waits for it
            acquired = await two_phase.await_lock(queued, holder, deadline)
            if not acquired:
                _WHY_BUSY.set(HELD)
                self._contended(queued.req.key, deadline, opts.strategy_name)
            return acquired
        busy = await Attempt(opts, holder, deadline).arun(opts.keys)
        if busy is not None:
            _WHY_BUSY.set(await sync_to_async(self._busy_reason)(opts.strategy, busy))
            self._contended(busy.key, deadline, opts.strategy_name)
        return busy is None

    def _busy_reason(self, strategy: Strategy, busy: Request) -> str:
        """Why ``busy`` could not be taken, asked only if the message is logged."""
        if not isinstance(strategy, ExplainsBusy) or not logger.isEnabledFor(logging.INFO):
            return HELD
        if connections[busy.alias].connection is None:
            return HELD  # closed (given up at the deadline): no reconnecting for a log line
        try:
            # a log line's wording: never more than a second behind a pooler
            with statement_deadline(Deadline(1.0), busy.alias):
                return strategy.busy_reason(busy.alias, busy.key)
        except (DLockError, DatabaseError):
            return HELD

    def _contended(self, key: Key, deadline: Deadline, strategy: str) -> None:
        """Log a timed-out acquire at INFO: contention is the lock doing its job
        (the caller gets ``False``, ``LockTimeout`` or a 423 and decides)."""
        if self.on_fail == "skip":
            return  # a skip is the expected outcome: _skipped() logs it (INFO)
        if logger.isEnabledFor(logging.INFO):
            waited = deadline.elapsed()
            logger.info(
                "django-dlock: %s %s; gave up after %.3fs",
                key.name,
                why_busy(),
                waited,
                extra={"lock_name": key.name, "lock_strategy": strategy, "lock_wait": waited},
            )

    # -- release and extend ---------------------------------------------------

    def release(self) -> None:
        """Release the lock (one level of re-entry).

        Between :meth:`enqueue` and :meth:`wait`, it gives the caller's place
        in the queue up instead (and the keys ``enqueue`` took before it).

        Raises:
            LockNotOwned: the calling thread or task does not hold it.
            LockLost: it was held but has been lost (its lease ran out or was
                taken over or force-released, a renewal failed, or its
                session ended). The holding is forgotten: the key can be
                acquired again.
            DLockError: the strategy is transaction-scoped (``row``,
                ``advisory_xact``): the transaction's end releases it.
            DatabaseUnavailable: the database could not be reached. The
                holding is forgotten all the same; a lease stays in the
                database until it runs out.
        """
        if _get_running_loop() is not None:
            _refuse_in_event_loop(self, "release()", "`await lk.arelease()`")
        holder = current_holder()
        if self._places is not None:
            queued = self._take_place(holder)
            if queued is not None:
                two_phase.give_up(queued, holder)
                return
        holdings.release_all(holder, self._all_held(holder, releasing=True))

    async def arelease(self) -> None:
        """Async :meth:`release`."""
        holder = current_holder()
        queued = self._take_place(holder)
        if queued is not None:
            give_up = functools.partial(two_phase.give_up, queued, holder)
            await to_the_end(give_up, f"giving up {self.name!r}")
            return
        release = functools.partial(
            holdings.release_all, holder, self._all_held(holder, releasing=True)
        )
        await to_the_end(release, f"releasing {self.name!r}")

    def _all_held(self, holder: Holder | None = None, releasing: bool = False) -> list[Holding]:
        """The holdings of every key, or :class:`LockNotOwned` (and, ``releasing``,
        :class:`DLockError` for a transaction-scoped lock)."""
        if releasing and not _LEAVING.get():
            self._refuse_early_release()
        holder = holder or current_holder()
        found = self._holdings(holder)
        if len(found) != len(self._keys or self.keys):
            raise LockNotOwned(f"{self.name!r} is not held by this {holder.kind} {holder.label!r}")
        return found

    def _refuse_early_release(self) -> None:
        if _LEAVING.get() or not traits(self.strategy_name)[1]:
            return
        raise DLockError(
            f"{self.name!r} uses the {self.strategy_name} strategy: the database releases "
            "it when the transaction ends, and nothing can release it before. Leave the "
            "`with` block (or the decorated function) instead of calling release()"
        )

    def release_for(self, holder: Holder) -> None:
        """Release on behalf of ``holder``, the thread or task that acquired it.

        For code that releases elsewhere than it acquired: a streaming
        response is closed by the server after the view returned, possibly in
        another thread. Does nothing if ``holder`` holds none of the keys.
        """
        found = self._holdings(holder)
        if found:
            holdings.release_all(holder, found)

    def extend(self, ttl: float | None = None) -> None:
        """Renew the lease for ``ttl`` seconds from now (database time).

        Raises:
            ValueError: ``ttl`` is not a valid number of seconds (checked
                first, whether or not the lock is held).
            LockNotOwned: the caller does not hold the lock.
            LockLost: the lease ran out, or was taken over or force-released;
                nothing was changed (an expired lease is not revived).
            DatabaseUnavailable: the database could not be reached; the
                lease keeps its previous expiry.
        """
        _refuse_in_event_loop(self, "extend()", "`await lk.aextend()`")
        seconds = self._extend_ttl(ttl)
        holdings.extend(self._all_held(), seconds)

    async def aextend(self, ttl: float | None = None) -> None:
        """Async :meth:`extend`."""
        seconds = self._extend_ttl(ttl)
        await sync_to_async(holdings.extend)(self._all_held(), seconds)

    def _extend_ttl(self, ttl: float | None) -> float:
        seconds = self.ttl if ttl is None else ttl
        validated(ttl_error(seconds))
        return float(seconds)

    # -- upgrading a read lock ----------------------------------------------------

    def upgrade(self, timeout: float | None = UNSET) -> bool:
        """Turn the caller's upgradeable read lock into the write lock.

        Waits until the other readers have left (readers that arrive
        meanwhile wait behind it), then holds the key alone, with a new
        fencing number; no writer gets in between, so what the caller read
        is still what a writer would find. ``True`` once upgraded, ``False``
        if readers still held the key at the end of ``timeout`` (the lock's
        timeout unless given): the caller then still holds its read lock.
        Releasing, or leaving the block, releases the write lock.

        Raises:
            DLockError: the caller holds no upgradeable read lock of this key
                (take it with ``upgradeable=True``), or the lock has several keys.
            LockLost: the read lock was lost; nothing was upgraded.
        """
        _refuse_in_event_loop(self, "upgrade()", "`await lk.aupgrade()`")
        deadline = Deadline(self._resolve_timeout(True, timeout))
        return holdings.upgrade(self._upgradeable(), deadline, self.retry_interval)

    async def aupgrade(self, timeout: float | None = UNSET) -> bool:
        """Async :meth:`upgrade` (it waits off the event loop)."""
        deadline = Deadline(self._resolve_timeout(True, timeout))
        holding = self._upgradeable()
        return bool(
            await sync_to_async(holdings.upgrade, thread_sensitive=False)(
                holding, deadline, self.retry_interval
            )
        )

    def _upgradeable(self) -> Holding:
        if len(self.keys) != 1:
            raise DLockError("upgrade() needs a lock of one key")
        held = self._holdings()
        if not held or not held[0].request.upgradeable:
            raise DLockError(
                f"{self.name!r}: upgrade() needs an upgradeable read lock held by the "
                "caller (take it with upgradeable=True)"
            )
        return held[0]

    # -- guarded writes -----------------------------------------------------------

    def guard(self, using: str | None = None) -> contextlib.AbstractContextManager[None]:
        """A transaction whose writes commit only while the caller holds the lock.

        ::

            with dlock.lock("invoice:42", ttl=30) as lk:
                total = compute()              # may take long; may be paused
                with lk.guard():               # commits only while we hold it
                    Invoice.objects.filter(pk=42).update(total=total)

        The block runs in ``transaction.atomic`` on the lock's database
        (``using`` must be that database). On ``lease``, before it commits,
        the lease is checked in the same transaction (still the caller's,
        unexpired on the database clock) and kept: nobody can take it over
        until the transaction ends. A lease found lost rolls the block back
        and raises :class:`LockLost`. On ``row`` and ``advisory_xact`` the
        lock already lives in the caller's transaction: the block is a
        savepoint in it and commits with it. A session that stays silent
        inside the block for as long as the lease lasts is ended by the
        server (PostgreSQL, MySQL/MariaDB), so a frozen holder cannot keep
        the key; its writes roll back (:class:`LockLost`).

        Raises:
            LockNotOwned: the caller does not hold the lock.
            LockLost: the lock was lost; nothing of the block was written.
            GuardNotSupported: an ``advisory`` session lock or a quorum lock
                (not kept by a transaction: use its fence), or ``using`` is
                another database than the lock's.
        """
        _refuse_in_event_loop(self, "guard()", "`await lk.aguard(func)`")
        held = self._all_held()
        self._refuse_quorum_guard(held)
        return guarded(held, using)

    async def aguard(self, func: Callable[[], R], using: str | None = None) -> R:
        """Async :meth:`guard`: run ``func()`` in a guarded transaction; its result.

        Django runs transactions in synchronous code only, so the writes go
        in a function, run in Django's thread for synchronous code::

            async with dlock.lock("invoice:42") as lk:
                total = await compute()
                await lk.aguard(lambda: Invoice.objects.filter(pk=42).update(total=total))
        """
        held = self._all_held()  # the calling task's holdings
        self._refuse_quorum_guard(held)

        def run() -> R:
            with guarded(held, using):
                return func()

        result: R = await sync_to_async(run)()
        return result

    def _refuse_quorum_guard(self, held: list[Holding]) -> None:
        """A quorum lock lives on several databases: no one transaction keeps it."""
        if self._quorum is None:
            return
        names = ", ".join(repr(holding.request.key.name) for holding in held)
        raise GuardNotSupported(
            f"{names} is a quorum lock (using={list(self._quorum)!r}: a lease on a majority "
            "of those databases), which no transaction on one database keeps: nothing can "
            "make a write commit only while it is held. Pass the lock's fence to the writes "
            "and reject stale ones (see Fencing in the django-dlock docs), or hold the lock "
            "on one database"
        )

    # -- inspection (asks the database) -----------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds any of the keys now (database query)."""
        _refuse_in_event_loop(self, "locked()", "`await sync_to_async(lk.locked)()`")
        alias = self.alias
        strategy = self._strategy(alias)
        return any(strategy.locked(alias, key) for key in self.keys)

    def owned(self, holder: Holder | None = None) -> bool:
        """Whether the calling holder holds every key, according to the database.

        ``holder`` answers for another thread or task (see
        :func:`django_dlock.identity.current_holder`); from async code use
        :meth:`aowned`, which answers for the calling task. A holding the
        database no longer has is reported lost.

        Raises:
            DatabaseUnavailable: the database could not be reached (nothing
                is reported lost).
        """
        found = self._holdings(holder)
        if len(found) != len(self.keys) or any(h.lost for h in found):
            return False
        return all(holdings.confirm(h, off_loop=holder is None) for h in found)

    async def aowned(self) -> bool:
        """Async :meth:`owned`: whether the calling *task* holds every key."""
        holder = current_holder()
        return bool(await sync_to_async(self.owned)(holder))

    # -- two-phase acquire: enqueue(), then wait() (see two_phase.py) ----------

    def enqueue(self) -> bool:
        """Join the queue and return at once: ``True`` if the lock is now held,
        ``False`` if this caller took a place in the key's queue.

        The place is kept until :meth:`wait`, which must follow from the same
        thread or task: on ``lease`` a ticket (renewed by a thread of the
        process), on ``advisory`` (PostgreSQL) a ``pg_advisory_lock`` waiting in
        PostgreSQL's queue. With many keys, free keys are taken in sorted order
        up to the first busy one, whose queue is joined; :meth:`wait` takes the
        rest in order. Other strategies: ``StrategyNotSupported``.
        """
        _refuse_in_event_loop(self, "enqueue()", "`await lk.aenqueue()`")
        return two_phase.enqueue(self._options(), self._queue_places())

    async def aenqueue(self) -> bool:
        """Async :meth:`enqueue` (the place belongs to the calling task)."""
        return await two_phase.aenqueue(self._options(), self._queue_places())

    def _queue_places(self) -> two_phase.Places:
        if self._places is None:
            self._places = two_phase.Places()
        return self._places

    def _take_place(self, holder: Holder) -> two_phase.Queued | None:
        """``holder``'s place taken by :meth:`enqueue` (taken out), if it has one."""
        return None if self._places is None else self._places.pop(holder)

    def wait(self, timeout: float | None = UNSET) -> bool:
        """Block until the place taken by :meth:`enqueue` is granted (``True``)
        or ``timeout`` passes (``False``: the place is given up, and keys
        taken by ``enqueue`` are released). A lease's TTL counts from the
        moment the lock is granted. ``True`` at once if ``enqueue`` acquired.
        """
        _refuse_in_event_loop(self, "wait()", "`await lk.await_lock()`")
        holder = current_holder()
        deadline = Deadline(self._resolve_timeout(True, timeout))
        queued = self._take_place(holder)
        if queued is None:
            self._acquired_by_enqueue(holder)
            return True
        return two_phase.wait(queued, holder, deadline)

    async def await_lock(self, timeout: float | None = UNSET) -> bool:
        """Async :meth:`wait`. Cancelling it gives the place up and leaves no lock."""
        holder = current_holder()
        deadline = Deadline(self._resolve_timeout(True, timeout))
        queued = self._take_place(holder)
        if queued is None:
            await sync_to_async(self._acquired_by_enqueue)(holder)
            return True
        return await two_phase.await_lock(queued, holder, deadline)

    def _acquired_by_enqueue(self, holder: Holder) -> None:
        """A wait with no place: fine if ``enqueue`` acquired, else :class:`DLockError`."""
        if not self.owned(holder):
            raise DLockError(f"{self.name!r}: wait() without enqueue() (or after it gave up)")

    # -- context managers ----------------------------------------------------

    def _timeout_error(self) -> LockTimeout:
        return LockTimeout(f"could not acquire {self.name!r} within {self.timeout} s")

    def _refuse_skip(self) -> None:
        if self.on_fail == "skip":
            raise ValueError(
                f'on_fail="skip" has no meaning for a `with` block ({self!r}): Python '
                "cannot skip the block. Decorate a function instead, or use "
                "`if lk.acquire(timeout=0):` (or TaskLock, whose `with` value says "
                "whether to run)"
            )

    def __enter__(self) -> Lock:
        if self.on_fail == "skip":
            self._refuse_skip()
        if not self.acquire():
            raise self._timeout_error()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._leave(exc)

    async def __aenter__(self) -> Lock:
        self._refuse_skip()
        if not await self.aacquire():
            raise self._timeout_error()
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        await self._aleave(exc)

    def _leave(self, exc: BaseException | None) -> None:
        """Release on leaving a block or a guarded call that raised ``exc`` (or not)."""
        leaving = _LEAVING.set(True)
        try:
            self.release()
        except (LockLost, DatabaseUnavailable) as error:
            if exc is None:
                raise
            self._hidden(error)
        finally:
            _LEAVING.reset(leaving)

    async def _aleave(self, exc: BaseException | None) -> None:
        """Async :meth:`_leave`."""
        leaving = _LEAVING.set(True)
        try:
            await self.arelease()
        except (LockLost, DatabaseUnavailable) as error:
            if exc is None:
                raise
            self._hidden(error)
        finally:
            _LEAVING.reset(leaving)

    def _hidden(self, error: LockLost | DatabaseUnavailable) -> None:
        """Log what leaving a block raised instead of raising it: leaving raises
        :class:`LockLost` (or the outage of a release that could not reach the
        database), but never hides the body's own exception (often the same outage)."""
        if isinstance(error, LockLost):
            logger.warning("django-dlock: %s was lost while an exception was raised", self.name)
            return
        logger.warning(
            "django-dlock: %s could not be released while an exception was raised: "
            "the database could not be reached",
            self.name,
        )

    # -- decorator ----------------------------------------------------------------

    def _for_function(self, func: Callable[..., Any]) -> Lock:
        if self._keys is not None:
            return self
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._keys = bound._make_keys(f"{func.__module__}.{func.__qualname__}")
        bound._places = None
        return bound

    def _skipped(self) -> None:
        logger.info(
            "django-dlock: skipped, %s %s",
            self.name,
            why_busy(),
            extra={"lock_name": self.name, "lock_strategy": self.strategy_name},
        )
        signals.lock_skipped.send(type(self), name=self.name, reason="held")

    @overload
    def __call__(self: Lock[Literal["raise"]], func: F) -> F: ...

    @overload
    def __call__(
        self, func: Callable[P, Coroutine[Any, Any, R]]
    ) -> Callable[P, Coroutine[Any, Any, R | None]]: ...

    @overload
    def __call__(self, func: Callable[P, R]) -> Callable[P, R | None]: ...

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """Use the lock as a decorator (sync or async functions).

        With ``on_fail="skip"`` (and for a :class:`~django_dlock.TaskLock`)
        the decorated function returns ``None`` when it is skipped, and is
        typed so: ``def f() -> int`` becomes a function returning
        ``int | None``.
        """
        lk = self._for_function(func)

        def refused() -> None:
            if lk.on_fail != "skip":
                raise lk._timeout_error()
            lk._skipped()

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                if not await lk.aacquire():
                    return refused()
                try:
                    result = await func(*args, **kwargs)
                except BaseException as exc:
                    await lk._aleave(exc)
                    raise
                await lk._aleave(None)
                return result

            return async_wrapper

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not lk.acquire():
                return refused()
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                lk._leave(exc)
                raise
            lk._leave(None)
            return result

        return wrapper

    def __repr__(self) -> str:
        keys = "<decorator>" if self._keys is None else self.name
        strategy = self._strategy_name_arg or conf.DEFAULT_STRATEGY
        return f"<{type(self).__name__} {keys} strategy={strategy}>"


@overload
def lock(key: F) -> F: ...


@overload
def lock(
    key: LockKey | None = None,
    *,
    strategy: str | None = None,
    ttl: float | None = None,
    timeout: float | None = UNSET,
    using: str | list[str] | tuple[str, ...] | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    reentrant: bool = True,
    retry_interval: RetryInterval | None = None,
    on_lost: Callable[[LockLost], None] | None = None,
    on_fail: Literal["raise"] = "raise",
    shared: bool = False,
    upgradeable: bool = False,
) -> Lock[Literal["raise"]]: ...


@overload
def lock(
    key: LockKey | None = None,
    *,
    strategy: str | None = None,
    ttl: float | None = None,
    timeout: float | None = UNSET,
    using: str | list[str] | tuple[str, ...] | None = None,
    renew: bool = False,
    max_hold: float | None = None,
    reentrant: bool = True,
    retry_interval: RetryInterval | None = None,
    on_lost: Callable[[LockLost], None] | None = None,
    on_fail: Literal["skip"],
    shared: bool = False,
    upgradeable: bool = False,
) -> Lock[Literal["skip"]]: ...


def lock(key: LockKey | F | None = None, **options: Any) -> Lock[Any] | F:
    """Create a :class:`Lock` (see its arguments).

    ``@dlock.lock`` without parentheses decorates a function with the key
    ``module.qualname``.
    """
    if not options and (inspect.isfunction(key) or inspect.ismethod(key)):
        return Lock()(key)
    return Lock(key, **options)  # type: ignore[arg-type]  # (not a function here: a key)


#: the sender of the lock signals, for every kind of lock (``TaskLock`` too)
Lock.signal_sender = Lock
