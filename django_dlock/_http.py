"""The HTTP side of a lock: key templates, contention answers, the guarded call.

Shared by :func:`~django_dlock.decorators.with_lock`, by
:class:`~django_dlock.middleware.LockMiddleware` and by a
:class:`~django_dlock.locks.Lock` used as a decorator:

* **key templates** such as ``"invoice:{invoice_id}"``, filled from a
  call's arguments, never formatted twice (:class:`KeyTemplate`);
* **contention**: what a caller answers when the key stays held
  (:class:`Contention`, ``423 Locked`` with ``Retry-After`` by default);
* **the guarded call**: acquire, call, then release at once, or, for a
  streaming response, when the server closes it (:func:`guarded_call`,
  :func:`aguarded_call`, and :func:`call_holding` when the acquisition
  happened elsewhere, as in the middleware's ``process_view``).
"""

from __future__ import annotations

import hashlib
import inspect
import string
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from asgiref.sync import async_to_sync, iscoroutinefunction
from django.http import HttpRequest, HttpResponse, HttpResponseBase

from django_dlock._threads import start_db_thread
from django_dlock.exceptions import (
    InvalidLockKey,
    KeyTemplateError,
    LockTimeout,
    MissingKeyArgument,
)
from django_dlock.identity import Holder, current_holder, current_task
from django_dlock.keys import make_key

if TYPE_CHECKING:
    from django_dlock.locks import Lock

__all__ = [
    "Contention",
    "ContentionPolicy",
    "KeyTemplate",
    "aanswer_contention",
    "acall_holding",
    "aguarded_call",
    "answer_contention",
    "call_holding",
    "fit_key",
    "guarded_call",
    "is_streaming",
    "locked_response",
    "release_on_close",
    "resource_of",
]

R = TypeVar("R")

#: a status code, ``"wait"``, or a callable ``(Contention) -> response``
ContentionPolicy = int | str | Callable[["Contention"], Any]

#: what the guarded call must give back: the lock and the holder that took it
Held = tuple["Lock", Holder]


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


def request_label(request: HttpRequest) -> str:
    """How a lock's owner names the request it was taken for: method and path
    (never the query string)."""
    return f"{request.method} {request.path}"


def resource_of(lk: Lock) -> str:
    """The lock's key(s) as text, without the namespace prefix."""
    return ", ".join(key.unqualified for key in lk.keys)


def answer_contention(policy: ContentionPolicy, contention: Contention) -> Any:
    """What a caller answers when the key stays held (sync).

    A callable policy is called (an async one through ``async_to_sync``);
    otherwise a request gets :meth:`Contention.response` (the policy's
    status, ``423`` for ``"wait"``), and a plain function call raises
    :class:`~django_dlock.LockTimeout`.
    """
    if callable(policy):
        if iscoroutinefunction(policy):
            return async_to_sync(policy)(contention)
        return policy(contention)
    return _default_answer(policy, contention)


async def aanswer_contention(policy: ContentionPolicy, contention: Contention) -> Any:
    """Async :func:`answer_contention` (a callable's awaitable result is awaited)."""
    if callable(policy):
        result = policy(contention)
        if inspect.isawaitable(result):
            result = await result
        return result
    return _default_answer(policy, contention)


def _default_answer(policy: ContentionPolicy, c: Contention) -> HttpResponse:
    if c.request is None:
        raise LockTimeout(f"could not acquire {c.lock.name!r} within {c.lock.timeout} s")
    return c.response(policy if isinstance(policy, int) else 423)


# -- the guarded call --------------------------------------------------------------


def is_streaming(result: object) -> bool:
    """Whether ``result`` is a streaming response (sent after the view returned)."""
    return isinstance(result, HttpResponseBase) and bool(result.streaming)


def release_as(lk: Lock, holder: Holder) -> None:
    """Release ``lk`` for ``holder`` (the thread or task that acquired it).

    Used when the release happens elsewhere than the acquisition: a
    streaming response is closed by the server after the view returned,
    possibly in another thread.
    """
    lk.release_for(holder)


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
            _in_own_thread(lambda: release_as(lk, holder))
        else:
            release_as(lk, holder)

    response._resource_closers.append(close)  # type: ignore[attr-defined]


def _in_own_thread(func: Callable[[], None]) -> None:
    """Run blocking database work off the event loop, wait for it, re-raise its error."""
    box: dict[str, BaseException] = {}

    def run() -> None:
        try:
            func()
        except BaseException as exc:
            box["error"] = exc

    start_db_thread(run, "django-dlock-release", daemon=False).join()
    if "error" in box:
        raise box["error"]


def _to_release(held: Held | None, result: object, stream: bool) -> Lock | None:
    """The lock to release now, or ``None`` (not held, or released when the stream closes)."""
    if held is None:
        return None
    lk, holder = held
    if stream and is_streaming(result):
        release_on_close(cast(HttpResponseBase, result), lk, holder)
        return None
    return lk


def call_holding(
    call: Callable[[], R], held: Callable[[], Held | None], *, stream: bool = True
) -> R:
    """Run ``call``, then release the lock that ``held()`` names (if any).

    ``held`` is asked after the call (the middleware learns then whether its
    ``process_view`` took a lock). With ``stream``, a streaming response keeps
    the lock until it is closed. Leaving raises
    :class:`~django_dlock.LockLost` if the lock was lost, unless ``call``
    raised: its own exception is never hidden.
    """
    try:
        result = call()
    except BaseException as exc:
        found = held()
        if found is not None:
            found[0]._leave(exc)
        raise
    lk = _to_release(held(), result, stream)
    if lk is not None:
        lk._leave(None)
    return result


async def acall_holding(
    call: Callable[[], Awaitable[R]], held: Callable[[], Held | None], *, stream: bool = True
) -> R:
    """Async :func:`call_holding`."""
    try:
        result = await call()
    except BaseException as exc:
        found = held()
        if found is not None:
            await found[0]._aleave(exc)
        raise
    lk = _to_release(held(), result, stream)
    if lk is not None:
        await lk._aleave(None)
    return result


def guarded_call(
    lk: Lock, call: Callable[[], R], contended: Callable[[], R], *, stream: bool = True
) -> R:
    """Acquire ``lk``, run ``call`` holding it, release it; ``contended()`` if it stays held."""
    if not lk.acquire():
        return contended()
    held = (lk, current_holder())
    return call_holding(call, lambda: held, stream=stream)


async def aguarded_call(
    lk: Lock,
    call: Callable[[], Awaitable[R]],
    contended: Callable[[], Awaitable[R]],
    *,
    stream: bool = True,
) -> R:
    """Async :func:`guarded_call`."""
    if not await lk.aacquire():
        return await contended()
    held = (lk, current_holder())
    return await acall_holding(call, lambda: held, stream=stream)
