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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast, overload

from asgiref.sync import sync_to_async
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from django_dlock import metrics, signals, two_phase
from django_dlock._threads import close_thread_connections, to_the_end
from django_dlock.conf import RetryInterval, conf, lock_alias
from django_dlock.exceptions import (
    DLockError,
    InvalidLockKey,
    LockLost,
    LockNotOwned,
    LockReentrantError,
    LockTimeout,
    StrategyNotSupported,
)
from django_dlock.identity import Holder, current_holder, current_task, holder_alive
from django_dlock.keys import Key, LockKey, make_key
from django_dlock.renewal import Renewer
from django_dlock.retry import Deadline
from django_dlock.strategies import get_strategy
from django_dlock.strategies.base import Request, Strategy
from django_dlock.strategies.deadline import Abandoned, statement_deadline
from django_dlock.validation import (
    retry_interval_error,
    seconds_or_none,
    strategy_error,
    timeout_error,
    ttl_error,
    validated,
)

__all__ = ["Lock", "lock"]

logger = logging.getLogger("django_dlock")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


@dataclass(eq=False)
class Holding:
    """One key held by one holder: the re-entrancy count and what we know."""

    request: Request
    strategy: Strategy
    fence: int | None
    acquired_at: float = field(default_factory=time.monotonic)
    count: int = 1
    lost: bool = False
    lost_reason: str = ""
    renewer: Renewer | None = None
    on_lost: Callable[[LockLost], None] | None = None
    #: monotonic time before which the lease surely has not run out on the
    #: database clock (``inf`` for strategies without a lease)
    valid_until: float = math.inf
    #: the lost holding this one replaced (re-acquired after the loss): it
    #: comes back when this one is released, so its own levels raise LockLost
    shadowed: Holding | None = None

    @property
    def name(self) -> str:
        return self.request.key.name

    def may_have_expired(self) -> bool:
        """Whether the lease may have run out (then only the database knows)."""
        return time.monotonic() >= self.valid_until

    def renewed(self, sent_at: float, ttl: float) -> None:
        """The lease was set to ``ttl`` seconds by a statement sent at ``sent_at``.

        The database stamped the new expiry at or after ``sent_at``, so the
        lease lasts at least until ``sent_at + ttl`` on our monotonic clock.
        """
        if self.valid_until != math.inf:
            self.valid_until = sent_at + ttl

    def loss_reason(self, default: str) -> str:
        """Why the database no longer has this holding, as the strategy can tell."""
        explain = getattr(self.strategy, "loss_reason", None)
        if explain is None:
            return default
        try:
            reason: str = explain(self.request)
        except Exception as exc:
            return f"{default} (could not read why: {exc})"
        return reason

    def halt_renewal(self) -> None:
        if self.renewer is not None:
            self.renewer.halt()

    def error(self) -> LockLost:
        return LockLost(f"lock {self.name!r} was lost: {self.lost_reason}")

    def mark_lost(self, reason: str) -> None:
        """Record the loss once: log, send ``lock_lost``, call ``on_lost``."""
        if self.lost:
            return
        self.lost = True
        self.lost_reason = reason
        logger.warning("django-dlock: lost %s: %s", self.name, reason)
        signals.lock_lost.send(Lock, name=self.name, strategy=self.strategy.name, reason=reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self.error())
            except Exception:
                logger.exception("django-dlock: on_lost callback of %s raised", self.name)


def _quorum_of(using: object, strategy: str | None) -> tuple[str, ...] | None:
    """The aliases of a quorum lock (``using=[...]``), checked; None for one alias."""
    if using is None or isinstance(using, str):
        return None
    from django_dlock.strategies.quorum import quorum_aliases, quorum_strategy

    aliases = quorum_aliases(using)
    if strategy is not None:
        quorum_strategy(strategy, aliases)  # only the lease strategy can
    return aliases


def _off_the_loop(func: Callable[[], T]) -> T:
    """Run a query from sync code that may be running inside an event loop.

    ``held()`` and ``owned()`` are synchronous; called from a coroutine they
    must not query on the event loop's thread (Django forbids it), so the
    query runs in a short-lived thread that closes its connections.
    """
    if current_task() is None:
        return func()

    def run() -> T:
        try:
            return func()
        finally:
            close_thread_connections()

    with ThreadPoolExecutor(1, thread_name_prefix="django-dlock-check") as pool:
        return pool.submit(run).result()


