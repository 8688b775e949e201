"""``TaskLock``: run a scheduled job at most once per interval across workers.

Every worker (cron box, Celery beat, app server) fires the same job; the
first to take the lock runs it, the others *skip* (they do not wait)::

    @dlock.TaskLock("send-digest", min_hold=300, max_hold=3600)
    def send_digest():
        ...

    send_digest()          # runs, or returns None at once if it ran < 5 min ago

Semantics (ShedLock's ``lockAtLeastFor`` / ``lockAtMostFor``):

* the lock is tried once; when it is held the body does not run, a log line
  is written and the ``lock_skipped`` signal is sent;
* on exit the lease is kept until ``acquired_at + min_hold``, judged on the
  database clock, so the job runs at most once per ``min_hold`` seconds
  across every worker, even when a run is quick;
* the lease is taken for ``max_hold`` seconds: a holder that crashes (or
  hangs) blocks the job for at most that long. A run longer than
  ``max_hold`` must call :meth:`TaskLock.extend`.

It is a lease lock in the ``task:`` namespace: ``TaskLock("x")``,
``lock("x")`` and ``LeaderElection("x")`` never collide.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal, ParamSpec, TypeVar

from django_dlock import signals
from django_dlock.locks import Lock
from django_dlock.validation import seconds_or_none

__all__ = ["TaskLock"]

logger = logging.getLogger("django_dlock")

T = TypeVar("T")
P = ParamSpec("P")


class TaskLock(Lock[Literal["skip"]]):
    """A lease lock that skips when held and keeps its lease for ``min_hold``.

    Args:
        name: the task's name (stored as ``task:<name>``): a string, a
            two-part tuple or a saved model instance. Omit it when
            decorating: the name is then the function's ``module.qualname``.
        min_hold: seconds from the acquisition during which the task cannot
            run again, anywhere (``lockAtLeastFor``). ``0`` frees the lock
            on exit.
        max_hold: the lease length in seconds (``lockAtMostFor``): how long
            a crashed or hung holder blocks the task. Default: the larger
            of ``DLOCK_DEFAULT_TTL`` and ``min_hold``.
        using: database alias, or a list of aliases for a quorum lock
            (default: the router's write database for
            :class:`django_dlock.models.Lock`).

    Use it, in order of preference, as

    * a decorator: the function returns ``None`` when skipped (and is typed
      so: a function returning ``int`` becomes one returning ``int | None``);
    * ``task.run(func, *args, **kwargs)`` / ``await task.arun(...)``: same;
    * a context manager whose value says whether to run the body (Python
      cannot skip a ``with`` body, so check it)::

          with TaskLock("rebuild-index", min_hold=60) as acquired:
              if acquired:
                  rebuild_index()

    Raises:
        ValueError: ``min_hold`` / ``max_hold`` are not seconds, or
            ``min_hold > max_hold``.
        InvalidLockKey: the name is not a valid key.
    """

    namespace = "task"

    def __init__(
        self,
        name: Any = None,
        *,
        min_hold: float = 0.0,
        max_hold: float | None = None,
        using: str | list[str] | tuple[str, ...] | None = None,
    ) -> None:
        low = seconds_or_none(min_hold, "min_hold", allow_zero=True)
        self.min_hold = 0.0 if low is None else low
        high = seconds_or_none(max_hold, "max_hold", allow_zero=False)
        if high is not None and self.min_hold > high:
            raise ValueError(
                f"min_hold ({self.min_hold:g} s) must not exceed max_hold ({high:g} s): "
                "the lease is taken for max_hold seconds"
            )
        #: the lease strategy keeps the lease until acquired_at + min_hold
        self._hold_at_least = self.min_hold
        # Without max_hold the lease length comes from DLOCK_DEFAULT_TTL, read
        # when the task runs (so that importing a module never fails on it).
        super().__init__(
            name,
            strategy="lease",
            ttl=high,
            timeout=0,
            using=using,
            max_hold=high,
            on_fail="skip",
        )

    @property
    def ttl(self) -> float:
        """The lease length: ``max_hold``, else max(``DLOCK_DEFAULT_TTL``, ``min_hold``)."""
        if self._ttl_arg is not None:
            return self._ttl_arg
        return max(super().ttl, self.min_hold)

    def _skipped(self) -> None:
        logger.info(
            "django-dlock: skipped task %s: it is running elsewhere or ran less than "
            "min_hold (%g s) ago",
            self.name,
            self.min_hold,
        )
        signals.lock_skipped.send(type(self), name=self.name, reason="held")

    # -- context managers: the value says whether the body may run ----------

    def __enter__(self) -> bool:  # type: ignore[override]
        if self.acquire():
            return True
        self._skipped()
        return False

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._holdings():  # a skipped block holds nothing
            self._leave(exc)

    async def __aenter__(self) -> bool:  # type: ignore[override]
        if await self.aacquire():
            return True
        self._skipped()
        return False

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._holdings():
            await self._aleave(exc)

    # -- explicit forms ------------------------------------------------------

    def run(self, func: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """Call ``func(*args, **kwargs)`` if the task lock is free; else ``None``.

        Example::

            TaskLock("daily-export", min_hold=3600).run(export, day)
        """
        with self as acquired:
            if acquired:
                return func(*args, **kwargs)
        return None

    async def arun(
        self, func: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs
    ) -> T | None:
        """Async :meth:`run`: awaits ``func(*args, **kwargs)`` if the lock is free."""
        async with self as acquired:
            if acquired:
                return await func(*args, **kwargs)
        return None

    def __repr__(self) -> str:
        keys = "<decorator>" if self._keys is None else self.name
        high = "<default>" if self._ttl_arg is None else f"{self._ttl_arg:g}"
        return f"<TaskLock {keys} min_hold={self.min_hold:g} max_hold={high}>"


TaskLock.signal_sender = TaskLock
