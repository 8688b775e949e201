"""Prometheus metrics, on with ``DLOCK_METRICS = "prometheus"``.

The metrics live in prometheus_client's default registry, so whatever
exports that registry shows them (django-prometheus's ``/metrics`` view,
``prometheus_client.start_http_server``, a multiprocess collector):

* ``dlock_acquire_seconds`` (histogram; labels ``strategy``, ``outcome``):
  time spent in ``acquire``. ``outcome`` is ``acquired``; ``skipped`` (a
  one-try acquire, ``timeout=0``, found the lock held: a TaskLock, an
  ``on_fail="skip"`` decorator, ``acquire(blocking=False)``); ``timeout`` (a
  waiting acquire ran out of time); ``cancelled`` (the task awaiting
  ``aacquire`` or ``async with`` was cancelled); ``error`` (the acquire
  raised).
* ``dlock_held_seconds`` (histogram; ``strategy``): how long a lock was held,
  observed at its release.
* ``dlock_lost_total`` (counter; ``strategy``): locks lost while held.
* ``dlock_waiters`` (gauge): callers of this process waiting for a lock now:
  on ``lease``, the tickets this process holds in the waiter queue (from
  the moment a ticket is taken, by a waiting ``acquire`` or by ``enqueue()``,
  until it is granted or given up); on the other strategies, callers
  waiting in ``acquire`` (one-try acquires are not waiters).
* ``dlock_deadlocks_total`` (counter): lease waiters of this process told
  they were part of a deadlock (``LockDeadlock``).
* ``dlock_long_holds_total`` (counter; ``strategy``): leases held (renewed)
  past ``DLOCK_LONG_HOLD``, counted once per holding.

Off (the default, ``DLOCK_METRICS = None``), nothing is connected: the only
cost left in the acquire path is one attribute test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.signals import setting_changed

from django_dlock import signals

if TYPE_CHECKING:
    from django_dlock.retry import Deadline

__all__ = ["BACKENDS", "configure", "metrics_error", "observer"]

#: accepted values of ``DLOCK_METRICS``
BACKENDS = (None, "prometheus")

#: buckets of both histograms, in seconds: lock waits and holds span
#: milliseconds (uncontended) to minutes (jobs)
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


def metrics_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``DLOCK_METRICS``, or ``None``."""
    if value not in BACKENDS:
        return f'must be None or "prometheus", got {value!r}'
    return None


