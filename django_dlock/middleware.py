"""``LockMiddleware``: serialise requests by rules, without touching the views.

::

    MIDDLEWARE = [
        ...,
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django_dlock.middleware.LockMiddleware",
    ]
    DLOCK_MIDDLEWARE_RULES = [
        # one checkout at a time per user (double-submitted forms)
        {"path": r"^/checkout/", "methods": ["POST"], "key": "checkout:{user}"},
        # one import per project, waiting up to 10 s for the previous one
        {"path": r"^/projects/(?P<pk>\\d+)/import/$", "key": "import:{pk}",
         "on_contention": "wait", "timeout": 10},
    ]

The first rule whose ``path`` regex matches ``request.path_info``
(``re.search``: anchor it with ``^``) and whose ``methods`` contain the
request's method applies. Its ``key`` template may use:

* ``{user}``: the user's primary key; for an anonymous user
  ``anon:<session digest>`` (a session is created if there is none yet);
* ``{session}``: the session digest (the session is created if needed);
* ``{ip}``: ``REMOTE_ADDR`` (set it correctly behind a proxy);
* ``{path}``: ``request.path_info``; ``{method}``: the HTTP method;
* any other name: the URL kwarg of that name (from resolving the path).

The lock is taken just before the view runs (in ``process_view``, after
the ``process_view`` of every middleware listed before this one, such as
``CsrfViewMiddleware``), so a request refused before its view (a failed CSRF
check, a 404) takes no lock and writes no lease row. Put ``LockMiddleware``
after ``CsrfViewMiddleware`` (the system check ``dlock.W023`` says so). The
lock is released when the response comes back (streaming responses: when
they are closed). Contention answers like :func:`~django_dlock.decorators.with_lock`:
``423`` with ``Retry-After`` by default. The 423 body names the rule's
``name`` if it has one, else the request path, never the rendered key.

A session key is a credential, and a lock's name is stored in clear, logged
and shown by ``dlock_list`` and the admin: so a rule never puts the session
key itself in a name, but :func:`session_digest` of it, a digest keyed with
``SECRET_KEY`` that is the same for the same session and says nothing about
the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.crypto import salted_hmac
from django.utils.module_loading import import_string

from django_dlock._http import (
    Contention,
    ContentionPolicy,
    KeyTemplate,
    aanswer_contention,
    acall_holding,
    answer_contention,
    call_holding,
    request_label,
)
from django_dlock.conf import conf
from django_dlock.exceptions import KeyTemplateError
from django_dlock.identity import Holder, current_holder, doing
from django_dlock.locks import Lock
from django_dlock.validation import (
    alias_error,
    contention_policy_error,
    retry_after_error,
    strategy_error,
    timeout_error,
    ttl_error,
)

__all__ = ["LockMiddleware", "Rule", "compile_rules", "session_digest"]

MIDDLEWARE_PATH = "django_dlock.middleware.LockMiddleware"
CSRF_MIDDLEWARE = "django.middleware.csrf.CsrfViewMiddleware"
#: request attribute: the lock taken in process_view and its holder
HELD_ATTR = "_dlock_middleware_held"
SESSION_MIDDLEWARE = "django.contrib.sessions.middleware.SessionMiddleware"
AUTH_MIDDLEWARE = "django.contrib.auth.middleware.AuthenticationMiddleware"
#: the HMAC salt of session digests in lock names
SESSION_SALT = "django_dlock.middleware.session"

BUILTIN_NAMES = frozenset({"user", "session", "ip", "path", "method"})
RULE_KEYS = frozenset(
    {
        "path",
        "methods",
        "key",
        "name",
        "timeout",
        "ttl",
        "strategy",
        "using",
        "on_contention",
        "retry_after",
        "permits",
    }
)
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"})


@dataclass(frozen=True)
class Rule:
    """One compiled entry of ``DLOCK_MIDDLEWARE_RULES``."""

    index: int
    pattern: re.Pattern[str]
    methods: frozenset[str] | None
    template: KeyTemplate
    name: str | None
    options: dict[str, Any]
    on_contention: ContentionPolicy
    retry_after: int | None
    #: let this many requests hold the key at once (a semaphore), else a lock
    permits: int | None = None

    @property
    def url_names(self) -> tuple[str, ...]:
        return tuple(n for n in self.template.names if n not in BUILTIN_NAMES)

    @property
    def needs_session(self) -> bool:
        return bool({"user", "session"} & set(self.template.names))

    def matches(self, request: HttpRequest) -> bool:
        if self.methods is not None and request.method not in self.methods:
            return False
        return self.pattern.search(request.path_info) is not None

    def values(self, request: HttpRequest) -> dict[str, Any] | None:
        """The template's values for ``request`` (``None``: the URL does not resolve).

        Touches the session and the user, so call it where the ORM may run.
        """
        values: dict[str, Any] = {}
        names = set(self.template.names)
        if self.url_names:
            try:
                match = resolve(request.path_info, getattr(request, "urlconf", None))
            except Resolver404:
                return None  # the view answers 404; nothing to serialise
            values.update(match.kwargs)
        if "path" in names:
            values["path"] = request.path_info
        if "method" in names:
            values["method"] = request.method
        if "ip" in names:
            ip = request.META.get("REMOTE_ADDR")
            if ip:
                values["ip"] = ip
        if "session" in names:
            values["session"] = session_digest(_session_key(request, self))
        if "user" in names:
            user = getattr(request, "user", None)
            if user is None:
                raise ImproperlyConfigured(
                    f"DLOCK_MIDDLEWARE_RULES[{self.index}] uses {{user}}: put "
                    f"{AUTH_MIDDLEWARE} before {MIDDLEWARE_PATH} in MIDDLEWARE"
                )
            if user.is_authenticated:
                values["user"] = user.pk
            else:
                values["user"] = "anon:" + session_digest(_session_key(request, self))
        return values

    def lock(self, request: HttpRequest) -> Lock | None:
        values = self.values(request)
        if values is None:
            return None
        where = f"request {request.path_info!r} (DLOCK_MIDDLEWARE_RULES[{self.index}])"
        key = self.template.render(values, where=where)
        if self.permits is not None:
            from django_dlock.semaphores import Semaphore

            return Semaphore(key, permits=self.permits, **self.options)
        return Lock(key, **self.options)

    def contention(self, lk: Lock, request: HttpRequest) -> Contention:
        return Contention(
            request=request,
            resource=self.name or request.path,
            lock=lk,
            retry_after=self.retry_after,
        )


def session_digest(session_key: str) -> str:
    """What stands for a session in a lock name: never the session key itself.

    A session key is a credential (whoever reads it can use the session),
    and lock names are stored in clear, logged, and shown by ``dlock_list``
    and the admin. This is an HMAC of the key with ``SECRET_KEY`` (Django's
    ``salted_hmac``), 128 bits in hex: stable for one session, different for
    two sessions, and no help to whoever wants to find the key. It changes
    when ``SECRET_KEY`` does (a lock held across such a change is held under
    the old name until it ends).
    """
    return salted_hmac(SESSION_SALT, session_key, algorithm="sha256").hexdigest()[:32]


def _session_key(request: HttpRequest, rule: Rule) -> str:
    session = getattr(request, "session", None)
    if session is None:
        raise ImproperlyConfigured(
            f"DLOCK_MIDDLEWARE_RULES[{rule.index}] needs a session: put {SESSION_MIDDLEWARE} "
            f"before {MIDDLEWARE_PATH} in MIDDLEWARE"
        )
    if not session.session_key:
        session.save()  # creates the session, so that the key is stable
        session.modified = True  # and SessionMiddleware sends its cookie
    key: str = session.session_key
    return key


# -- rules: validation and compilation -------------------------------------------


def _rule_problems(index: int, raw: object) -> list[tuple[str, str]]:
    """Problems of one rule as ``(check id, message)``."""
    where = f"DLOCK_MIDDLEWARE_RULES[{index}]"
    if not isinstance(raw, dict):
        return [("dlock.E020", f"{where} must be a dict, not {type(raw).__name__}")]
    problems: list[tuple[str, str]] = []
    unknown = sorted(str(k) for k in set(raw) - RULE_KEYS)
    missing = sorted({"path", "key"} - set(raw))
    if unknown:
        problems.append(
            (
                "dlock.E021",
                f"{where} has unknown keys {unknown}; allowed: {', '.join(sorted(RULE_KEYS))}",
            )
        )
    if missing:
        problems.append(("dlock.E021", f"{where} lacks the required keys {missing}"))
    if "path" in raw:
        path = raw["path"]
        if not isinstance(path, str):
            problems.append(("dlock.E022", f"{where}['path'] must be a regex string"))
        else:
            try:
                re.compile(path)
            except re.error as exc:
                problems.append(("dlock.E022", f"{where}['path'] is not a valid regex: {exc}"))
    if "methods" in raw:
        methods = raw["methods"]
        if (
            isinstance(methods, str)
            or not isinstance(methods, (list, tuple, set, frozenset))
            or not methods
            or not all(isinstance(m, str) and m.upper() in HTTP_METHODS for m in methods)
        ):
            problems.append(
                (
                    "dlock.E023",
                    f"{where}['methods'] must be a non-empty list of HTTP methods "
                    f"({', '.join(sorted(HTTP_METHODS))}), got {methods!r}",
                )
            )
    if "key" in raw:
        try:
            KeyTemplate.parse(raw["key"])
        except KeyTemplateError as exc:
            problems.append(("dlock.E024", f"{where}['key']: {exc}"))
    option_problems = [
        ttl_error(raw["ttl"]) if raw.get("ttl") is not None else None,
        timeout_error(raw["timeout"]) if "timeout" in raw else None,
        strategy_error(raw["strategy"]) if raw.get("strategy") is not None else None,
        retry_after_error(raw["retry_after"]) if "retry_after" in raw else None,
    ]
    using = raw.get("using")
    if using is not None:
        option_problems.append(alias_error(using))
    if raw.get("permits") is not None:
        from django_dlock.decorators import options_error

        error = options_error(
            timeout=0, ttl=None, strategy=raw.get("strategy"), using=using, permits=raw["permits"]
        )
        option_problems.append(None if error is None else str(error))
    name = raw.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        option_problems.append(f"name must be a non-empty string, got {name!r}")
    problems.extend(("dlock.E025", f"{where}: {p}") for p in option_problems if p)
    if "on_contention" in raw:
        problem = _contention_problem(raw["on_contention"], raw.get("timeout", 0))
        if problem:
            problems.append(("dlock.E026", f"{where}['on_contention']: {problem}"))
    return problems


def _contention_policy(value: object) -> Any:
    if isinstance(value, str) and value != "wait" and "." in value:
        return import_string(value)
    return value


def _contention_problem(value: object, timeout: object) -> str | None:
    try:
        policy = _contention_policy(value)
    except ImportError as exc:
        return f"cannot import {value!r}: {exc}"
    return contention_policy_error(policy, timeout)


def _raw_rules() -> object:
    return conf.MIDDLEWARE_RULES


def rule_problems(raw_rules: object) -> list[tuple[str, str]]:
    """Every problem of a ``DLOCK_MIDDLEWARE_RULES`` value, as ``(id, message)``."""
    if isinstance(raw_rules, (str, bytes, dict)) or not isinstance(raw_rules, (list, tuple)):
        return [
            (
                "dlock.E020",
                f"DLOCK_MIDDLEWARE_RULES must be a list of dicts, not {type(raw_rules).__name__}",
            )
        ]
    problems: list[tuple[str, str]] = []
    for index, raw in enumerate(raw_rules):
        problems.extend(_rule_problems(index, raw))
    return problems


def compile_rules(raw_rules: object) -> tuple[Rule, ...]:
    """Validate and compile ``DLOCK_MIDDLEWARE_RULES``.

    Raises:
        ImproperlyConfigured: a rule is invalid (the system checks
            dlock.E020-E026 report the same problems at start-up).
    """
    problems = rule_problems(raw_rules)
    if problems:
        raise ImproperlyConfigured(
            "; ".join(f"{message} ({check_id})" for check_id, message in problems)
        )
    assert isinstance(raw_rules, (list, tuple))
    rules = []
    for index, raw in enumerate(raw_rules):
        methods = raw.get("methods")
        timeout = raw.get("timeout", 0)
        rules.append(
            Rule(
                index=index,
                pattern=re.compile(raw["path"]),
                methods=None if methods is None else frozenset(m.upper() for m in methods),
                template=KeyTemplate.parse(raw["key"]),
                name=raw.get("name"),
                options={
                    "timeout": timeout,
                    "ttl": raw.get("ttl"),
                    "strategy": raw.get("strategy"),
                    "using": raw.get("using"),
                },
                on_contention=_contention_policy(raw.get("on_contention", 423)),
                retry_after=raw.get("retry_after", 1),
                permits=raw.get("permits"),
            )
        )
    return tuple(rules)


# -- the middleware ---------------------------------------------------------------


class LockMiddleware:
    """Hold a lock per request for the rules in ``DLOCK_MIDDLEWARE_RULES``.

    Sync and async capable: under ASGI it acquires and waits without
    blocking the event loop.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)
            # Django adapts a sync process_view with sync_to_async: another
            # thread, so another holder. Acquire in the request's own task.
            self.process_view = self._aprocess_view  # type: ignore[method-assign,assignment]
        self._source: object = None
        self._rules: tuple[Rule, ...] = ()

    def rules(self) -> tuple[Rule, ...]:
        # Read at call time so override_settings works; compiled once per value.
        raw = _raw_rules()
        if raw is not self._source:
            self._rules = compile_rules(raw)
            self._source = raw
        return self._rules

    def match(self, request: HttpRequest) -> Rule | None:
        for rule in self.rules():
            if rule.matches(request):
                return rule
        return None

    # The lock is taken in process_view, that is after every middleware listed
    # before this one has accepted the request (CsrfViewMiddleware refuses in
    # its process_view): a request refused before its view takes no lock and
    # writes no lease row. It is released when the response comes back here.

    def process_view(
        self, request: HttpRequest, view: Callable[..., Any], args: Any, kwargs: Any
    ) -> HttpResponseBase | None:
        rule = self.match(request)
        lk = None if rule is None else rule.lock(request)
        if rule is None or lk is None:
            return None
        with doing(request_label(request)):
            acquired = lk.acquire()
        if not acquired:
            response: HttpResponseBase = answer_contention(
                rule.on_contention, rule.contention(lk, request)
            )
            return response
        setattr(request, HELD_ATTR, (lk, current_holder()))
        return None

    async def _aprocess_view(
        self, request: HttpRequest, view: Callable[..., Any], args: Any, kwargs: Any
    ) -> HttpResponseBase | None:
        rule = self.match(request)
        if rule is None:
            return None
        # Rendering may read the session and the user: ORM work.
        lk = await sync_to_async(rule.lock)(request) if rule.needs_session else rule.lock(request)
        if lk is None:
            return None
        with doing(request_label(request)):
            acquired = await lk.aacquire()
        if not acquired:
            response: HttpResponseBase = await aanswer_contention(
                rule.on_contention, rule.contention(lk, request)
            )
            return response
        setattr(request, HELD_ATTR, (lk, current_holder()))
        return None

    def __call__(self, request: HttpRequest) -> Any:
        if self.async_mode:
            return self.__acall__(request)
        return call_holding(lambda: self.get_response(request), lambda: _take_held(request))

    async def __acall__(self, request: HttpRequest) -> Any:
        return await acall_holding(lambda: self.get_response(request), lambda: _take_held(request))


def _take_held(request: HttpRequest) -> tuple[Lock, Holder] | None:
    """The lock that ``process_view`` took for ``request`` (forgotten by the request)."""
    held: tuple[Lock, Holder] | None = request.__dict__.pop(HELD_ATTR, None)
    return held