#: the checked value of each default setting a lock uses, until settings change
_DEFAULTS: dict[str, Any] = {}

_DEFAULT_CHECKS: dict[str, tuple[Callable[[Any], str | None], type[Exception]]] = {
    "DLOCK_DEFAULT_STRATEGY": (strategy_error, StrategyNotSupported),
    "DLOCK_DEFAULT_TTL": (ttl_error, ValueError),
    "DLOCK_DEFAULT_TIMEOUT": (timeout_error, ValueError),
    "DLOCK_RETRY_INTERVAL": (retry_interval_error, ValueError),
}


def _default(setting: str) -> Any:
    """The setting's value, checked (a named error if it is bad).

    Read when a lock is used, never when it is created, and remembered until
    a ``setting_changed`` signal (``override_settings``) says otherwise, so
    that the hot path does not re-read and re-check four settings per call.
    """
    try:
        return _DEFAULTS[setting]
    except KeyError:
        pass
    value = conf._get(setting)
    check, error = _DEFAULT_CHECKS[setting]
    problem = check(value)
    if problem is not None:
        raise error(f"the {setting} setting: {problem}")
    if setting in ("DLOCK_DEFAULT_TTL", "DLOCK_DEFAULT_TIMEOUT") and value is not None:
        value = float(value)
    _DEFAULTS[setting] = value
    return value


#: (strategy name, alias, ENGINE) -> the strategy, its support for that database checked
_SUPPORTED: dict[tuple[str, str, Any], Strategy] = {}


def _supported(name: str, alias: str) -> Strategy:
    """The strategy ``name`` on ``alias``, checked once per database engine.

    A strategy with one implementation per database (``advisory``: PostgreSQL
    or MySQL/MariaDB) resolves to the one for ``alias``, so that acquire and
    release do not look it up again. A strategy the database cannot do raises
    :class:`StrategyNotSupported` at every call (nothing is remembered).
    """
    database = connections.settings.get(alias)
    slot = (name, alias, None if database is None else database.get("ENGINE"))
    found = _SUPPORTED.get(slot)
    if found is None:
        found = get_strategy(name)
        found.check_supported(connections[alias])
        implementation = getattr(found, "implementation", None)
        if implementation is not None:
            found = implementation(alias)
        _SUPPORTED[slot] = found
    return found


def _traits(name: str) -> tuple[str, bool]:
    """The family of the strategy called ``name``, and whether it is transaction-scoped."""
    found = _TRAITS.get(name)
    if found is None:
        strategy = get_strategy(name)
        scoped = strategy.transaction_scoped
        found = _TRAITS[name] = (strategy.family, scoped)
    return found


_TRAITS: dict[str, tuple[str, bool]] = {}


def _lock_model() -> type[Any]:
    """The ``Lock`` model, imported on first use (this module loads before the apps)."""
    global _LOCK_MODEL
    if _LOCK_MODEL is None:
        from django_dlock.models import Lock as LockModel

        _LOCK_MODEL = LockModel
    return _LOCK_MODEL


_LOCK_MODEL: type[Any] | None = None


@receiver(setting_changed)
def _forget_defaults(setting: str, **kwargs: Any) -> None:
    if setting in _DEFAULT_CHECKS:
        _DEFAULTS.clear()
    if setting == "DATABASES":
        _SUPPORTED.clear()


#: set while a ``with`` block or a decorated function is being left
_LEAVING: ContextVar[bool] = ContextVar("django_dlock_leaving", default=False)


def _current(holder: Holder, slot: tuple[str, str, str]) -> Holding | None:
    """The holder's holding in ``slot``, forgetting one whose transaction has ended.

    Transaction-scoped strategies (``row``, ``advisory_xact``) say with
    ``ended(request)`` (no query) when the database has dropped the lock.
    """
    holding: Holding | None = holder.holdings.get(slot)
    if holding is not None and holding.strategy.ended(holding.request):
        holder.holdings.pop(slot, None)
        holder.losses.pop(slot, None)
        if holding.renewer is not None:
            with contextlib.suppress(BaseException):
                holding.renewer.stop()
        return None
    return holding


