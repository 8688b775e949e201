"""What a holder holds: one :class:`Holding` per key, and the table it lives in.

A holder (a thread, or an asyncio task: see :mod:`django_dlock.identity`)
keeps its holdings in ``holder.holdings``, by *slot*: ``(database alias,
strategy family, key name)``. A holding counts re-entries, carries the
fencing number and the background renewer, and knows until when its lease
surely runs (``valid_until``, on this process's monotonic clock: a statement
sent at ``t`` that set a lease of ``ttl`` seconds on the database clock
leaves it running until at least ``t + ttl``). Past that point only the
database can tell: :func:`confirm` asks it.

A loss is recorded once (:meth:`Holding.mark_lost`: log, ``lock_lost``,
``on_lost``), whoever finds it: the renewer, a call that asked the database,
or a lower layer through :meth:`Holder.report_lost`, which reaches the
holding by the callback :func:`take` registers in ``holder.losses``.

The functions here are what :class:`~django_dlock.locks.Lock` does with its
holdings: take one, re-enter one, renew one, give one back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django_dlock import long_holds, signals, tracing
from django_dlock._threads import close_thread_connections
from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DatabaseUnavailable, LockLost, SessionBusy
from django_dlock.identity import Holder, Slot, current_task, holder_alive
from django_dlock.renewal import Renewer
from django_dlock.retry import Deadline
from django_dlock.strategies.base import DrawsFences, Request, Strategy, Upgrades

__all__ = ["Holding"]

logger = logging.getLogger("django_dlock")

T = TypeVar("T")

#: how much earlier than ``sent_at + ttl`` a lease may end on the database
#: clock: SQLite keeps its times in milliseconds, truncated, so a lease set
#: to end ``ttl`` after "now" can end up to a millisecond before that
CLOCK_GRAIN = 0.001


@dataclass(eq=False, slots=True)
class Holding:
    """One key held by one holder: the re-entrancy count and what we know."""

    request: Request
    strategy: Strategy
    #: the fencing number once drawn (``None``: the strategy has none, or it
    #: is drawn when first read: :attr:`later`); what the log lines, the
    #: signals and the tracer report, which never draw it
    drawn: int | None
    #: the class named as the sender of the lock signals
    sender: type[Any]
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
    #: where the holder keeps it: (alias, strategy family, key name); holdings
    #: of one family are one lock
    slot: Slot = field(init=False)
    #: its ``dlock.hold`` span while traced (see :mod:`django_dlock.tracing`)
    span: Any = None
    #: flagged as held longer than ``DLOCK_LONG_HOLD`` (see :mod:`django_dlock.long_holds`)
    held_long: bool = False
    #: the fencing number is drawn when :attr:`fence` is first read (a
    #: :class:`~django_dlock.strategies.base.DrawsFences` strategy)
    later: bool = False

    def __post_init__(self) -> None:
        req = self.request
        self.slot = (req.alias, self.strategy.family, req.key.name)

    @property
    def name(self) -> str:
        return self.request.key.name

    @property
    def fence(self) -> int | None:
        """The fencing number (``None``: the strategy issues none).

        A strategy that draws it when first read (``row`` and
        ``advisory_xact`` on PostgreSQL) draws it now, once per holding.

        Raises:
            LockLost: the number was not drawn yet, and the lock is no longer
                held (no number is given: it could be below a later holder's).
            DatabaseUnavailable: the database could not be reached.
        """
        if self.later:
            self._draw()
        return self.drawn

    @fence.setter
    def fence(self, number: int | None) -> None:
        self.drawn = number
        self.later = False

    def _draw(self) -> None:
        if self.lost:
            raise self.error()
        strategy = self.strategy
        if not isinstance(strategy, DrawsFences):  # (its grant said later)
            raise TypeError(f"{strategy!r} draws no fencing numbers")
        number = strategy.draw_fence(self.request)
        if number is None:
            self.mark_lost(
                self.loss_reason("the database no longer had it when its fencing number was drawn")
            )
            raise self.error()
        self.drawn = number
        self.later = False
        if self.span is not None and tracing.tracer is not None:
            tracing.tracer.fenced(self)

    def may_have_expired(self) -> bool:
        """Whether the lease may have run out (then only the database knows)."""
        return time.monotonic() >= self.valid_until

    def renewed(self, sent_at: float, ttl: float) -> None:
        """The lease was set to ``ttl`` seconds by a statement sent at ``sent_at``.

        The database stamped the new expiry at or after ``sent_at``, so the
        lease lasts at least until ``sent_at + ttl`` on our monotonic clock
        (less :data:`CLOCK_GRAIN`, what the database's times round off).
        """
        if self.valid_until != math.inf:
            self.valid_until = sent_at + ttl - CLOCK_GRAIN

    def loss_reason(self, default: str) -> str:
        """Why the database no longer has this holding, as the strategy can tell."""
        try:
            reason = self.strategy.loss_reason(self.request)
        except Exception as exc:
            return f"{default} (could not read why: {exc})"
        return default if reason is None else reason

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
        logger.warning(
            "django-dlock: lost %s: %s",
            self.name,
            reason,
            extra={
                "lock_name": self.name,
                "lock_strategy": self.strategy.name,
                "lock_fence": self.drawn,
                "lock_reason": reason,
                "lock_owner": self.request.owner,
            },
        )
        signals.lock_lost.send(
            self.sender, name=self.name, strategy=self.strategy.name, reason=reason
        )
        if self.span is not None and tracing.tracer is not None:
            tracing.tracer.lost(self, reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self.error())
            except Exception:
                logger.exception("django-dlock: on_lost callback of %s raised", self.name)


# -- finding a holding ---------------------------------------------------------


def current(holder: Holder, slot: Slot) -> Holding | None:
    """The holder's holding in ``slot``, forgetting one whose transaction has ended.

    Transaction-scoped strategies (``row``, ``advisory_xact``) say with
    ``ended(request)`` (no query) when the database has dropped the lock.
    """
    holding = holder.holdings.get(slot)
    if (
        holding is not None
        and holding.strategy.transaction_scoped  # (the others never end on their own)
        and holding.strategy.ended(holding.request)
    ):
        holder.holdings.pop(slot, None)
        holder.losses.pop(slot, None)
        if holding.renewer is not None:
            with contextlib.suppress(BaseException):
                holding.renewer.stop()
        return None
    return holding


def confirm_on_reentry(holding: Holding) -> bool:
    """Whether a re-entry of ``holding`` must first renew it on the database.

    Every lease: within its lease too, since an operator may have
    force-released it and someone else taken it (the renewal, one statement,
    finds that out and reports the loss, so the caller contends afresh).
    Strategies without a lease (sessions, transactions) end only with what
    holds them.
    """
    return not holding.lost and holding.valid_until != math.inf


# -- asking the database ---------------------------------------------------------


def renew(holding: Holding, ttl: float) -> bool:
    """One statement: move the lease if it is still ours (and note until when)."""
    sent_at = time.monotonic()
    if holding.span is not None and tracing.tracer is not None:
        extended = tracing.tracer.renewing(
            holding, lambda: holding.strategy.extend(holding.request, ttl)
        )
    else:
        extended = holding.strategy.extend(holding.request, ttl)
    if extended:
        holding.renewed(sent_at, ttl)
        long_holds.note_renewed(holding)
        return True
    return False


def renew_or_lose(holding: Holding, ttl: float) -> None:
    """One statement: renew the lease if it is still ours, else record the loss."""
    if not renew(holding, ttl):
        holding.mark_lost(holding.loss_reason("the lease ran out before re-entry"))


def upgrade(holding: Holding, deadline: Deadline, policy: RetryInterval) -> bool:
    """Turn ``holding``, an upgradeable read lease, into its key's write lease
    (see :class:`~django_dlock.strategies.base.Upgrades`); ``False`` if other
    readers still held the key at ``deadline``, :class:`LockLost` (recorded)
    if the read lease is gone."""
    if holding.lost:
        raise holding.error()
    strategy = holding.strategy
    if not isinstance(strategy, Upgrades):  # (refused when the lock was made)
        raise TypeError(f"{strategy!r} cannot upgrade a holding")
    sent_at = time.monotonic()
    fence = strategy.upgrade(holding.request, deadline, policy)
    if fence is False:
        holding.mark_lost(holding.loss_reason("the read lease was lost before its upgrade"))
        raise holding.error()
    if fence is None:
        return False
    holding.request.shared = False  # the holder may now re-enter it exclusively
    holding.fence = fence
    holding.renewed(sent_at, holding.request.ttl)
    logger.debug("django-dlock: upgraded %s to its write lock (fence %s)", holding.name, fence)
    return True


def extend(holdings: Iterable[Holding], seconds: float) -> None:
    """Renew each lease for ``seconds``; :class:`LockLost` (recorded) if one is gone."""
    for holding in holdings:
        if holding.lost:
            raise holding.error()
        if not renew(holding, seconds):
            holding.mark_lost(holding.loss_reason("the database no longer had it at extend"))
            raise holding.error()


def off_the_loop(func: Callable[[], T]) -> T:
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


def confirm(holding: Holding, off_loop: bool = True) -> bool:
    """Ask the database whether ``holding`` is still ours; mark it lost if not."""
    started = time.monotonic()
    req = holding.request

    def ask() -> str | None:
        """``None`` if still ours, else why not (both read on the same thread)."""
        if holding.strategy.owned(req):
            return None
        return holding.loss_reason("the database no longer has it")

    reason = off_the_loop(ask) if off_loop else ask()
    if reason is not None:
        holding.mark_lost(reason)
        return False
    if holding.valid_until != math.inf:
        # Still ours: it runs until at least its expiry, which we do not
        # know; look again at the next question.
        holding.valid_until = started
    return True


# -- taking and giving back ------------------------------------------------------


@dataclass(frozen=True)
class Renewal:
    """How a holding is renewed in the background (``renew=True``)."""

    ttl: float
    max_hold: float | None


def take(
    holder: Holder, holding: Holding, *, sent_at: float, wait: float, renewal: Renewal | None
) -> Holding:
    """Record ``holding``, just acquired, in the holder's table (and start its renewer)."""
    # (the fencing number as drawn: a strategy that draws it when first read
    # has none yet, and the signal, log line and tracer do not draw it)
    req, strategy, fence = holding.request, holding.strategy, holding.drawn
    if strategy.leased:
        holding.valid_until = sent_at + req.ttl - CLOCK_GRAIN
    slot = holding.slot
    previous = holder.holdings.get(slot)
    if previous is not None:  # lost, and now acquired afresh
        holding.shadowed = previous
    holder.holdings[slot] = holding
    holder.losses[slot] = holding.mark_lost
    if tracing.tracer is not None:
        tracing.tracer.held(holding)
    if renewal is not None:
        renewer = Renewer(
            name=req.key.name,
            alias=req.alias,
            ttl=renewal.ttl,
            max_hold=renewal.max_hold,
            extend=functools.partial(renew, holding),
            on_lost=_renewal_lost(holding),
            holder_alive=holder_alive(),
            lease_end=sent_at + req.ttl,
        )
        holding.renewer = renewer
        renewer.start()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "django-dlock: acquired %s (fence %s) after %.3fs",
            req.key.name,
            fence,
            wait,
            extra={
                "lock_name": req.key.name,
                "lock_strategy": strategy.name,
                "lock_fence": fence,
                "lock_wait": wait,
                "lock_owner": req.owner,
            },
        )
    if signals.lock_acquired.receivers:
        signals.lock_acquired.send(
            holding.sender, name=req.key.name, strategy=strategy.name, fence=fence, wait=wait
        )
    return holding


def _renewal_lost(holding: Holding) -> Callable[[str], None]:
    def lost(reason: str) -> None:
        if reason == Renewer.REFUSED:
            reason = holding.loss_reason("the renewal was refused")
        holding.mark_lost(reason)

    return lost


def release_one(holder: Holder, holding: Holding) -> None:
    """Give back one level of ``holding``; the last level releases it in the database.

    Raises :class:`LockLost` if the holding was lost, and
    :class:`DatabaseUnavailable` if the database could not be reached (the
    holding is forgotten all the same: a holder that acquires the key again
    gets a new grant).
    """
    holding.count -= 1
    if holding.count > 0:
        # An inner level: the lock stays held, but leaving it still
        # reports a loss (asking the database if the lease may have run out).
        if not holding.lost and holding.may_have_expired():
            confirm(holding, off_loop=False)
        if holding.lost:
            raise holding.error()
        return
    req = holding.request
    slot = holding.slot
    if holder.holdings.get(slot) is holding:  # forget it (the one it shadowed comes back)
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
    if holding.span is not None and tracing.tracer is not None:
        with tracing.tracer.releasing(holding):  # its ``dlock.release`` span
            _tell_database(holder, holding)
    else:
        _tell_database(holder, holding)
    if holding.lost:
        raise holding.error()
    held = time.monotonic() - holding.acquired_at
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "django-dlock: released %s after %.3fs",
            req.key.name,
            held,
            extra={
                "lock_name": req.key.name,
                "lock_strategy": holding.strategy.name,
                "lock_fence": holding.drawn,
                "lock_held": held,
            },
        )
    if signals.lock_released.receivers:
        signals.lock_released.send(
            holding.sender, name=req.key.name, strategy=holding.strategy.name, held=held
        )
    if renewer_error is not None:
        raise renewer_error


