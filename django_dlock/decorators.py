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

import functools
import hashlib
import inspect
import string
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from asgiref.sync import async_to_sync
from django.db import connections
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from django_dlock.conf import strategy_error, timeout_error, ttl_error
from django_dlock.exceptions import InvalidLockKey, LockTimeout, StrategyNotSupported
from django_dlock.identity import Holder, current_holder, current_task
from django_dlock.keys import make_key
from django_dlock.locks import Lock

__all__ = [
    "Contention",
    "KeyTemplate",
    "KeyTemplateError",
    "MissingKeyArgument",
    "locked_response",
    "with_lock",
]

F = TypeVar("F", bound=Callable[..., Any])

#: a status code, ``"wait"``, or a callable ``(Contention) -> response``
ContentionPolicy = int | str | Callable[["Contention"], Any]


class KeyTemplateError(InvalidLockKey):
    """A key template is malformed, or uses more than plain argument names."""


class MissingKeyArgument(KeyTemplateError, LookupError):
    """A key template names an argument that the call does not have.

    Raised instead of filling the gap with an empty value, which would make
    every such call share one lock.
    """


# -- key templates -----------------------------------------------------------


@dataclass(frozen=True)
class KeyTemplate:
    """A parsed key template such as ``"invoice:{invoice_id}"``.

    Only plain names are allowed between braces; ``{{`` and ``}}`` are
    literal braces. Values are inserted with ``str()``, never formatted
    again, so a value cannot inject a field of its own.
    """

    template: str
    parts: tuple[tuple[str, str | None], ...]

    @classmethod
    def parse(cls, template: str) -> KeyTemplate:
        """Parse ``template``.

        Raises:
            KeyTemplateError: the template is not a string, has unbalanced
                braces, or uses anything but plain names between braces.
        """
        if not isinstance(template, str):
            raise KeyTemplateError(
                f"a key template must be a string, not {type(template).__name__}"
            )
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise KeyTemplateError(f"key template {template!r} is malformed: {exc}") from None
        parts: list[tuple[str, str | None]] = []
        for literal, name, spec, conversion in parsed:
            if name is None:
                parts.append((literal, None))
                continue
            if not name.isidentifier() or spec or conversion is not None:
                shown = "{" + name + ("!" + conversion if conversion else "")
                shown += (":" + spec if spec else "") + "}"
                raise KeyTemplateError(
                    f"key template {template!r} uses {shown}: only plain argument names such "
                    "as {invoice_id} are allowed (no attribute or index access, no positional "
                    "fields, no conversions or format specifications); use a callable key "
                    "for anything else"
                )
            parts.append((literal, name))
        return cls(template=template, parts=tuple(parts))

    @property
    def names(self) -> tuple[str, ...]:
        """The argument names the template uses, in order, without repeats."""
        return tuple(dict.fromkeys(name for _, name in self.parts if name is not None))

    def render(self, values: Mapping[str, Any], where: str = "the call") -> str:
        """Fill the template from ``values``.

        Raises:
            MissingKeyArgument: a name is not in ``values``.
        """
        out: list[str] = []
        for literal, name in self.parts:
            out.append(literal)
            if name is None:
                continue
            if name not in values:
                have = ", ".join(sorted(values)) or "none"
                raise MissingKeyArgument(
                    f"the lock key template {self.template!r} names {{{name}}}, but {where} "
                    f"has no argument {name!r} (it has: {have})"
                )
            out.append(str(values[name]))
        return fit_key("".join(out))


def fit_key(text: str) -> str:
    """Return ``text`` if it is a valid key, else a stable digest of it.

    A key rendered from request data may be empty, longer than 255
    characters or contain a NUL byte; such a key becomes
    ``"sha256:<hex>"`` instead of an error. A rendered key that itself
    starts with ``"sha256:"`` is hashed too, so no input can name the lock
    of another input's digest: distinct inputs stay distinct locks.
    """
    try:
        make_key(text)
    except InvalidLockKey:
        return _digest(text)
    return _digest(text) if text.startswith(_DIGEST_PREFIX) else text


_DIGEST_PREFIX = "sha256:"


def _digest(text: str) -> str:
    return _DIGEST_PREFIX + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# -- contention ----------------------------------------------------------------


@dataclass
class Contention:
    """What an ``on_contention`` callable is given when the key is held.

    Attributes:
        request: the request (``None`` when a plain function was decorated).
        resource: the key as text without namespace (what a 423 body names).
        lock: the :class:`~django_dlock.locks.Lock` that could not be acquired.
        retry_after: seconds for a ``Retry-After`` header (``None``: no header).
        args: the positional arguments of the call.
        kwargs: the keyword arguments of the call (URL kwargs for a view).
    """

    request: HttpRequest | None
    resource: str
    lock: Lock
    retry_after: int | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def response(self, status: int = 423) -> HttpResponse:
        """The default answer: ``status`` with a body naming the resource."""
        return locked_response(self.resource, status=status, retry_after=self.retry_after)


def locked_response(
    resource: str, *, status: int = 423, retry_after: int | None = 1
) -> HttpResponse:
    """A plain-text response saying that ``resource`` is locked.

    ``423 Locked`` by default, with a ``Retry-After`` header unless
    ``retry_after`` is ``None``.
    """
    body = f'The resource "{resource}" is locked by another request.'
    if retry_after is not None:
        body += f" Retry after {retry_after} s."
    response = HttpResponse(body + "\n", status=status, content_type="text/plain; charset=utf-8")
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response


