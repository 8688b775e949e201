"""Single-instance Celery tasks on django-dlock (extra ``celery``).

::

    from celery import shared_task
    from django_dlock.contrib.celery import SingleInstanceTask

    @shared_task(base=SingleInstanceTask, lock_args=["invoice_id"])
    def charge(invoice_id, amount): ...

    @shared_task(base=SingleInstanceTask, once_per=3600)
    def send_digest(): ...

A task with ``base=SingleInstanceTask`` holds a lease lock while it runs:

* the key is ``celery:<task name>``, followed by the values of the arguments
  named in ``lock_args`` (``celery:billing.tasks.charge:42``): one run at a
  time per task, or per task and chosen arguments;
* on contention (another worker runs it) the call is *skipped* (logged, the
  ``lock_skipped`` signal, returns ``None``) or, with ``on_locked="retry"``,
  retried with Celery's ``retry(countdown=lock_retry_countdown)``;
* the lease (``lock_ttl`` seconds) is renewed in the background while the
  task runs; if the worker dies, the lease runs out after at most
  ``lock_ttl`` seconds and the next call runs;
* ``once_per=seconds`` makes it a :class:`~django_dlock.TaskLock`: the task
  runs at most once per that many seconds, however many beat processes (or
  callers) send it. A run that is skipped returns ``None``.

Options (task attributes, so ``@app.task(base=SingleInstanceTask, ...)``
accepts them): ``lock_args``, ``lock_ttl``, ``lock_timeout``, ``on_locked``,
``lock_retry_countdown``, ``once_per``, ``lock_using``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from celery import Task

from django_dlock import signals
from django_dlock._http import guarded_call
from django_dlock.conf import conf
from django_dlock.locks import Lock
from django_dlock.tasklock import TaskLock

__all__ = ["SingleInstanceTask"]

logger = logging.getLogger("django_dlock")

ON_LOCKED = ("skip", "retry")


class SingleInstanceTask(Task):  # type: ignore[misc]
    """A Celery task base class: one run at a time per key, renewed while it runs."""

    abstract = True

    #: names of the task's arguments whose values are part of the key
    lock_args: Sequence[str] = ()
    #: lease length in seconds, renewed at about a third of it while the task
    #: runs (default: ``DLOCK_DEFAULT_TTL``)
    lock_ttl: float | None = None
    #: how long to wait for the lock before skipping or retrying (default: one try)
    lock_timeout: float = 0
    #: ``"skip"`` (return ``None``) or ``"retry"`` (``self.retry(countdown=...)``)
    on_locked: str = "skip"
    #: seconds before the retry when ``on_locked="retry"``
    lock_retry_countdown: float = 5
    #: run at most once per this many seconds (a TaskLock); ``None``: no limit
    once_per: float | None = None
    #: database alias of the lock (default: the router's choice)
    lock_using: str | None = None

    def lock_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """``celery:<task name>[:<value>...]`` for the values named in ``lock_args``."""
        names = [self.lock_args] if isinstance(self.lock_args, str) else list(self.lock_args)
        if not names:
            return f"celery:{self.name}"
        signature = inspect.signature(self.run)
        unknown = [name for name in names if name not in signature.parameters]
        if unknown:
            raise ValueError(
                f"lock_args of task {self.name!r} name {', '.join(map(repr, unknown))}, which "
                f"is not an argument of the task ({', '.join(signature.parameters)})"
            )
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = ":".join(str(bound.arguments[name]) for name in names)
        return f"celery:{self.name}:{values}"

    def _lock(self, key: str) -> Lock:
        if self.on_locked not in ON_LOCKED:
            raise ValueError(
                f'on_locked of task {self.name!r} must be "skip" or "retry", got {self.on_locked!r}'
            )
        ttl = conf.DEFAULT_TTL if self.lock_ttl is None else self.lock_ttl
        if self.once_per is not None:
            if self.on_locked != "skip":
                raise ValueError(
                    f"task {self.name!r}: once_per runs at most once per interval and skips "
                    'the other calls; on_locked="retry" cannot be combined with it'
                )
            return TaskLock(
                key,
                min_hold=self.once_per,
                max_hold=max(ttl, self.once_per),
                using=self.lock_using,
            )
        return Lock(key, ttl=ttl, timeout=self.lock_timeout, using=self.lock_using, renew=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lk = self._lock(self.lock_key(args, kwargs))
        run = super().__call__
        return guarded_call(
            lk, lambda: run(*args, **kwargs), lambda: self._locked(lk), stream=False
        )

    def _locked(self, lk: Lock) -> Any:
        if self.once_per is None and self.on_locked == "retry":
            logger.info(
                "django-dlock: %s is held: task %s retries in %g s",
                lk.name,
                self.name,
                self.lock_retry_countdown,
            )
            raise self.retry(countdown=self.lock_retry_countdown)
        logger.info("django-dlock: skipped task %s: %s is held", self.name, lk.name)
        signals.lock_skipped.send(type(self), name=lk.name, reason="held")
        return None
