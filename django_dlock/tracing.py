"""OpenTelemetry traces, on with ``DLOCK_TRACING = "opentelemetry"``.

The spans go to the tracer provider the application set up
(``opentelemetry.trace.set_tracer_provider``, or the ``opentelemetry-instrument``
agent), under the instrumentation scope ``django_dlock``:

* ``dlock.acquire``: one call of ``acquire()`` (a ``with`` block's entry, a
  decorated call, a TaskLock's run, a view's ``@with_lock``, a Celery
  ``SingleInstanceTask``), from the call to its answer. Attributes:
  ``dlock.acquire.outcome`` (``acquired``, ``skipped`` for a one-try acquire
  that found the lock held, ``timeout``, ``cancelled``, ``error``),
  ``dlock.acquire.wait`` (seconds), ``dlock.acquire.attempts`` (the tries of
  a waiter that polls or holds a ticket; 1 when the database itself queues
  the waiter), ``dlock.acquire.queue_position`` (a lease waiter's place when
  it took its ticket: 1 is the head) and, once acquired, ``dlock.lock.fence``
  (``row`` and ``advisory_xact`` on PostgreSQL draw their number only when
  it is first read, after the acquire: their acquire span has none).
* ``dlock.hold``: one key held, from its grant to its release or its loss;
  a sibling of the acquire span (same parent); ``dlock.lock.fence`` once the
  number is drawn. ``dlock.hold.outcome`` is
  ``released`` or ``lost``; a loss adds the event ``dlock.lost`` (with
  ``dlock.lost.reason``) and sets the span's status to ``ERROR``.
* ``dlock.renew``: one renewal of a lease (``extend()``, ``renew=True``),
  a child of the hold span: ``dlock.renew.outcome`` is ``renewed`` or ``lost``.
* ``dlock.release``: the release of one key, a child of the hold span.
* ``dlock.leader.term``: a ``LeaderElection`` term, from winning to stepping
  down or losing (``dlock.leader.term`` is the term number).

The acquire, hold and term spans carry ``dlock.lock.name`` (see below),
``dlock.strategy``, ``dlock.primitive`` (``Lock``, ``Semaphore``,
``TaskLock``, ...), ``db.namespace`` (the database alias) and, when the
caller said what it is doing (a request, a Celery task, a worker job),
``dlock.holder.context``; their renew and release children carry only
their own. No attribute ever carries a lock's token.

``DLOCK_TRACING_LOCK_NAMES`` decides what ``dlock.lock.name`` says:
``"plain"`` (the default: ``lock:invoice:42``), ``"hashed"`` (the first 16
hex digits of its SHA-256, stable across processes, for names that carry
personal data) or ``"off"`` (no name, no holder context). Span names never
carry a lock's name, so their number stays small whatever the keys.

Off (the default, ``DLOCK_TRACING = None``), nothing is imported and the
only cost left on each call is one attribute test.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.core.signals import setting_changed

from django_dlock import acquire_notes
from django_dlock.acquire_notes import Notes
from django_dlock.identity import what_it_is_doing
from django_dlock.strategies.base import Request, Strategy

if TYPE_CHECKING:
    from django_dlock.retry import Deadline

__all__ = [
    "BACKENDS",
    "NAMES",
    "OpenTelemetryTracer",
    "configure",
    "names_error",
    "tracer",
    "tracing_error",
]

#: accepted values of ``DLOCK_TRACING``
BACKENDS = (None, "opentelemetry")
#: accepted values of ``DLOCK_TRACING_LOCK_NAMES``
NAMES = ("plain", "hashed", "off")

SCOPE = "django_dlock"


def tracing_error(value: object) -> str | None:
    """Why ``value`` is not a valid ``DLOCK_TRACING``, or ``None``."""
    if value not in BACKENDS:
        return f'must be None or "opentelemetry", got {value!r}'
    return None


def names_error(value: object) -> str | None:
    """Why ``value`` is not a valid ``DLOCK_TRACING_LOCK_NAMES``, or ``None``."""
    if value not in NAMES:
        return f'must be "plain", "hashed" or "off", got {value!r}'
    return None


class Acquiring(Protocol):
    """What the tracer reads of one call's options (an ``Options``)."""

    @property
    def name(self) -> str: ...
    @property
    def strategy_name(self) -> str: ...
    @property
    def signal_sender(self) -> type: ...
    @property
    def alias(self) -> str: ...