def contention_policy_error(value: object, timeout: object) -> str | None:
    """Return why ``value`` is not a valid ``on_contention``, or ``None``."""
    if callable(value):
        return None
    if value == "wait":
        if timeout == 0:
            return (
                'on_contention="wait" needs a timeout: seconds > 0, or None to wait '
                "without limit (the default timeout=0 never waits)"
            )
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return (
            'on_contention must be an HTTP status code, "wait" or a callable '
            f"(Contention) -> response, not {value!r}"
        )
    if not 400 <= value <= 599:
        return f"on_contention status must be an HTTP error status (400-599), got {value}"
    return None


def options_error(
    *, timeout: object, ttl: object, strategy: object, using: object
) -> Exception | None:
    """The error for explicit lock options that are invalid, or ``None``.

    Reads no ``DLOCK_*`` setting: only the values given are checked.
    """
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
        f"unknown database alias {using!r}"
        if using is not None and using not in connections
        else None,
    ):
        if problem is not None:
            return ValueError(problem)
    return None


def retry_after_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``retry_after`` (None or int >= 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"retry_after must be None or whole seconds >= 0, got {value!r}"
    return None


def resource_of(lk: Lock) -> str:
    """The lock's key(s) as text, without the namespace prefix."""
    return ", ".join(key.unqualified for key in lk.keys)


def _is_streaming(result: object) -> bool:
    return isinstance(result, HttpResponseBase) and bool(result.streaming)


def release_as(lk: Lock, holder: Holder) -> None:
    """Release ``lk`` for ``holder`` (the thread or task that acquired it).

    Used when the release happens elsewhere than the acquisition: a
    streaming response is closed by the server after the view returned,
    possibly in another thread.
    """
    lk.release_for(holder)


def _release_in_thread(func: Callable[[], None]) -> None:
    """Run blocking database work off the event loop, and wait for it."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            func()
        except BaseException as exc:
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="django-dlock-release")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]


def release_on_close(response: HttpResponseBase, lk: Lock, holder: Holder) -> None:
    """Release ``lk`` when ``response`` is closed (after its stream was sent).

    Django calls a response's resource closers from ``close()``, before the
    ``request_finished`` signal closes the database connection.
    """
    done = False

    def close() -> None:
        nonlocal done
        if done:
            return
        done = True
        if current_task() is not None:
            # close() called from an event loop (an async test client):
            # the release blocks, so run it in a thread of its own.
            _release_in_thread(lambda: release_as(lk, holder))
        else:
            release_as(lk, holder)

    response._resource_closers.append(close)  # type: ignore[attr-defined]


# -- the decorator ---------------------------------------------------------------


def _request_of(args: tuple[Any, ...]) -> HttpRequest | None:
    if not args:
        return None
    first = args[0]
    if isinstance(first, HttpRequest):
        return first
    wrapped = getattr(first, "_request", None)  # e.g. a DRF Request
    return wrapped if isinstance(wrapped, HttpRequest) else None


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
        error = options_error(timeout=timeout, ttl=ttl, strategy=strategy, using=using)
        if error is not None:
            raise error
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

    def contended(self, c: Contention) -> Any:
        policy = self.on_contention
        if callable(policy):
            if inspect.iscoroutinefunction(policy):
                return async_to_sync(policy)(c)
            return policy(c)
        return self._default(c)

    async def acontended(self, c: Contention) -> Any:
        policy = self.on_contention
        if callable(policy):
            result = policy(c)
            if inspect.isawaitable(result):
                result = await result
            return result
        return self._default(c)

    def _default(self, c: Contention) -> Any:
        if c.request is None:
            raise LockTimeout(f"could not acquire {c.lock.name!r} within {c.lock.timeout} s")
        status = 423 if self.on_contention == "wait" else cast(int, self.on_contention)
        return c.response(status)

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

    def _wrap_sync(
        self, func: Callable[..., Any], sig: inspect.Signature | None
    ) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = _request_of(args)
            lk = self.lock_for(sig, request, args, kwargs)
            if not lk.acquire():
                return self.contended(self.contention(lk, request, args, kwargs))
            holder = current_holder()
            try:
                result = func(*args, **kwargs)
            except BaseException as exc:
                lk.__exit__(type(exc), exc, None)
                raise
            if _is_streaming(result):
                release_on_close(result, lk, holder)
            else:
                lk.__exit__(None, None, None)
            return result

        return wrapper

    def _wrap_async(
        self, func: Callable[..., Any], sig: inspect.Signature | None
    ) -> Callable[..., Any]:
        @functools.wraps(func)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            request = _request_of(args)
            lk = self.lock_for(sig, request, args, kwargs)
            if not await lk.aacquire():
                return await self.acontended(self.contention(lk, request, args, kwargs))
            holder = current_holder()
            try:
                result = await func(*args, **kwargs)
            except BaseException as exc:
                await lk.__aexit__(type(exc), exc, None)
                raise
            if _is_streaming(result):
                release_on_close(result, lk, holder)
            else:
                await lk.__aexit__(None, None, None)
            return result

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

    Raises:
        KeyTemplateError: the template is malformed or uses more than plain
            names (at decoration).
        MissingKeyArgument: the template names an argument that the
            decorated function cannot receive (at decoration), or that a
            call does not have (at the call).
        ValueError: an option is out of range (at decoration).
        StrategyNotSupported: ``strategy`` is unknown (at decoration).

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
    )

    def decorator(func: F) -> F:
        return options.wrap(func)

    return decorator
