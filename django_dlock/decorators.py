"""``with_lock``: serialise views (and plain functions) on a lock key.

::

    from django_dlock.decorators import with_lock

    @with_lock("invoice:{invoice_id}")            # key from the URL kwargs
    def pay_invoice(request, invoice_id): ...

    @with_lock("invoice:{invoice_id}", on_contention="wait", timeout=10)
    async def refresh_invoice(request, invoice_id): ...

    @method_decorator(with_lock(lambda request, *a, **kw: f"cart:{request.user.pk}"),
                      name="post")
    class CheckoutView(View): ...

The decorator builds on :func:`django_dlock.lock`: it acquires before the
view runs and releases when the view returns its response, or, for a
streaming response, when the response is closed (the server has sent the
stream). When the key is held by someone else the view is not called: the
client gets ``423 Locked`` with a ``Retry-After`` header, another status, a
response of your own, or the request waits (``on_contention="wait"``).

Key templates name only plain arguments (``{invoice_id}``): attribute and
index access (``{request.user.password}``, ``{0}``, ``{a[b]}``) and format
specifications are refused when the decorator is created, and a template
that names an argument the call does not have raises
:class:`MissingKeyArgument` instead of locking a key shared by every call.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from django.http import HttpRequest

# Key templates and contention answers are made in django_dlock._http
# (private); this module is their public home.
from django_dlock._http import (
    Contention,
    ContentionPolicy,
    KeyTemplate,
    aanswer_contention,
    aguarded_call,
    answer_contention,
    fit_key,
    guarded_call,
    locked_response,
    release_as,
    release_on_close,
    request_label,
    resource_of,
)
from django_dlock.exceptions import (
    MissingKeyArgument,
    StrategyNotSupported,
)
from django_dlock.identity import doing
from django_dlock.locks import Lock
from django_dlock.validation import (
    alias_error,
    contention_policy_error,
    permits_error,
    retry_after_error,
    strategy_error,
    timeout_error,
    ttl_error,
)

__all__ = [
    "Contention",
    "ContentionPolicy",
    "KeyTemplate",
    "fit_key",
    "locked_response",
    "options_error",
    "release_as",
    "release_on_close",
    "resource_of",
    "with_lock",
]

F = TypeVar("F", bound=Callable[..., Any])


def options_error(
    *, timeout: object, ttl: object, strategy: object, using: object, permits: object = None
) -> Exception | None:
    """The error for explicit lock options that are invalid, or ``None``.

    Reads no ``DLOCK_*`` setting: only the values given are checked.
    ``permits`` (not ``None``): the lock is a semaphore of that many permits.
    """
    if permits is not None:
        problem = permits_error(permits)
        if problem is not None:
            return ValueError(problem)
        from django_dlock.semaphores import semaphore_error

        refused = semaphore_error(strategy=strategy, using=using)
        if refused is not None:
            return refused
    if using is not None and not isinstance(using, str):  # a quorum: using=[...]
        from django_dlock.locks import _quorum_of

        try:
            _quorum_of(using, strategy if isinstance(strategy, str) else None)
        except (ValueError, StrategyNotSupported) as exc:
            return exc
        using = None
    if strategy is not None:
        problem = strategy_error(strategy)
        if problem is not None:
            return StrategyNotSupported(problem)
    for problem in (
        ttl_error(ttl) if ttl is not None else None,
        timeout_error(timeout),
        alias_error(using) if using is not None else None,
    ):
        if problem is not None:
            return ValueError(problem)
    return None


# -- the decorator ---------------------------------------------------------------


def _request_of(args: tuple[Any, ...]) -> HttpRequest | None:
    if not args:
        return None
    first = args[0]
    if isinstance(first, HttpRequest):
        return first
    wrapped = getattr(first, "_request", None)  # e.g. a DRF Request
    return wrapped if isinstance(wrapped, HttpRequest) else None


def _doing(request: HttpRequest | None) -> contextlib.AbstractContextManager[None]:
    """For a view: its locks' owner text names the request (``POST /invoice/42/``)."""
    if request is None:
        return contextlib.nullcontext()
    return doing(request_label(request))


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    try:
        # method_decorator hands over a partial of the bound method whose
        # __wrapped__ is the unbound function: read the partial itself.
        follow = not isinstance(func, functools.partial)
        return inspect.signature(func, follow_wrapped=follow)
    except (TypeError, ValueError):
        return None


