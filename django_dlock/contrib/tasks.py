"""Tasks of Django's Tasks framework that run one (or N) at a time across workers.

::

    from django_dlock.contrib.tasks import locked_task

    @locked_task(key="sync-catalog", on_busy="skip", ttl=10)
    def sync_catalog(): ...

    @locked_task(key="charge:{account_id}", on_busy="retry", retry_after=5)
    def charge(account_id, amount): ...

    @locked_task(key="exports", permits=2, on_busy="retry", retry_after=1)
    def export(n): ...

:func:`locked_task` is a drop-in for ``django.tasks.task`` (Django 6), or
for the ``task`` of the django-tasks backport on older Django (extra
``tasks``). It takes the task decorator's own arguments (``priority``,
``queue_name``, ``backend``, ``takes_context``, ...) and the lock's:

* ``key``: a string (``"sync-catalog"``), a format string over the task's
  arguments (``"charge:{account_id}"``: each value is written as a JSON
  literal, ``42`` as ``42`` and ``"42"`` as ``"42"``, so distinct values
  never give the same key), or a callable of the task's arguments that
  returns the key. Omitted: ``tasks:<module>.<function>``, one run of the
  task at a time;
* ``on_busy``: ``"skip"`` (the run ends at once, successfully, returning
  ``None``; the ``lock_skipped`` signal and a log line say so) or
  ``"retry"`` (the run is enqueued again with ``run_after`` ``retry_after``
  seconds later; the backend must support ``run_after``);
* ``permits=N``: up to N bodies at once per key (a
  :class:`~django_dlock.Semaphore`);
* ``ttl``: the lease, renewed in the background while the body runs, so a
  worker that dies frees the key within ``ttl`` seconds;
* ``timeout``: how long a run waits for the key before it skips or retries
  (default: one try); ``using``: the lock's database alias.

In the body, :func:`guard` opens a transaction whose writes commit only while
the run still holds its lock (see ``Lock.guard()``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import logging
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

from django.utils import timezone

from django_dlock import signals
from django_dlock._http import KeyTemplate, aguarded_call, guarded_call
from django_dlock.conf import conf
from django_dlock.contrib._values import encode_value
from django_dlock.exceptions import DLockError, InvalidLockKey, KeyTemplateError
from django_dlock.identity import doing
from django_dlock.keys import MAX_KEY_LENGTH, make_key
from django_dlock.locks import Lock, why_busy

if TYPE_CHECKING:  # typed against Django 6's own framework
    from django.tasks import TaskContext, TaskResultStatus, task_backends
    from django.tasks import task as framework_task
    from django.tasks.base import Task
    from django.tasks.exceptions import InvalidTask
else:
    try:  # Django 6: the framework is part of Django
        from django.tasks import TaskContext, TaskResultStatus, task_backends
        from django.tasks import task as framework_task
        from django.tasks.base import Task
        from django.tasks.exceptions import InvalidTask
    except ImportError:  # Django 4.2 / 5.2: the django-tasks backport (extra "tasks")
        try:
            from django_tasks import TaskContext, TaskResultStatus, task_backends
            from django_tasks import task as framework_task
            from django_tasks.base import Task
            from django_tasks.exceptions import InvalidTaskError as InvalidTask
        except ImportError as exc:
            raise ImportError(
                "django_dlock.contrib.tasks needs Django's Tasks framework: Django 6 or "
                "later, or on older Django the django-tasks backport "
                '(pip install "django-dlock[tasks]")'
            ) from exc

#: ``Task``, ``TaskContext``, ``TaskResultStatus`` and ``task_backends`` are
#: the framework's in use (Django's own, or the backport's), for code that
#: serves both
__all__ = [
    "LockedTask",
    "LockedTaskError",
    "Task",
    "TaskContext",
    "TaskResultStatus",
    "guard",
    "locked_task",
    "task_backends",
]

logger = logging.getLogger("django_dlock")

ON_BUSY = ("skip", "retry")

#: characters that can continue a JSON number: a format field followed by one
#: of these (or by another field) could end in two places
_NUMBER_CHARS = frozenset("0123456789.eE+-")

#: the lock of the task run in progress in this thread or asyncio task
_RUNNING: ContextVar[Lock | None] = ContextVar("django_dlock_task_running", default=None)


class LockedTaskError(InvalidTask, DLockError):
    """A :func:`locked_task` is defined or enqueued with options that cannot
    work: an unknown ``on_busy``, a key template naming no argument of the
    task, ``on_busy="retry"`` on a backend that cannot defer a run, ...

    A subclass of the framework's own ``InvalidTask`` (the backport's
    ``InvalidTaskError``) and of :class:`~django_dlock.exceptions.DLockError`.
    """


KeyOption = str | Callable[..., Any] | None


@dataclass(frozen=True)
class LockSpec:
    """The lock side of a locked task: how a run builds and takes its lock."""

    name: str
    key: KeyOption
    template: KeyTemplate | None
    parameters: inspect.Signature
    on_busy: Literal["skip", "retry"]
    retry_after: float
    permits: int | None
    ttl: float | None
    timeout: float
    using: str | None
    takes_context: bool

    def lock_key(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The key of a run with these arguments (the task's own, without the context)."""
        if self.key is None:
            return f"tasks:{self.name}"
        if callable(self.key):
            return self.key(*args, **kwargs)
        assert self.template is not None
        if not self.template.names:
            return self.key
        try:
            bound = self.parameters.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"task {self.name}: {exc}") from None
        bound.apply_defaults()
        out: list[str] = []
        for literal, field in self.template.parts:
            out.append(literal)
            if field is not None:
                out.append(encode_value(bound.arguments[field]))
        return fit(self.template.template, "".join(out))

    def lock(self, key: Any) -> Lock:
        ttl = conf.DEFAULT_TTL if self.ttl is None else self.ttl
        if self.permits is not None:
            from django_dlock.semaphores import Semaphore

            return Semaphore(
                key,
                permits=self.permits,
                ttl=ttl,
                timeout=self.timeout,
                using=self.using,
                renew=True,
            )
        return Lock(key, ttl=ttl, timeout=self.timeout, using=self.using, renew=True)

    def check_backend(self, task: Task) -> None:  # type: ignore[type-arg]
        """Refuse ``on_busy="retry"`` on a backend that cannot defer a run."""
        if self.on_busy != "retry":
            return
        backend = task_backends[task.backend]
        if not getattr(backend, "supports_defer", False):
            raise LockedTaskError(
                f'task {self.name}: on_busy="retry" enqueues a busy run again with '
                f"run_after, which backend {task.backend!r} ({type(backend).__name__}) "
                'cannot defer: use a backend that supports run_after, or on_busy="skip"'
            )