class Lock:
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
            ``0`` one try, ``n`` up to n seconds (``DLOCK_DEFAULT_TIMEOUT``).
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
        shared: take a shared (read) lock where the strategy supports it.

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

    #: places taken by :meth:`enqueue`, by holder token (made on first use)
    _queued_by_holder: dict[str, two_phase.Queued]

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
        self._strategy_arg = strategy
        if ttl is not None:
            validated(ttl_error(ttl))
        self._ttl_arg = None if ttl is None else float(ttl)
        if timeout is not UNSET:
            validated(timeout_error(timeout))
        self._timeout_arg = timeout
        if retry_interval is not None:
            validated(retry_interval_error(retry_interval))
        self._retry_arg = retry_interval
        self.max_hold = seconds_or_none(max_hold, "max_hold", allow_zero=False)
        if on_fail not in ("raise", "skip"):
            raise ValueError(f'on_fail must be "raise" or "skip", got {on_fail!r}')
        #: the databases of a quorum lock (``using=[...]``), else None
        self._quorum = _quorum_of(using, strategy)
        self.using: str | None = self._quorum[0] if self._quorum else cast("str | None", using)
        if self.using is not None and self.using not in connections:
            raise ValueError(f"unknown database alias {using!r}")
        self.renew = bool(renew)
        self.reentrant = bool(reentrant)
        self.on_lost = on_lost
        self.on_fail = on_fail
        self.shared = bool(shared)

    # -- options that default to settings (read and checked at use) ---------

    @property
    def strategy_name(self) -> str:
        """The strategy's name (``DLOCK_DEFAULT_STRATEGY`` unless given)."""
        if self._strategy_arg is not None:
            return self._strategy_arg
        value: str = _default("DLOCK_DEFAULT_STRATEGY")
        return value

    @property
    def queues_waiters(self) -> bool:
        """Whether its waiters take tickets in the lease queue (``lease`` on one database)."""
        return self._quorum is None and self.strategy_name == "lease"

    @property
    def ttl(self) -> float:
        """The lease length in seconds (``DLOCK_DEFAULT_TTL`` unless given)."""
        if self._ttl_arg is not None:
            return self._ttl_arg
        value: float = _default("DLOCK_DEFAULT_TTL")
        return value

    @property
    def timeout(self) -> float | None:
        """How long to wait (``DLOCK_DEFAULT_TIMEOUT`` unless given)."""
        if self._timeout_arg is not UNSET:
            given: float | None = self._timeout_arg
            return given
        value: float | None = _default("DLOCK_DEFAULT_TIMEOUT")
        return value

    @property
    def retry_interval(self) -> RetryInterval:
        """The waiting policy (``DLOCK_RETRY_INTERVAL`` unless given)."""
        if self._retry_arg is not None:
            return self._retry_arg
        value: RetryInterval = _default("DLOCK_RETRY_INTERVAL")
        return value

    def _check_options(self) -> None:
        """Read and check every option that comes from settings (before any SQL)."""
        _ = self.strategy_name, self.ttl, self.timeout, self.retry_interval

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
            strategy = self._chosen()
            strategy.check_supported(connections[alias])
            return strategy
        return _supported(self.strategy_name, alias)

    def _chosen(self) -> Strategy:
        """The strategy by name, or its quorum over the databases of ``using=[...]``."""
        if self._quorum is not None:
            from django_dlock.strategies.quorum import quorum_strategy

            return quorum_strategy(self.strategy_name, self._quorum)
        return get_strategy(self.strategy_name)

    # -- the calling holder's view -----------------------------------------

    def _holdings(self, holder: Holder | None = None) -> list[Holding]:
        holder = holder or current_holder()
        alias = self.alias
        if self._quorum is not None:
            family = self._chosen().family
        else:
            family = _traits(self.strategy_name)[0]
        found = []
        for key in self.keys:
            holding = _current(holder, (alias, family, key.name))
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

        For a lock on several keys use :attr:`fences`.
        """
        if len(self.keys) != 1:
            raise DLockError("this lock has several keys: use .fences")
        held = self._holdings()
        return held[0].fence if held else None

    @property
    def fences(self) -> dict[str, int | None]:
        """Fencing number per key name of the calling holder's holdings."""
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
                self._confirm(holding, off_loop=off_loop)
        return not any(h.lost for h in held)

    def _confirm(self, holding: Holding, off_loop: bool = True) -> bool:
        """Ask the database whether ``holding`` is still ours; mark it lost if not."""
        started = time.monotonic()
        req = holding.request

        def ask() -> str | None:
            """``None`` if still ours, else why not (both read on the same thread)."""
            if holding.strategy.owned(req):
                return None
            return holding.loss_reason("the database no longer has it")

        reason = _off_the_loop(ask) if off_loop else ask()
        if reason is not None:
            holding.mark_lost(reason)
            return False
        if holding.valid_until != math.inf:
            # Still ours: it runs until at least its expiry, which we do not
            # know; look again at the next question.
            holding.valid_until = started
        return True

    # -- acquire ---------------------------------------------------------------

    def _resolve_timeout(self, blocking: bool, timeout: float | None) -> float | None:
        if not blocking:
            return 0.0
        if timeout is UNSET:
            return self.timeout
        validated(timeout_error(timeout))
        return timeout

    def _reenter(self, holder: Holder, alias: str, strategy: Strategy, key: Key) -> bool:
        """Count a re-entry if the holder still holds ``key``.

        The database decides: when the lease may have run out, one statement
        renews it if it is still ours. A holding that is lost is not
        re-entered: the caller contends afresh (``False``).
        """
        holding = _current(holder, (alias, strategy.family, key.name))
        if holding is None:
            return False
        if not holding.lost and holding.may_have_expired():
            self._renew_or_lose(holding, self._lease_ttl())
        if holding.lost:
            holding.halt_renewal()
            return False
        if not self.reentrant:
            raise LockReentrantError(
                f"{key.name!r} is already held by this {holder.kind} and reentrant=False"
            )
        if holding.request.shared and not self.shared:
            raise LockReentrantError(
                f"{key.name!r} is held shared by this {holder.kind}: it cannot be "
                "re-entered exclusively (release the shared lock first)"
            )
        holding.count += 1
        return True

    @staticmethod
    def _stale(holder: Holder, alias: str, strategy: Strategy, key: Key) -> Holding | None:
        """The holder's holding of ``key`` if its lease may have run out."""
        holding = _current(holder, (alias, strategy.family, key.name))
        if holding is None or holding.lost or not holding.may_have_expired():
            return None
        return holding

    @staticmethod
    def _renew_or_lose(holding: Holding, ttl: float) -> None:
        """One statement: renew the lease if it is still ours, else record the loss."""
        if not Lock._renew(holding, ttl):
            holding.mark_lost(holding.loss_reason("the lease ran out before re-entry"))

    def _lease_ttl(self) -> float:
        return self.ttl if self.max_hold is None else min(self.ttl, self.max_hold)

    def _request(self, holder: Holder, alias: str, key: Key) -> Request:
        return Request(
            key=key,
            alias=alias,
            token=holder.token(),
            owner=holder.owner(),
            ttl=self._lease_ttl(),
            shared=self.shared,
        )

    def _held(
        self,
        holder: Holder,
        strategy: Strategy,
        req: Request,
        fence: int | None,
        sent_at: float,
        wait: float,
    ) -> Holding:
        slot = (req.alias, strategy.family, req.key.name)
        holding = Holding(request=req, strategy=strategy, fence=fence, on_lost=self.on_lost)
        if strategy.name == "lease":
            holding.valid_until = sent_at + req.ttl
        previous = holder.holdings.get(slot)
        if previous is not None:  # lost, and now acquired afresh
            holding.shadowed = previous
        holder.holdings[slot] = holding
        holder.losses[slot] = holding.mark_lost
        if self.renew:
            renewer = Renewer(
                name=req.key.name,
                alias=req.alias,
                ttl=self.ttl,
                max_hold=self.max_hold,
                extend=functools.partial(self._renew, holding),
                on_lost=self._renewal_lost(holding),
                holder_alive=holder_alive(),
            )
            holding.renewer = renewer
            renewer.start()
        logger.debug("django-dlock: acquired %s (fence %s) after %.3fs", req.key.name, fence, wait)
        if signals.lock_acquired.receivers:
            signals.lock_acquired.send(
                Lock, name=req.key.name, strategy=strategy.name, fence=fence, wait=wait
            )
        return holding

    @staticmethod
    def _renew(holding: Holding, ttl: float) -> bool:
        """One statement: move the lease if it is still ours (and note until when)."""
        sent_at = time.monotonic()
        if holding.strategy.extend(holding.request, ttl):
            holding.renewed(sent_at, ttl)
            return True
        return False

    @staticmethod
    def _renewal_lost(holding: Holding) -> Callable[[str], None]:
        def lost(reason: str) -> None:
            if reason == Renewer.REFUSED:
                reason = holding.loss_reason("the renewal was refused")
            holding.mark_lost(reason)

        return lost

    def acquire(self, blocking: bool = True, timeout: float | None = UNSET) -> bool:
        """Acquire the lock; ``True`` if acquired, ``False`` on timeout.

        ``timeout`` overrides the lock's timeout for this call (``None``
        waits forever, ``0`` tries once); ``blocking=False`` is ``timeout=0``.
        Acquiring a lock the caller already holds counts one more level
        (re-entry); if that holding was lost meanwhile, the loss is reported
        (``lock_lost``, ``on_lost``) and the call contends like any other.
        """
        deadline = Deadline(self._resolve_timeout(blocking, timeout))
        self._check_options()
        if metrics.observer is not None:
            return metrics.observer.acquire(self, deadline, self._acquire)
        return self._acquire(deadline)

    def _acquire(self, deadline: Deadline) -> bool:
        holder = current_holder()
        alias = self.alias
        strategy = self._strategy(alias)
        taken: list[Key] = []
        try:
            for key in self.keys:
                if not self._reenter(holder, alias, strategy, key):
                    req = self._request(holder, alias, key)
                    sent_at = time.monotonic()
                    try:
                        with statement_deadline(deadline, alias):
                            grant = strategy.acquire(req, deadline, self.retry_interval)
                    except Abandoned:  # waited past the deadline for a pooler
                        grant = None
                    if grant is None:
                        self._undo(holder, alias, strategy, taken)
                        self._contended(key, deadline)
                        return False
                    self._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
                taken.append(key)
        except BaseException:
            self._undo(holder, alias, strategy, taken)
            raise
        return True

    async def aacquire(self, blocking: bool = True, timeout: float | None = UNSET) -> bool:
        """Async :meth:`acquire`: waits without blocking the event loop.

        Cancelling the task while it waits leaves no lock behind.
        """
        deadline = Deadline(self._resolve_timeout(blocking, timeout))
        self._check_options()
        if metrics.observer is not None:
            return await metrics.observer.aacquire(self, deadline, self._aacquire)
        return await self._aacquire(deadline)

    async def _aacquire(self, deadline: Deadline) -> bool:
        holder = current_holder()
        alias = self.alias
        strategy = self._strategy(alias)
        taken: list[Key] = []
        try:
            for key in self.keys:
                stale = self._stale(holder, alias, strategy, key)
                if stale is not None:  # the lease may have run out: ask, off the loop
                    await sync_to_async(self._renew_or_lose)(stale, self._lease_ttl())
                if not self._reenter(holder, alias, strategy, key):
                    req = self._request(holder, alias, key)
                    sent_at = time.monotonic()
                    try:
                        with statement_deadline(deadline, alias):
                            grant = await strategy.aacquire(req, deadline, self.retry_interval)
                    except Abandoned:  # waited past the deadline for a pooler
                        grant = None
                    if grant is None:
                        undo = functools.partial(self._undo, holder, alias, strategy, list(taken))
                        await to_the_end(undo, f"giving back {self.name!r}")
                        self._contended(key, deadline)
                        return False
                    self._held(holder, strategy, req, grant.fence, sent_at, deadline.elapsed())
                taken.append(key)
        except BaseException:
            undo = functools.partial(self._undo, holder, alias, strategy, list(taken))
            await to_the_end(undo, f"giving back {self.name!r}")
            raise
        return True

    def _contended(self, key: Key, deadline: Deadline) -> None:
        if self.on_fail == "skip":
            return  # a skip is the expected outcome: _skipped() logs it (INFO)
        logger.warning(
            "django-dlock: %s is held by someone else; gave up after %.3fs",
            key.name,
            deadline.elapsed(),
        )

    def _undo(self, holder: Holder, alias: str, strategy: Strategy, taken: list[Key]) -> None:
        """Give back what a failed many-key acquire took (all or none)."""
        for key in reversed(taken):
            holding = holder.holdings.get((alias, strategy.family, key.name))
            if holding is not None:
                with contextlib.suppress(DLockError):
                    self._release_one(holder, holding)

    # -- release and extend ---------------------------------------------------

    def _release_one(self, holder: Holder, holding: Holding) -> None:
        holding.count -= 1
        if holding.count > 0:
            # An inner level: the lock stays held, but leaving it still
            # reports a loss (asking the database if the lease may have run out).
            if not holding.lost and holding.may_have_expired():
                self._confirm(holding, off_loop=False)
            if holding.lost:
                raise holding.error()
            return
        req = holding.request
        slot = (req.alias, holding.strategy.family, req.key.name)
        if holder.holdings.get(slot) is holding:
            del holder.holdings[slot]
            holder.losses.pop(slot, None)
            if holding.shadowed is not None:
                holder.holdings[slot] = holding.shadowed
                holder.losses[slot] = holding.shadowed.mark_lost
        renewer_error: BaseException | None = None
        if holding.renewer is not None:
            try:
                holding.renewer.stop()
            except BaseException as exc:
                renewer_error = exc
        if holding.lost:
            # Known lost: the release only tidies up (a lease still ours is
            # freed, a session forgets the key); what it says changes nothing.
            try:
                holding.strategy.release(req)
            except Exception as exc:
                logger.debug("django-dlock: tidying up lost %s failed: %s", req.key.name, exc)
        elif not holding.strategy.release(req):
            holding.mark_lost(holding.loss_reason("the database no longer had it at release"))
        if holding.lost:
            raise holding.error()
        held = time.monotonic() - holding.acquired_at
        logger.debug("django-dlock: released %s after %.3fs", req.key.name, held)
        if signals.lock_released.receivers:
            signals.lock_released.send(
                Lock, name=req.key.name, strategy=holding.strategy.name, held=held
            )
        if renewer_error is not None:
            raise renewer_error

    def release(self) -> None:
        """Release the lock (one level of re-entry).

        Raises:
            LockNotOwned: the calling thread or task does not hold it.
            LockLost: it was held but has been lost (its lease ran out or was
                taken over or force-released, a renewal failed, or its
                session ended). The holding is forgotten: the key can be
                acquired again.
            DLockError: the strategy is transaction-scoped (``row``,
                ``advisory_xact``): the transaction's end releases it.
        """
        self._refuse_early_release()
        holder = current_holder()
        holdings = self._holdings(holder)
        if len(holdings) != len(self.keys):
            holder_name = f"{holder.kind} {holder.label!r}"
            raise LockNotOwned(f"{self.name!r} is not held by this {holder_name}")
        self._release_all(holder, holdings)

    async def arelease(self) -> None:
        """Async :meth:`release`."""
        self._refuse_early_release()
        holder = current_holder()
        holdings = self._holdings(holder)
        if len(holdings) != len(self.keys):
            raise LockNotOwned(f"{self.name!r} is not held by this task")
        release = functools.partial(self._release_all, holder, holdings)
        await to_the_end(release, f"releasing {self.name!r}")

    def _refuse_early_release(self) -> None:
        if _LEAVING.get() or not _traits(self.strategy_name)[1]:
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
        holdings = self._holdings(holder)
        if holdings:
            self._release_all(holder, holdings)

    def _release_all(self, holder: Holder, holdings: Iterable[Holding]) -> None:
        first_error: BaseException | None = None
        for holding in reversed(list(holdings)):
            try:
                self._release_one(holder, holding)
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    def extend(self, ttl: float | None = None) -> None:
        """Renew the lease for ``ttl`` seconds from now (database time).

        Raises:
            ValueError: ``ttl`` is not a valid number of seconds (checked
                first, whether or not the lock is held).
            LockNotOwned: the caller does not hold the lock.
            LockLost: the lease ran out, or was taken over or force-released;
                nothing was changed (an expired lease is not revived).
        """
        seconds = self._extend_ttl(ttl)
        self._extend_all(self._holdings_to_extend(), seconds)

    async def aextend(self, ttl: float | None = None) -> None:
        """Async :meth:`extend`."""
        seconds = self._extend_ttl(ttl)
        await sync_to_async(self._extend_all)(self._holdings_to_extend(), seconds)

    def _extend_ttl(self, ttl: float | None) -> float:
        seconds = self.ttl if ttl is None else ttl
        validated(ttl_error(seconds))
        return float(seconds)

    def _holdings_to_extend(self) -> list[Holding]:
        holdings = self._holdings()
        if len(holdings) != len(self.keys):
            raise LockNotOwned(f"{self.name!r} is not held by the caller")
        return holdings

    def _extend_all(self, holdings: list[Holding], seconds: float) -> None:
        for holding in holdings:
            if holding.lost:
                raise holding.error()
            if not self._renew(holding, seconds):
                holding.mark_lost(holding.loss_reason("the database no longer had it at extend"))
                raise holding.error()

    # -- inspection (asks the database) -----------------------------------------

    def locked(self) -> bool:
        """Whether anyone holds any of the keys now (database query)."""
        alias = self.alias
        strategy = self._strategy(alias)
        return any(strategy.locked(alias, key) for key in self.keys)

    def owned(self, holder: Holder | None = None) -> bool:
        """Whether the calling holder holds every key, according to the database.

        ``holder`` answers for another thread or task (see
        :func:`django_dlock.identity.current_holder`); from async code use
        :meth:`aowned`, which answers for the calling task. A holding the
        database no longer has is reported lost.
        """
        holdings = self._holdings(holder)
        if len(holdings) != len(self.keys) or any(h.lost for h in holdings):
            return False
        return all(self._confirm(h, off_loop=holder is None) for h in holdings)

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
        return two_phase.enqueue(self)

    async def aenqueue(self) -> bool:
        """Async :meth:`enqueue` (the place belongs to the calling task)."""
        return await two_phase.aenqueue(self)

    def wait(self, timeout: float | None = UNSET) -> bool:
        """Block until the place taken by :meth:`enqueue` is granted (``True``)
        or ``timeout`` passes (``False``: the place is given up, and keys
        taken by ``enqueue`` are released). A lease's TTL counts from the
        moment the lock is granted. ``True`` at once if ``enqueue`` acquired.
        """
        return two_phase.wait(self, timeout)

    async def await_lock(self, timeout: float | None = UNSET) -> bool:
        """Async :meth:`wait`. Cancelling it gives the place up and leaves no lock."""
        return await two_phase.await_lock(self, timeout)

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
        with self._leaving(exc):
            self.release()

    async def _aleave(self, exc: BaseException | None) -> None:
        """Async :meth:`_leave`."""
        with self._leaving(exc):
            await self.arelease()

    @contextlib.contextmanager
    def _leaving(self, exc: BaseException | None) -> Iterator[None]:
        leaving = _LEAVING.set(True)
        try:
            yield
        except LockLost:
            # Leaving the block raises LockLost, but never hides the body's
            # own exception.
            if exc is None:
                raise
            logger.warning("django-dlock: %s was lost while an exception was raised", self.name)
        finally:
            _LEAVING.reset(leaving)

    # -- decorator ----------------------------------------------------------------

    def _for_function(self, func: Callable[..., Any]) -> Lock:
        if self._keys is not None:
            return self
        bound = object.__new__(type(self))
        bound.__dict__.update(self.__dict__)
        bound._keys = bound._make_keys(f"{func.__module__}.{func.__qualname__}")
        return bound

    def _skipped(self) -> None:
        logger.info("django-dlock: skipped, %s is held by someone else", self.name)
        signals.lock_skipped.send(type(self), name=self.name, reason="held")

    def __call__(self, func: F) -> F:
        """Use the lock as a decorator (sync or async functions)."""
        from django_dlock._http import aguarded_call, guarded_call

        lk = self._for_function(func)

        def refused() -> None:
            if lk.on_fail != "skip":
                raise lk._timeout_error()
            lk._skipped()

        if inspect.iscoroutinefunction(func):

            async def arefused() -> None:
                refused()

            @functools.wraps(func)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await aguarded_call(
                    lk, lambda: func(*args, **kwargs), arefused, stream=False
                )

            return cast(F, async_wrapper)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return guarded_call(lk, lambda: func(*args, **kwargs), refused, stream=False)

        return cast(F, wrapper)

    def __repr__(self) -> str:
        keys = "<decorator>" if self._keys is None else self.name
        strategy = self._strategy_arg or conf.DEFAULT_STRATEGY
        return f"<{type(self).__name__} {keys} strategy={strategy}>"


@overload
def lock(key: F) -> F: ...


@overload
def lock(key: LockKey | None = None, **options: Any) -> Lock: ...


def lock(key: LockKey | F | None = None, **options: Any) -> Lock | F:
    """Create a :class:`Lock` (see its arguments).

    ``@dlock.lock`` without parentheses decorates a function with the key
    ``module.qualname``.
    """
    if not options and (inspect.isfunction(key) or inspect.ismethod(key)):
        return Lock()(key)
    return Lock(cast("LockKey | None", key), **options)
