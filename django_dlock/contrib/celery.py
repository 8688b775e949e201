"""Single-instance Celery tasks on django-dlock (extra ``celery``).

::

    from celery import shared_task
    X SingleInstanceTask

    @shared_task(base=SingleInstanceTask, lock_args=["invoice_id"])
    def charge(invoice_id, amount): ...

    @shared_task(base=SingleInstanceTask, once_per=3600)
    def send_digest(): ...

A task with ``base=SingleInstanceTask`` holds a lease lock while it runs:

* the key is ``celery:<task name>``, followed by the values of the arguments
  named in ``lock_args``, each as a JSON literal (``celery:billing.tasks.charge:42``,
  ``celery:mail.tasks.send:"ann@example.com"``): one run at a time per task,
  or per task and chosen arguments; distinct values always give distinct
  keys, and a key longer than 255 characters ends in a SHA-256 digest of
  the values instead;
* on contention (another worker runs it) the call is *skipped* (logged, the
  ``lock_skipped`` signal, returns ``None``) or, with ``on_locked="retry"``,
  retried with Celery's ``retry(countdown=lock_retry_countdown)``;
* the lease (``lock_ttl`` seconds) is renewed in the background while the
  task runs; if the worker dies, the lease runs out after at most
  ``lock_ttl`` seconds and the next call runs;
* a message the broker *redelivers* (``acks_late=True`` and the worker died
  mid-run) waits for the lock up to a lease length (``lock_ttl`` plus a
  margin), so the dead run's lease can run out: it then runs, never
  alongside another run;
* ``once_per=seconds`` makes it a :class:`~django_dlock.TaskLock`: the task
  runs at most once per that many seconds, however many beat processes (or
  callers) send it. A run that is skipped returns ``None``;
* ``lock_permits=N`` lets up to N runs of the task (per key) run at once
  across every worker, a :class:`~django_dlock.Semaphore`: the next call is
  skipped or retried as above.

Options (task attributes, so ``@app.task(base=SingleInstanceTask, ...)``
accepts them): ``lock_args``, ``lock_ttl``, ``lock_timeout``, ``on_locked``,
``lock_retry_countdown``, ``once_per``, ``lock_using``, ``lock_permits``.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

from celery import Task

from django_dlock import signals
from django_dlock._http import guarded_call
from django_dlock.conf import conf
from django_dlock.contrib._values import encode_value
from django_dlock.exceptions import DLockError
from django_dlock.identity import doing
from django_dlock.keys import MAX_KEY_LENGTH
from django_dlock.locks import Lock, why_busy
from django_dlock.tasklock import TaskLock

__all__ = ["SingleInstanceTask"]

logger = logging.getLogger("django_dlock")

ON_LOCKED = ("skip", "retry")


def _valid_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


#: the lock of the task run in progress in this thread or task (for ``guard()``)
_RUNNING: ContextVar[Lock | None] = ContextVar("django_dlock_celery_running", default=None)


class SingleInstanceTask(Task):  # type: ignore[misc]
    """A Celery task base class: one run at a time per key (or ``lock_permits``
    runs), renewed while it runs."""

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
    #: let up to this many runs (per key) run at once, a semaphore; ``None``: one
    lock_permits: int | None = None

    def lock_key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """``celery:<task name>[:<value>...]`` for the values named in ``lock_args``.

        Each value is encoded by :func:`encode_value` (``42`` and ``"42"``,
        ``None`` and ``"None"`` differ; a ``:`` inside a string cannot shift
        the boundary between two values). A key longer than 255 characters,
        or not valid UTF-8, becomes ``celery:<task name>:sha256:<hex>``, the
        digest of the encoded values (no encoded value starts with ``sha256:``).
        """
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
        values = ":".join(encode_value(bound.arguments[name]) for name in names)
        key = f"celery:{self.name}:{values}"
        if len(key) <= MAX_KEY_LENGTH and _valid_text(key):
            return key
        key = f"celery:{self.name}:{_digest(values)}"
        return key if len(key) <= MAX_KEY_LENGTH else _digest(key)

    def _redelivered(self) -> bool:
        """Whether the broker delivers this message again (its worker died unacknowledged)."""
        request = getattr(self, "request", None)
        delivery_info = getattr(request, "delivery_info", None) or {}
        return bool(delivery_info.get("redelivered"))

    def _lock(self, key: str) -> Lock:
        if self.on_locked not in ON_LOCKED:
            raise ValueError(
                f'on_locked of task {self.name!r} must be "skip" or "retry", got {self.on_locked!r}'
            )
        ttl = conf.DEFAULT_TTL if self.lock_ttl is None else self.lock_ttl
        if self.once_per is not None:
            if self.lock_permits is not None:
                raise ValueError(
                    f"task {self.name!r}: once_per runs at most once per interval; "
                    "lock_permits cannot be combined with it"
                )
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
        timeout = self.lock_timeout
        if self._redelivered():
            # The run this message started may have died holding the lease: wait
            # until that lease can have run out (its last renewal gave it at most
            # ``ttl`` seconds) rather than skip the one delivery left of the task.
            timeout = max(timeout, ttl + max(2.0, ttl / 4))
        if self.lock_permits is not None:
            from django_dlock.semaphores import Semaphore

            return Semaphore(
                key,
                permits=self.lock_permits,
                ttl=ttl,
                timeout=timeout,
                using=self.lock_using,
                renew=True,
            )
        return Lock(key, ttl=ttl, timeout=timeout, using=self.lock_using, renew=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        lk = self._lock(self.lock_key(args, kwargs))
        run = super().__call__

        def running() -> Any:
            token = _RUNNING.set(lk)
            try:
                return run(*args, **kwargs)
            finally:
                _RUNNING.reset(token)

        request_id = getattr(getattr(self, "request", None), "id", None)
        with doing(f"celery {self.name}[{request_id}]" if request_id else f"celery {self.name}"):
            return guarded_call(lk, running, lambda: self._locked(lk), stream=False)

    def guard(self, using: str | None = None) -> contextlib.AbstractContextManager[None]:
        """In the task's body: a transaction whose writes commit only while
        this run holds its lock (see ``Lock.guard()``)::

            @shared_task(base=SingleInstanceTask, bind=True, lock_args=["invoice_id"])
            def charge(self, invoice_id):
                total = compute(invoice_id)                # may take long
                with self.guard():                         # only while this run holds it
                    Invoice.objects.filter(pk=invoice_id).update(total=total)

        Raises:
            DLockError: called outside the task's running body.
            LockLost: the run's lock was lost; nothing of the block was written.
        """
        lk = _RUNNING.get()
        if lk is None:
            raise DLockError(
                f"{self.name}.guard() is for the body of a running task (bind=True, "
                "`with self.guard():` inside the task function)"
            )
        return lk.guard(using)

    def _locked(self, lk: Lock) -> Any:
        if self.once_per is None and self.on_locked == "retry":
            logger.info(
                "django-dlock: %s %s: task %s retries in %g s",
                lk.name,
                why_busy(),
                self.name,
                self.lock_retry_countdown,
            )
            raise self.retry(countdown=self.lock_retry_countdown)
        logger.info("django-dlock: skipped task %s: %s %s", self.name, lk.name, why_busy())
        signals.lock_skipped.send(type(self), name=lk.name, reason="held")
        return None