def _tell_database(holder: Holder, holding: Holding) -> None:
    """The database part of :func:`release_one`: release, or tidy up a lost holding."""
    req = holding.request
    slot = holding.slot
    if holding.lost:
        # Known lost: the release only tidies up (a lease still ours is
        # freed, a session forgets the key); what it says changes nothing.
        try:
            holding.strategy.release(req)
        except Exception as exc:
            logger.debug("django-dlock: tidying up lost %s failed: %s", req.key.name, exc)
    else:
        try:
            released = holding.strategy.release(req)
        except SessionBusy:
            # Nothing was sent: the lock is still held, and still this holder's.
            holding.count += 1
            holder.holdings[slot] = holding
            holder.losses[slot] = holding.mark_lost
            raise
        except DatabaseUnavailable as exc:
            logger.warning(
                "django-dlock: could not release %s, the database could not be reached "
                "(%s); it is forgotten here, and a lease stays until it runs out",
                req.key.name,
                exc,
            )
            raise
        if not released:
            holding.mark_lost(holding.loss_reason("the database no longer had it at release"))


def release_all(holder: Holder, holdings: Iterable[Holding]) -> None:
    """Release each holding, last taken first; raise the first error after all."""
    first_error: BaseException | None = None
    for holding in reversed(list(holdings)):
        try:
            release_one(holder, holding)
        except BaseException as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