class PrometheusObserver:
    """Feeds the metrics from the acquire path, the signals, deadlocks and long holds."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.acquire_seconds = Histogram(
            "dlock_acquire_seconds",
            "Time spent acquiring a django-dlock lock, by outcome.",
            ["strategy", "outcome"],
            buckets=BUCKETS,
        )
        self.held_seconds = Histogram(
            "dlock_held_seconds",
            "How long a django-dlock lock was held (observed at release).",
            ["strategy"],
            buckets=BUCKETS,
        )
        self.lost_total = Counter(
            "dlock_lost_total", "django-dlock locks lost while held.", ["strategy"]
        )
        self.waiters = Gauge("dlock_waiters", "Callers waiting to acquire a django-dlock lock.")
        self.deadlocks = Counter(
            "dlock_deadlocks_total", "Lease waiters told they were part of a deadlock."
        )
        self.long_holds = Counter(
            "dlock_long_holds_total",
            "django-dlock leases held (renewed) past DLOCK_LONG_HOLD.",
            ["strategy"],
        )
        # labels() validates and locks on every call: keep the children
        self._acquire: dict[tuple[str, str], Any] = {}
        self._held: dict[str, Any] = {}

    def _acquire_child(self, strategy: str, outcome: str) -> Any:
        child = self._acquire.get((strategy, outcome))
        if child is None:
            child = self._acquire[strategy, outcome] = self.acquire_seconds.labels(
                strategy, outcome
            )
        return child

    # -- the acquire path (called by Lock.acquire / Lock.aacquire) --------------

    def _failed(
        self, strategy: str, deadline: Deadline, acquired: bool | None, cancelled: bool = False
    ) -> None:
        if acquired:
            return  # observed per key by the lock_acquired signal
        outcome = "cancelled" if cancelled else "error"
        if acquired is not None:  # False: the lock is held by someone else
            outcome = "skipped" if deadline.timeout == 0 else "timeout"
        self._acquire_child(strategy, outcome).observe(deadline.elapsed())

    def acquire(
        self, strategy: str, queued: bool, deadline: Deadline, attempt: Callable[[], bool]
    ) -> bool:
        """Run ``attempt`` (an acquire by ``strategy``), observing it.

        ``queued``: its waiters take tickets in a queue, which counts them
        in ``dlock_waiters`` itself.
        """
        waiting = deadline.timeout != 0 and not queued
        if waiting:
            self.waiters.inc()
        acquired: bool | None = None
        try:
            acquired = attempt()
            return acquired
        finally:
            if waiting:
                self.waiters.dec()
            self._failed(strategy, deadline, acquired)

    async def aacquire(
        self,
        strategy: str,
        queued: bool,
        deadline: Deadline,
        attempt: Callable[[], Awaitable[bool]],
    ) -> bool:
        """Async :meth:`acquire`."""
        waiting = deadline.timeout != 0 and not queued
        if waiting:
            self.waiters.inc()
        acquired: bool | None = None
        cancelled = False
        try:
            acquired = await attempt()
            return acquired
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if waiting:
                self.waiters.dec()
            self._failed(strategy, deadline, acquired, cancelled)

    # -- signals ------------------------------------------------------------------

    def on_acquired(self, sender: Any, *, strategy: str, wait: float, **kwargs: Any) -> None:
        self._acquire_child(strategy, "acquired").observe(wait)

    def on_released(self, sender: Any, *, strategy: str, held: float, **kwargs: Any) -> None:
        child = self._held.get(strategy)
        if child is None:
            child = self._held[strategy] = self.held_seconds.labels(strategy)
        child.observe(held)

    def on_lost(self, sender: Any, *, strategy: str, **kwargs: Any) -> None:
        self.lost_total.labels(strategy).inc()

    def connect(self) -> None:
        uid = "django_dlock.metrics"
        signals.lock_acquired.connect(self.on_acquired, dispatch_uid=uid)
        signals.lock_released.connect(self.on_released, dispatch_uid=uid)
        signals.lock_lost.connect(self.on_lost, dispatch_uid=uid)

    def disconnect(self) -> None:
        uid = "django_dlock.metrics"
        signals.lock_acquired.disconnect(dispatch_uid=uid)
        signals.lock_released.disconnect(dispatch_uid=uid)
        signals.lock_lost.disconnect(dispatch_uid=uid)


#: the running observer, ``None`` when metrics are off (read by ``Lock.acquire``)
observer: PrometheusObserver | None = None

#: metrics can be registered once per process in the default registry
_prometheus: PrometheusObserver | None = None


def configure() -> None:
    """Switch metrics on or off to match ``DLOCK_METRICS`` (called at startup).

    An invalid value or a missing prometheus_client leaves metrics off; the
    system checks dlock.E040 / dlock.E041 report it.
    """
    global observer, _prometheus
    wanted = getattr(settings, "DLOCK_METRICS", None)
    if observer is not None:
        observer.disconnect()
        observer = None
    if wanted != "prometheus" or not prometheus_available():
        return
    if _prometheus is None:
        _prometheus = PrometheusObserver()
    _prometheus.connect()
    observer = _prometheus


def prometheus_available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def _reconfigure(*, setting: str, **kwargs: Any) -> None:
    if setting == "DLOCK_METRICS":
        configure()


setting_changed.connect(_reconfigure, dispatch_uid="django_dlock.metrics")