class Held(Protocol):
    """What the tracer reads and keeps on one key held (a ``Holding``)."""

    request: Request
    strategy: Strategy
    #: the fencing number once drawn (the tracer never draws it)
    drawn: int | None
    sender: type
    count: int
    lost: bool
    span: Any


class OpenTelemetryTracer:
    """Makes the spans of the module's list, with OpenTelemetry's API."""

    def __init__(self, names: str) -> None:
        from opentelemetry import context, trace

        self._trace = trace
        self._context = context
        self.tracer = trace.get_tracer(SCOPE, _version())
        self.names = names

    # -- attributes ----------------------------------------------------------------

    def lock_name(self, name: str) -> str | None:
        if self.names == "plain":
            return name
        if self.names == "hashed":
            return hashlib.sha256(name.encode()).hexdigest()[:16]
        return None

    def _attributes(self, name: str, strategy: str, primitive: type, alias: str) -> dict[str, Any]:
        found: dict[str, Any] = {
            "dlock.strategy": strategy,
            "dlock.primitive": primitive.__name__,
            "db.namespace": alias,
        }
        shown = self.lock_name(name)
        if shown is not None:
            found["dlock.lock.name"] = shown
            context = what_it_is_doing()
            if context is not None:
                found["dlock.holder.context"] = context
        return found

    # -- acquire (called by Lock.acquire / Lock.aacquire) ----------------------------

    def _start_acquire(self, opts: Acquiring) -> tuple[Any, Notes]:
        record = Notes(parent=self._context.get_current())
        attributes = self._attributes(opts.name, opts.strategy_name, opts.signal_sender, opts.alias)
        span = self.tracer.start_span("dlock.acquire", attributes=attributes)
        return span, record

    def _end_acquire(
        self,
        span: Any,
        record: Notes,
        deadline: Deadline,
        acquired: bool | None,
        error: BaseException | None,
    ) -> None:
        if acquired:
            outcome = "acquired"
        elif acquired is not None:
            outcome = "skipped" if deadline.timeout == 0 else "timeout"
        elif isinstance(error, asyncio.CancelledError):
            outcome = "cancelled"
        else:
            outcome = "error"
        span.set_attribute("dlock.acquire.outcome", outcome)
        span.set_attribute("dlock.acquire.wait", deadline.elapsed())
        span.set_attribute("dlock.acquire.attempts", record.attempts)
        if record.queue_position is not None:
            span.set_attribute("dlock.acquire.queue_position", record.queue_position)
        if acquired and record.fences:
            span.set_attribute("dlock.lock.fence", max(record.fences))
        if outcome == "error" and error is not None:
            span.record_exception(error)
            span.set_attribute("error.type", type(error).__qualname__)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(error)))
        span.end()

    def acquire(self, opts: Acquiring, deadline: Deadline, attempt: Callable[[], bool]) -> bool:
        """Run ``attempt`` (one acquire) inside its span."""
        span, record = self._start_acquire(opts)
        token = acquire_notes.current.set(record)
        acquired: bool | None = None
        error: BaseException | None = None
        try:
            # the outcome and any error are set by _end_acquire (a cancellation
            # is not an error)
            with self._trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                acquired = attempt()
            return acquired
        except BaseException as exc:
            error = exc
            raise
        finally:
            acquire_notes.current.reset(token)
            self._end_acquire(span, record, deadline, acquired, error)

    async def aacquire(
        self, opts: Acquiring, deadline: Deadline, attempt: Callable[[], Awaitable[bool]]
    ) -> bool:
        """Async :meth:`acquire`."""
        span, record = self._start_acquire(opts)
        token = acquire_notes.current.set(record)
        acquired: bool | None = None
        error: BaseException | None = None
        try:
            # the outcome and any error are set by _end_acquire (a cancellation
            # is not an error)
            with self._trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                acquired = await attempt()
            return acquired
        except BaseException as exc:
            error = exc
            raise
        finally:
            acquire_notes.current.reset(token)
            self._end_acquire(span, record, deadline, acquired, error)

    # -- a holding's life (called by holdings) ----------------------------------------

    def held(self, holding: Held) -> None:
        """``holding`` was just granted: its hold span starts."""
        record = acquire_notes.current.get()
        parent = record.parent if record is not None else None
        if record is not None and holding.drawn is not None:
            record.fences.append(holding.drawn)
        req = holding.request
        attributes = self._attributes(
            req.key.name, holding.strategy.name, holding.sender, req.alias
        )
        if holding.drawn is not None:
            attributes["dlock.lock.fence"] = holding.drawn
        holding.span = self.tracer.start_span("dlock.hold", context=parent, attributes=attributes)

    def fenced(self, holding: Held) -> None:
        """``holding``'s fencing number was drawn after it was granted (``row``
        and ``advisory_xact`` on PostgreSQL draw it when first read): its hold
        span carries it from then on (its acquire span has ended)."""
        if holding.span is not None:
            holding.span.set_attribute("dlock.lock.fence", holding.drawn)

    def _child(self, holding: Held, name: str) -> Any:
        """A span under ``holding``'s hold span (which carries the lock's attributes)."""
        parent = None
        if holding.span is not None:
            parent = self._trace.set_span_in_context(holding.span)
        return self.tracer.start_span(name, context=parent)

    def renewing(self, holding: Held, renew: Callable[[], bool]) -> bool:
        """Run ``renew`` (one renewal of ``holding``'s lease) inside its span."""
        span = self._child(holding, "dlock.renew")
        renewed = False
        try:
            with self._trace.use_span(span, end_on_exit=False, record_exception=True):
                renewed = renew()
            return renewed
        finally:
            span.set_attribute("dlock.renew.outcome", "renewed" if renewed else "lost")
            span.end()

    @contextlib.contextmanager
    def releasing(self, holding: Held) -> Iterator[None]:
        """The release of ``holding``; its hold span ends with it (unless the
        release could not be sent: the lock is still held)."""
        span = self._child(holding, "dlock.release")
        try:
            with self._trace.use_span(span, end_on_exit=False, record_exception=True):
                yield
        finally:
            span.end()
            if holding.count <= 0:
                self.ended(holding)

    def lost(self, holding: Held, reason: str) -> None:
        """``holding`` was lost: its hold span says why, and ends."""
        span = holding.span
        if span is None:
            return
        span.add_event("dlock.lost", {"dlock.lost.reason": reason})
        span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, reason))
        self.ended(holding)

    def ended(self, holding: Held) -> None:
        span, holding.span = holding.span, None
        if span is not None:
            span.set_attribute("dlock.hold.outcome", "lost" if holding.lost else "released")
            span.end()

    # -- leader terms (called by LeaderElection) ---------------------------------------

    def term_started(self, name: str, strategy: str, sender: type, alias: str, term: int) -> Any:
        attributes = self._attributes(name, strategy, sender, alias)
        attributes["dlock.leader.term"] = term
        return self.tracer.start_span("dlock.leader.term", attributes=attributes)

    def term_ended(self, span: Any, reason: str, graceful: bool) -> None:
        span.set_attribute("dlock.leader.end", reason)
        if not graceful:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, reason))
        span.end()


#: the running tracer, ``None`` when tracing is off (read on every acquire)
tracer: OpenTelemetryTracer | None = None


def configure() -> None:
    """Switch tracing on or off to match ``DLOCK_TRACING`` (called at startup).

    An invalid value or a missing OpenTelemetry API leaves tracing off; the
    system checks dlock.E043 and dlock.E044 report it.
    """
    global tracer
    wanted = getattr(settings, "DLOCK_TRACING", None)
    names = getattr(settings, "DLOCK_TRACING_LOCK_NAMES", "plain")
    if wanted != "opentelemetry" or names_error(names) or not opentelemetry_available():
        tracer = None
        return
    tracer = OpenTelemetryTracer(names)


def _version() -> str | None:
    try:
        return importlib.metadata.version("django-dlock")
    except importlib.metadata.PackageNotFoundError:
        return None


def opentelemetry_available() -> bool:
    try:
        import opentelemetry.trace  # noqa: F401
    except ImportError:
        return False
    return True


def _reconfigure(*, setting: str, **kwargs: Any) -> None:
    if setting in ("DLOCK_TRACING", "DLOCK_TRACING_LOCK_NAMES"):
        configure()


setting_changed.connect(_reconfigure, dispatch_uid="django_dlock.tracing")