def fit(template: str, text: str) -> str:
    """``text`` if it is a valid lock key, else ``sha256:<hex>`` of it.

    A rendered key longer than 255 characters, not valid UTF-8, or otherwise
    refused as a key, becomes the digest of the template and the text; a
    rendered key that itself starts with ``sha256:`` is hashed too, so no
    input names another input's digest.
    """
    if not text.startswith("sha256:") and len(text) <= MAX_KEY_LENGTH:
        try:
            text.encode("utf-8")
            make_key(text)
        except (UnicodeEncodeError, InvalidLockKey):
            pass
        else:
            return text
    data = f"{template}\x00{text}".encode("utf-8", "surrogatepass")
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _template(key: str, name: str, parameters: inspect.Signature) -> KeyTemplate:
    try:
        template = KeyTemplate.parse(key)
    except KeyTemplateError as exc:
        raise LockedTaskError(f"task {name}: {exc}") from None
    usable = {
        p.name
        for p in parameters.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    unknown = [n for n in template.names if n not in usable]
    if unknown:
        raise LockedTaskError(
            f"task {name}: the key {key!r} names {', '.join(map(repr, unknown))}, which is "
            f"not a named argument of the task ({', '.join(parameters.parameters) or 'none'})"
        )
    parts = template.parts
    for i, (_, field) in enumerate(parts):
        if field is None or i + 1 == len(parts):
            continue
        after = parts[i + 1][0]
        if not after or after[0] in _NUMBER_CHARS:
            raise LockedTaskError(
                f"task {name}: in the key {key!r}, {{{field}}} is followed by "
                f"{'another field' if not after else repr(after[0])}, so two calls could give "
                "the same key (12 then 3, or 1 then 23): put a separator such as ':' after it"
            )
    return template


def _spec(
    func: Callable[..., Any],
    *,
    key: KeyOption,
    on_busy: str,
    retry_after: float,
    permits: int | None,
    ttl: float | None,
    timeout: float,
    using: str | None,
    takes_context: bool,
) -> LockSpec:
    name = f"{func.__module__}.{func.__qualname__}"
    if on_busy not in ON_BUSY:
        raise LockedTaskError(f'task {name}: on_busy must be "skip" or "retry", got {on_busy!r}')
    if (
        isinstance(retry_after, bool)
        or not isinstance(retry_after, int | float)
        or not retry_after > 0
    ):
        raise LockedTaskError(
            f"task {name}: retry_after must be a positive number of seconds, got {retry_after!r}"
        )
    signature = inspect.signature(func)
    if takes_context:
        params = list(signature.parameters.values())
        if not params or params[0].name != "context":
            raise LockedTaskError(
                f"task {name} takes its context (takes_context=True), so its first "
                "argument must be named 'context'"
            )
        signature = signature.replace(parameters=params[1:])
    template = None
    if isinstance(key, str):
        template = _template(key, name, signature)
        if not template.names:
            key = template.render({})  # "{{" and "}}" are literal braces
    elif key is not None and not callable(key):
        raise LockedTaskError(
            f"task {name}: key must be a string, a format string over the task's arguments "
            f"or a callable of them, not {type(key).__name__}"
        )
    spec = LockSpec(
        name=name,
        key=key,
        template=template,
        parameters=signature,
        on_busy=on_busy,  # type: ignore[arg-type]
        retry_after=float(retry_after),
        permits=permits,
        ttl=ttl,
        timeout=timeout,
        using=using,
        takes_context=takes_context,
    )
    try:  # the lock's own checks (ttl, timeout, permits, using), before any run
        spec.lock(f"tasks:{name}" if template is None or template.names else str(key))
    except (TypeError, ValueError, DLockError) as exc:
        raise LockedTaskError(f"task {name}: {exc}") from exc
    return spec


def guard(using: str | None = None) -> contextlib.AbstractContextManager[None]:
    """In a locked task's body: a transaction whose writes commit only while
    this run holds its lock (see ``Lock.guard()``)::

        @locked_task(key="charge:{invoice_id}")
        def charge(invoice_id):
            total = compute(invoice_id)                  # may take long
            with guard():                                # only while this run holds it
                Invoice.objects.filter(pk=invoice_id).update(total=total)

    Raises:
        DLockError: called outside the running body of a locked task.
        LockLost: the run's lock was lost; nothing of the block was written.
    """
    lk = _RUNNING.get()
    if lk is None:
        raise DLockError(
            "django_dlock.contrib.tasks.guard() is for the body of a running @locked_task"
        )
    return lk.guard(using)


def _split(spec: LockSpec, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:
    """(context or None, the arguments for the function, the task's own arguments)."""
    if args and isinstance(args[0], TaskContext):
        context, own = args[0], args[1:]
        return context, (args if spec.takes_context else own), own
    if spec.takes_context:  # a direct call of a task that takes its context
        return (args[0] if args else None), args, args[1:]
    return None, args, args


def _doing(spec: LockSpec, context: Any) -> str:
    result_id = getattr(getattr(context, "task_result", None), "id", None)
    return f"task {spec.name}[{result_id}]" if result_id else f"task {spec.name}"


def _running_task(spec: LockSpec, context: Any, fallback: Task) -> Task:  # type: ignore[type-arg]
    task = getattr(getattr(context, "task_result", None), "task", None)
    return task if isinstance(task, Task) else fallback


def _skipped(spec: LockSpec, lk: Lock, context: Any) -> None:
    logger.info("django-dlock: skipped task %s: %s %s", spec.name, lk.name, why_busy())
    result_id = getattr(getattr(context, "task_result", None), "id", None)
    signals.lock_skipped.send(
        LockedTask, name=lk.name, reason="held", task=spec.name, result_id=result_id
    )


def _retry_task(spec: LockSpec, lk: Lock, task: Task) -> Task:  # type: ignore[type-arg]
    when = timezone.now() + datetime.timedelta(seconds=spec.retry_after)
    logger.info(
        "django-dlock: %s %s: task %s runs again in %g s",
        lk.name,
        why_busy(),
        spec.name,
        spec.retry_after,
    )
    return task.using(run_after=when)


def _wrap(func: Callable[..., Any], spec: LockSpec, cell: list[Task]) -> Callable[..., Any]:  # type: ignore[type-arg]
    """The function the framework runs: takes the lock, then calls ``func``."""
    if inspect.iscoroutinefunction(func):

        async def arun(*args: Any, **kwargs: Any) -> Any:
            context, call_args, own = _split(spec, args)
            lk = spec.lock(spec.lock_key(own, kwargs))

            async def body() -> Any:
                token = _RUNNING.set(lk)
                try:
                    return await func(*call_args, **kwargs)
                finally:
                    _RUNNING.reset(token)

            async def busy() -> None:
                if spec.on_busy == "retry":
                    task = _retry_task(spec, lk, _running_task(spec, context, cell[0]))
                    await task.aenqueue(*own, **kwargs)
                else:
                    _skipped(spec, lk, context)

            with doing(_doing(spec, context)):
                return await aguarded_call(lk, body, busy, stream=False)

        run: Callable[..., Any] = arun
    else:

        def srun(*args: Any, **kwargs: Any) -> Any:
            context, call_args, own = _split(spec, args)
            lk = spec.lock(spec.lock_key(own, kwargs))

            def body() -> Any:
                token = _RUNNING.set(lk)
                try:
                    return func(*call_args, **kwargs)
                finally:
                    _RUNNING.reset(token)

            def busy() -> None:
                if spec.on_busy == "retry":
                    task = _retry_task(spec, lk, _running_task(spec, context, cell[0]))
                    task.enqueue(*own, **kwargs)
                else:
                    _skipped(spec, lk, context)

            with doing(_doing(spec, context)):
                return guarded_call(lk, body, busy, stream=False)

        run = srun
    # The framework finds the task by its function's module and qualified name
    # (the module attribute is then the task), and checks that a task taking
    # its context names it first: the signature says so, without __wrapped__,
    # which would lead inspect back to ``func``.
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(run, attr, getattr(func, attr))
    run.__dict__.update(getattr(func, "__dict__", {}))
    context_param = inspect.Parameter("context", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            context_param,
            inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
    )
    run.dlock_spec = spec  # type: ignore[attr-defined]
    run.dlock_function = func  # type: ignore[attr-defined]
    return run


class LockedTask(Task):  # type: ignore[type-arg]
    """The task :func:`locked_task` returns: the framework's ``Task``, whose
    ``enqueue()`` refuses ``on_busy="retry"`` on a backend that cannot defer."""

    __slots__ = ()

    @property
    def lock_spec(self) -> LockSpec:
        """The lock options of this task."""
        spec: LockSpec = self.func.dlock_spec  # type: ignore[attr-defined]
        return spec

    def enqueue(self, *args: Any, **kwargs: Any) -> Any:
        self.lock_spec.check_backend(self)
        return super().enqueue(*args, **kwargs)

    async def aenqueue(self, *args: Any, **kwargs: Any) -> Any:
        self.lock_spec.check_backend(self)
        return await super().aenqueue(*args, **kwargs)


_CLASSES: dict[type, type] = {Task: LockedTask}


def _locked_class(base: type) -> type:
    """``LockedTask`` for the framework's ``Task``; for a backend's own task
    class, a class of both (``LockedTask``'s checks first, then the backend's)."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(f"Locked{base.__name__}", (LockedTask, base), {"__slots__": ()})
        _CLASSES[base] = cls
    return cls


def locked_task(
    function: Callable[..., Any] | None = None,
    *,
    key: KeyOption = None,
    on_busy: Literal["skip", "retry"] = "skip",
    retry_after: float = 5,
    permits: int | None = None,
    ttl: float | None = None,
    timeout: float = 0,
    using: str | None = None,
    takes_context: bool = False,
    **task_options: Any,
) -> Any:
    """Like the framework's ``@task``: a task that runs one (or ``permits``)
    at a time per key across every worker.

    Args:
        key: the lock key: a string, a format string over the task's
            arguments (``"charge:{account_id}"``; each value written as a JSON
            literal, so distinct values give distinct keys), or a callable of
            the task's arguments (without the context) returning the key.
            Default: ``"tasks:<module>.<function>"``.
        on_busy: ``"skip"``: a run that finds the key busy ends at once,
            successfully, returning ``None`` (the ``lock_skipped`` signal,
            a log line); ``"retry"``: it is enqueued again to run
            ``retry_after`` seconds later (``run_after``).
        retry_after: seconds before a busy run runs again (``on_busy="retry"``).
        permits: let up to this many bodies (per key) run at once, a
            :class:`~django_dlock.Semaphore`; ``None``: one.
        ttl: the lease in seconds, renewed at about a third of it while the
            body runs (default ``DLOCK_DEFAULT_TTL``): a worker that dies frees
            the key within ``ttl`` seconds.
        timeout: seconds a run waits for the key before it skips or retries
            (default: one try).
        using: the database alias of the lock (default: the router's choice).
        takes_context: as for ``@task``: the function receives the task's
            context first.
        **task_options: the framework's own (``priority``, ``queue_name``,
            ``backend``, ...), passed on.

    Raises:
        LockedTaskError: an option cannot work (at definition), or the task
            is enqueued with ``on_busy="retry"`` on a backend that cannot
            defer a run.
    """

    def decorate(func: Callable[..., Any]) -> Task:  # type: ignore[type-arg]
        spec = _spec(
            func,
            key=key,
            on_busy=on_busy,
            retry_after=retry_after,
            permits=permits,
            ttl=ttl,
            timeout=timeout,
            using=using,
            takes_context=takes_context,
        )
        cell: list[Task] = []  # type: ignore[type-arg]
        run = _wrap(func, spec, cell)
        plain = framework_task(run, takes_context=True, **task_options)
        cls = _locked_class(type(plain))
        made = cls(**{f.name: getattr(plain, f.name) for f in fields(plain)})
        spec.check_backend(made)
        cell.append(made)
        return made  # type: ignore[no-any-return]

    if function is not None:
        return decorate(function)
    return decorate