def _call_values(
    sig: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A plain function's arguments by name (``**kwargs`` flattened)."""
    if sig is None:
        return dict(kwargs)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return dict(kwargs)
    bound.apply_defaults()
    values: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            values.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            values[name] = value
    return values


class _WithLock:
    """The validated options of one ``with_lock(...)`` call."""

    def __init__(
        self,
        key: str | Callable[..., Any],
        *,
        timeout: float | None,
        ttl: float | None,
        strategy: str | None,
        using: str | list[str] | tuple[str, ...] | None,
        on_contention: ContentionPolicy,
        retry_after: int | None,
        permits: int | None = None,
    ) -> None:
        if callable(key):
            self.template: KeyTemplate | None = None
            self.key_func: Callable[..., Any] | None = key
        else:
            self.template = KeyTemplate.parse(key)
            self.key_func = None
        self.options: dict[str, Any] = {
            "timeout": timeout,
            "ttl": ttl,
            "strategy": strategy,
            "using": using,
        }
        # Explicit arguments are checked now; values that come from settings
        # (DLOCK_DEFAULT_*) are read and checked at the first call, so that
        # importing a module of decorated views never fails on settings and
        # ``manage.py check`` can report them (dlock.E001-E004).
        error = options_error(
            timeout=timeout, ttl=ttl, strategy=strategy, using=using, permits=permits
        )
        if error is not None:
            raise error
        self.permits = permits
        problem = contention_policy_error(on_contention, timeout)
        if problem is None:
            problem = retry_after_error(retry_after)
        if problem is not None:
            raise ValueError(problem)
        self.on_contention = on_contention
        self.retry_after = retry_after

    # -- per call ------------------------------------------------------------

    def lock_for(
        self,
        sig: inspect.Signature | None,
        request: HttpRequest | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Lock:
        if self.key_func is not None:
            key = self.key_func(*args, **kwargs)
        else:
            assert self.template is not None
            if request is not None:
                key = self.template.render(kwargs, where="the view's URL kwargs")
            else:
                key = self.template.render(_call_values(sig, args, kwargs))
        if self.permits is not None:
            from django_dlock.semaphores import Semaphore

            return Semaphore(key, permits=self.permits, **self.options)
        return Lock(key, **self.options)

    def contention(
        self, lk: Lock, request: HttpRequest | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Contention:
        return Contention(
            request=request,
            resource=resource_of(lk),
            lock=lk,
            retry_after=self.retry_after,
            args=args,
            kwargs=kwargs,
        )

    # -- wrapping -------------------------------------------------------------

    def check_names(self, func: Callable[..., Any], sig: inspect.Signature | None) -> None:
        if self.template is None or sig is None:
            return
        params = sig.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return
        known = set(sig.parameters)
        for name in self.template.names:
            if name not in known:
                raise MissingKeyArgument(
                    f"the lock key template {self.template.template!r} names {{{name}}}, but "
                    f"{getattr(func, '__qualname__', func)!r} has no parameter {name!r}"
                )

    def wrap(self, func: F) -> F:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                "with_lock cannot hold a lock while a generator is iterated; decorate "
                "the function that consumes it, or return a StreamingHttpResponse"
            )
        sig = _signature(func)
        self.check_names(func, sig)
        if inspect.iscoroutinefunction(func):
            return cast(F, self._wrap_async(func, sig))
        return cast(F, self._wrap_sync(func, sig))

    def _prepare(
        self, sig: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Lock, Callable[[], Contention]]:
        """The lock for one call, and how to describe its contention."""
        request = _request_of(args)
        lk = self.lock_for(sig, request, args, kwargs)
        return lk, lambda: self.contention(lk, request, args, kwargs)

    def _wrap_sync(
        self, func: Callable[..., Any], sig: inspect.Signature | None
    ) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            lk, contention = self._prepare(sig, args, kwargs)
            refused = lambda: answer_contention(self.on_contention, contention())  # noqa: E731
            with _doing(_request_of(args)):
                return guarded_call(lk, lambda: func(*args, **kwargs), refused)

        return wrapper

    def _wrap_async(
        self, func: Callable[..., Any], sig: inspect.Signature | None
    ) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            lk, contention = self._prepare(sig, args, kwargs)
            refused = lambda: aanswer_contention(self.on_contention, contention())  # noqa: E731
            with _doing(_request_of(args)):
                return await aguarded_call(lk, lambda: func(*args, **kwargs), refused)

        return wrapper


def with_lock(
    key: str | Callable[..., Any],
    *,
    timeout: float | None = 0,
    ttl: float | None = None,
    strategy: str | None = None,
    using: str | list[str] | tuple[str, ...] | None = None,
    on_contention: ContentionPolicy = 423,
    retry_after: int | None = 1,
    permits: int | None = None,
) -> Callable[[F], F]:
    """Hold a lock while a view (or a plain function) runs.

    Works on function views, class-based views (with ``method_decorator``),
    async views and plain functions.

    Args:
        key: a template filled from the view's URL kwargs, e.g.
            ``"invoice:{invoice_id}"`` (for a plain function: from its
            arguments by name), or a callable called with the view's
            arguments ``(request, *args, **kwargs)`` (a plain function's
            arguments) that returns a key (string, two-part tuple, model
            instance, or list of those).
        timeout: seconds to wait for the lock: ``0`` (default) tries once,
            ``None`` waits without limit.
        ttl: lease length in seconds (``DLOCK_DEFAULT_TTL``). It must cover
            the view, and for a streaming response the whole stream.
        strategy: lock strategy (``DLOCK_DEFAULT_STRATEGY``).
        using: database alias (default: the router's choice for the
            ``Lock`` model), or a list of aliases for a quorum lock.
        on_contention: what a view answers when the key stays held:
            an HTTP status (default ``423`` Locked, with a body naming the
            resource and a ``Retry-After`` header); ``"wait"`` to wait up to
            ``timeout`` (which must then be given) and answer 423 if still
            held; or a callable ``(Contention) -> response`` (may be async
            for async views). A plain function raises
            :class:`~django_dlock.LockTimeout` unless given a callable,
            whose return value it then returns.
        retry_after: seconds for the ``Retry-After`` header (``None``: no
            header).
        permits: let up to this many calls run at once (a
            :class:`~django_dlock.Semaphore` of the key): the next one gets
            the contention answer (423) while all permits are taken.

    Raises:
        KeyTemplateError: the template is malformed or uses more than plain
            names (at decoration).
        MissingKeyArgument: the template names an argument that the
            decorated function cannot receive (at decoration), or that a
            call does not have (at the call).
        ValueError: an option is out of range (at decoration).
        StrategyNotSupported: ``strategy`` is unknown (at decoration);
            :class:`~django_dlock.SemaphoreNotSupported` with ``permits``, a
            strategy other than ``lease`` or a quorum.

    Options left out are read from the ``DLOCK_DEFAULT_*`` settings at the
    first call, never at decoration: importing a module of decorated views
    does not fail on a bad setting, and ``manage.py check`` reports it.
    """
    options = _WithLock(
        key,
        timeout=timeout,
        ttl=ttl,
        strategy=strategy,
        using=using,
        on_contention=on_contention,
        retry_after=retry_after,
        permits=permits,
    )

    def decorator(func: F) -> F:
        return options.wrap(func)

    return decorator
