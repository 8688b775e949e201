"""Every system check of django-dlock, registered here (stable IDs, listed in the docs).

* ``dlock.E000``: ``"django_dlock"`` is in ``INSTALLED_APPS`` (registered as
  soon as ``dlock.lock`` or another lazy attribute of the package is used,
  installed or not);
* ``dlock.E001``-``E006``: each ``DLOCK_*`` setting has a valid value;
  ``dlock.W001``: no unknown (misspelt) ``DLOCK_*`` setting;
* ``dlock.E010``-``E014``, ``W010``-``W011``: the default strategy fits the
  lock database (settings only, never a connection);
* ``dlock.E020``-``E027``, ``W020``-``W023``: ``DLOCK_MIDDLEWARE_RULES`` and
  the place of ``LockMiddleware``;
* ``dlock.E030``-``E033``: ``DLOCK_WORKER_JOBS``;
* ``dlock.E040``-``E041``: ``DLOCK_METRICS``; ``dlock.E042``: ``DLOCK_HOLDER_INFO``;
  ``dlock.E043``-``E045``: ``DLOCK_TRACING``;
* ``dlock.E050``, ``W050``-``W051``: connection poolers (the ``W`` ones
  connect, under ``Tags.database``);
* ``dlock.W070``: django-dlock's tables exist (connects, under ``Tags.database``).

The values themselves are judged by :mod:`django_dlock.validation` (and by
the middleware's and the worker's rule parsers), the same functions that
refuse them at run time.
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from django.apps import apps
from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning
from django.core.checks import register as _register

from django_dlock.conf import DEFAULTS, KNOWN_SETTINGS, NOT_INSTALLED, lock_alias
from django_dlock.validation import (
    bool_error,
    deadlock_timeout_error,
    direct_databases_error,
    long_hold_error,
    retry_interval_error,
    strategy_error,
    ticket_ttl_error,
    timeout_error,
    ttl_error,
)

_Check = TypeVar("_Check", bound=Callable[..., list[CheckMessage]])


def register(*tags: str) -> Callable[[_Check], _Check]:
    """Django's ``register``, for a check that needs django-dlock installed.

    This module is also imported (by ``django_dlock``'s lazy attributes:
    ``dlock.lock``, ``dlock.TaskLock``, ...) where
    ``"django_dlock"`` is not in ``INSTALLED_APPS``, so that ``dlock.E000``
    says so; the other checks then say nothing (their models cannot load).
    """

    def decorate(check: _Check) -> _Check:
        @functools.wraps(check)
        def when_installed(**kwargs: Any) -> list[CheckMessage]:
            if not apps.is_installed("django_dlock"):
                return []
            return check(**kwargs)

        _register(*tags)(when_installed)
        return cast(_Check, when_installed)  # (with Django's ``tags``, as registered)

    return decorate


@_register(Tags.compatibility)
def check_installed(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E000: django-dlock is used but ``"django_dlock"`` is not installed."""
    if apps.is_installed("django_dlock"):
        return []
    return [
        Error(
            NOT_INSTALLED + ".",
            hint='INSTALLED_APPS = [..., "django_dlock"]',
            id="dlock.E000",
        )
    ]


_SETTING_CHECKS: list[tuple[str, str, Callable[[object], str | None]]] = [
    ("dlock.E001", "DLOCK_DEFAULT_STRATEGY", strategy_error),
    ("dlock.E002", "DLOCK_DEFAULT_TTL", ttl_error),
    ("dlock.E003", "DLOCK_DEFAULT_TIMEOUT", timeout_error),
    ("dlock.E004", "DLOCK_RETRY_INTERVAL", retry_interval_error),
    ("dlock.E005", "DLOCK_LEASE_SYNCHRONOUS_COMMIT", bool_error),
    ("dlock.E006", "DLOCK_QUEUE_TICKET_TTL", ticket_ttl_error),
    ("dlock.E007", "DLOCK_DEADLOCK_TIMEOUT", deadlock_timeout_error),
    ("dlock.E008", "DLOCK_LONG_HOLD", long_hold_error),
]


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E001-E008: each ``DLOCK_*`` setting has a valid value."""
    errors: list[CheckMessage] = []
    for check_id, name, validate in _SETTING_CHECKS:
        value = getattr(settings, name, DEFAULTS[name])
        problem = validate(value)
        if problem is not None:
            errors.append(
                Error(
                    f"{name} is invalid: {problem}.",
                    hint=f"Fix {name} in your settings (default: {DEFAULTS[name]!r}).",
                    id=check_id,
                )
            )
    return errors


@register(Tags.compatibility)
def check_unknown_settings(**kwargs: Any) -> list[CheckMessage]:
    """dlock.W001: a ``DLOCK_*`` setting that django-dlock does not read (misspelt?)."""
    found: list[CheckMessage] = []
    for name in sorted(dir(settings)):
        if not name.startswith("DLOCK_") or name in KNOWN_SETTINGS:
            continue
        close = difflib.get_close_matches(name, sorted(KNOWN_SETTINGS), n=1, cutoff=0.6)
        hint = (
            f"Did you mean {close[0]}?"
            if close
            else "See the settings page of django-dlock's documentation for the names it reads."
        )
        found.append(
            Warning(
                f"{name} is not a django-dlock setting: it is ignored.",
                hint=hint,
                id="dlock.W001",
            )
        )
    return found


@register(Tags.compatibility)
def check_middleware_rules(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E020-E027, W020-W022: ``DLOCK_MIDDLEWARE_RULES`` and LockMiddleware's place."""
    return middleware_messages()


@register(Tags.compatibility)
def check_worker_jobs(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E030-E033: ``DLOCK_WORKER_JOBS`` (jobs of ``manage.py dlock_runworker``)."""
    from django_dlock.jobs import setting_problems

    hint = 'Each entry is "dotted.path" or {"job": "dotted.path", "interval": seconds}.'
    return [
        Error(f"DLOCK_WORKER_JOBS is invalid: {problem}.", hint=hint, id=check_id)
        for check_id, problem in setting_problems(getattr(settings, "DLOCK_WORKER_JOBS", []))
    ]


@register(Tags.compatibility)
def check_strategy_database(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E010-E013, W010-W011: the default strategy fits the lock database."""
    return strategy_messages()


@register(Tags.compatibility)
def check_holder_info(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E042: ``DLOCK_HOLDER_INFO`` names a function."""
    from django_dlock.identity import holder_info_hook

    try:
        holder_info_hook(getattr(settings, "DLOCK_HOLDER_INFO", None))
    except (ImportError, TypeError) as exc:
        return [
            Error(
                f"DLOCK_HOLDER_INFO is invalid: {exc}.",
                hint="Set it to None, or to a function (or its dotted path) that takes "
                "no arguments and returns the text to add to each lock's owner.",
                id="dlock.E042",
            )
        ]
    return []


@register(Tags.compatibility)
def check_metrics(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E040-E041: ``DLOCK_METRICS`` is valid and its client is installed."""
    from django_dlock.metrics import metrics_error, prometheus_available

    value = getattr(settings, "DLOCK_METRICS", None)
    problem = metrics_error(value)
    if problem is not None:
        hint = 'Set DLOCK_METRICS to None (off) or "prometheus".'
        return [Error(f"DLOCK_METRICS is invalid: {problem}.", hint=hint, id="dlock.E040")]
    if value == "prometheus" and not prometheus_available():
        return [
            Error(
                'DLOCK_METRICS = "prometheus" but prometheus_client is not installed.',
                hint='Install the "prometheus" extra (pip install -e ".[prometheus]" in a checkout '
                "of django-dlock) or prometheus_client itself.",
                id="dlock.E041",
            )
        ]
    return []


@register(Tags.compatibility)
def check_tracing(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E043-E045: ``DLOCK_TRACING`` and ``DLOCK_TRACING_LOCK_NAMES`` are
    valid, and the OpenTelemetry API is installed."""
    from django_dlock.tracing import names_error, opentelemetry_available, tracing_error

    value = getattr(settings, "DLOCK_TRACING", None)
    problem = tracing_error(value)
    if problem is not None:
        hint = 'Set DLOCK_TRACING to None (off) or "opentelemetry".'
        return [Error(f"DLOCK_TRACING is invalid: {problem}.", hint=hint, id="dlock.E043")]
    found: list[CheckMessage] = []
    if value == "opentelemetry" and not opentelemetry_available():
        found.append(
            Error(
                'DLOCK_TRACING = "opentelemetry" but the OpenTelemetry API is not installed.',
                hint='Install the "otel" extra (pip install -e ".[otel]" in a checkout of '
                "django-dlock) or opentelemetry-api itself.",
                id="dlock.E044",
            )
        )
    problem = names_error(getattr(settings, "DLOCK_TRACING_LOCK_NAMES", "plain"))
    if problem is not None:
        found.append(
            Error(
                f"DLOCK_TRACING_LOCK_NAMES is invalid: {problem}.",
                hint='"plain" shows lock names in spans, "hashed" a digest of each, "off" none.',
                id="dlock.E045",
            )
        )
    return found


@register(Tags.compatibility)
def check_direct_databases(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E050: ``DLOCK_DIRECT_DATABASES`` maps database aliases to database aliases."""
    problem = direct_databases_error(getattr(settings, "DLOCK_DIRECT_DATABASES", {}))
    if problem is None:
        return []
    return [
        Error(
            f"DLOCK_DIRECT_DATABASES is invalid: {problem}.",
            hint="Map the alias that goes through a pooler to an alias of the same database "
            'that connects directly, e.g. {"default": "direct"}.',
            id="dlock.E050",
        )
    ]


def _inside_migrate() -> bool:
    """Whether Django's ``migrate`` command (from ``manage.py`` or
    ``call_command``) runs these checks: it checks its database first."""
    from django.core.management.commands.migrate import Command as Migrate

    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Migrate):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


@register(Tags.database)
def check_tables(**kwargs: Any) -> list[CheckMessage]:
    """dlock.W070: django-dlock's tables are missing (connects; ``--database``).

    A warning, not an error: ``migrate --database ALIAS`` runs the database
    checks of its database first, and must not be stopped by the very
    problem it fixes.
    """
    from django.db import DatabaseError, connections, router

    from django_dlock.models import Lock
    from django_dlock.tables import LOCK_TABLE

    found: list[CheckMessage] = []
    if _inside_migrate():
        return found  # the very command that creates them: it would warn about itself
    for alias in kwargs.get("databases") or []:
        if not router.allow_migrate_model(alias, Lock):
            continue  # the router keeps django-dlock's tables elsewhere
        connection = connections[alias]
        try:
            with connection.cursor() as cur:
                tables = connection.introspection.table_names(cur)
        except DatabaseError:
            continue  # unreachable: Django's own checks say so
        if LOCK_TABLE not in tables:
            option = "" if alias == "default" else f" --database {alias}"
            found.append(
                Warning(
                    f"django-dlock's tables are missing on database {alias!r}: every lock "
                    "on it fails (NotMigrated).",
                    hint=f"Run `python manage.py migrate django_dlock{option}`.",
                    id="dlock.W070",
                )
            )
    return found


@register(Tags.database)
def check_poolers(**kwargs: Any) -> list[CheckMessage]:
    """dlock.W050-W051: PostgreSQL databases reached through a pooler (connects; ``--database``)."""
    from django.db import DatabaseError, connections

    from django_dlock.conf import conf
    from django_dlock.strategies.connection import behind_pooler

    found: list[CheckMessage] = []
    for alias in kwargs.get("databases") or []:
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        try:
            pooled = behind_pooler(connection)
        except DatabaseError:
            continue  # unreachable: Django's own checks say so
        if not pooled:
            continue
        if not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
            found.append(
                Warning(
                    f"The database {alias!r} is reached through a connection pooler (such as "
                    "PgBouncer) and DISABLE_SERVER_SIDE_CURSORS is not set. In transaction "
                    "mode, server-side cursors and prepared statements fail or land on "
                    "another client's session.",
                    hint=f"Set DISABLE_SERVER_SIDE_CURSORS = True in DATABASES[{alias!r}] "
                    "(django-dlock then prepares nothing either).",
                    id="dlock.W050",
                )
            )
        if alias not in conf.DIRECT_DATABASES:
            found.append(
                Warning(
                    f"The database {alias!r} is reached through a connection pooler and "
                    "DLOCK_DIRECT_DATABASES names no direct route to it. In transaction mode "
                    "LISTEN cannot hear releases (lease waiters poll at the retry interval), "
                    "and a lock taken inside a transaction needs a server connection beside "
                    "the ones transactions hold (without one it times out).",
                    hint=f"Add an alias that connects to PostgreSQL directly and set "
                    f'DLOCK_DIRECT_DATABASES = {{{alias!r}: "<that alias>"}}, or size the '
                    "pooler's pool above the number of concurrent transactions that lock.",
                    id="dlock.W051",
                )
            )
    return found


# -- the default strategy and the lock database (E010-E013, W010-W011) --------

SESSION_HINT = (
    "Use advisory_xact (transaction-scoped, safe behind any pooler) or lease, or give "
    "advisory locks a database alias that connects directly (lock(..., using=...))."
)


def database_messages(
    strategy: str, alias: str, database: dict[str, Any], vendor: str
) -> list[CheckMessage]:
    """The messages for ``strategy`` as the default on the database ``alias``."""
    found: list[CheckMessage] = []
    if strategy == "advisory" and vendor not in ("postgresql", "mysql"):
        found.append(
            Error(
                "DLOCK_DEFAULT_STRATEGY is 'advisory', which needs PostgreSQL or "
                f"MySQL/MariaDB, but the lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E010",
            )
        )
    if strategy == "advisory_xact" and vendor == "mysql":
        found.append(
            Error(
                "DLOCK_DEFAULT_STRATEGY is 'advisory_xact', which needs PostgreSQL: the lock "
                f"database {alias!r} is MySQL/MariaDB, which has no transaction-scoped "
                "advisory locks.",
                hint="Use row (held until the transaction ends) or advisory (GET_LOCK, "
                "held until released).",
                id="dlock.E013",
            )
        )
    elif strategy == "advisory_xact" and vendor != "postgresql":
        found.append(
            Error(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory_xact', which needs PostgreSQL, but the "
                f"lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E010",
            )
        )
    if strategy == "row" and vendor not in ("postgresql", "mysql"):
        found.append(
            Error(
                f"DLOCK_DEFAULT_STRATEGY is 'row', which needs PostgreSQL or MySQL/MariaDB, "
                f"but the lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E011",
            )
        )
    if strategy != "advisory" or vendor != "postgresql":
        return found
    from django_dlock.strategies._pg import PSYCOPG_INSTALL
    from django_dlock.strategies.connection import psycopg3

    if not psycopg3():
        found.append(
            Error(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory' on the PostgreSQL database {alias!r}, "
                "which needs psycopg 3 (its sessions are psycopg 3 connections), and psycopg 3 "
                "is not installed: Django runs PostgreSQL on psycopg2 here.",
                hint=f"Install the postgresql extra ({PSYCOPG_INSTALL} in a checkout of "
                "django-dlock), or use the lease strategy.",
                id="dlock.E014",
            )
        )
    options = database.get("OPTIONS") or {}
    if database.get("DISABLE_SERVER_SIDE_CURSORS") or str(database.get("PORT", "")) == "6432":
        found.append(
            Warning(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory' and the database {alias!r} looks like "
                "it goes through PgBouncer (DISABLE_SERVER_SIDE_CURSORS or port 6432). In "
                "transaction mode the server session changes between statements, and a "
                "session lock would be left with the next client.",
                hint=SESSION_HINT,
                id="dlock.W010",
            )
        )
    if options.get("pool"):
        found.append(
            Warning(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory' and the database {alias!r} uses "
                "Django's connection pool. Advisory locks never borrow pooled connections "
                "(a lock cannot leak to the next borrower): each thread or task holding "
                "one uses a dedicated session outside the pool.",
                hint="Count those sessions in max_connections (one per concurrent holder "
                "or waiter, plus a few idle ones per process), or silence this warning.",
                id="dlock.W011",
            )
        )
    return found


def strategy_messages() -> list[CheckMessage]:
    """dlock.E010-E013, W010-W011 for the current settings (see the module docstring)."""
    found: list[CheckMessage] = []
    fencing = getattr(settings, "DLOCK_ADVISORY_FENCING", False)
    if not isinstance(fencing, bool):
        found.append(
            Error(
                f"DLOCK_ADVISORY_FENCING must be True or False, not {fencing!r}.",
                hint="Set DLOCK_ADVISORY_FENCING = True to give advisory locks fencing "
                "numbers (it costs about 20 % of an uncontended acquire/release).",
                id="dlock.E012",
            )
        )
    strategy = getattr(settings, "DLOCK_DEFAULT_STRATEGY", DEFAULTS["DLOCK_DEFAULT_STRATEGY"])
    if strategy_error(strategy) is not None:
        return found  # dlock.E001
    try:
        alias = lock_alias()
    except Exception:
        alias = "default"
    database = settings.DATABASES.get(alias)
    if database is None:
        return found
    from django.db import connections

    found += database_messages(strategy, alias, database, connections[alias].vendor)
    return found


# -- LockMiddleware (E020-E027, W020-W023) ------------------------------------


def _middleware_index(middleware: Iterable[str], path: str) -> int | None:
    for index, entry in enumerate(middleware):
        if entry == path:
            return index
    return None


def middleware_messages() -> list[CheckMessage]:
    """dlock.E020-E027, dlock.W020-W023: the rules and the middleware's place."""
    from django_dlock._http import KeyTemplate
    from django_dlock.middleware import (
        AUTH_MIDDLEWARE,
        CSRF_MIDDLEWARE,
        MIDDLEWARE_PATH,
        SESSION_MIDDLEWARE,
        rule_problems,
    )

    raw = getattr(settings, "DLOCK_MIDDLEWARE_RULES", [])
    messages: list[CheckMessage] = []
    problems = rule_problems(raw)
    hint = 'See "Views and middleware" in the django-dlock docs (DLOCK_MIDDLEWARE_RULES).'
    messages.extend(Error(message, hint=hint, id=check_id) for check_id, message in problems)
    middleware = list(getattr(settings, "MIDDLEWARE", None) or [])
    ours = _middleware_index(middleware, MIDDLEWARE_PATH)
    rules = raw if isinstance(raw, (list, tuple)) and not problems else []
    if rules and ours is None:
        messages.append(
            Warning(
                "DLOCK_MIDDLEWARE_RULES is set but LockMiddleware is not in MIDDLEWARE, "
                "so no rule applies.",
                hint=f"Add {MIDDLEWARE_PATH!r} to MIDDLEWARE (after the session and "
                "authentication middleware).",
                id="dlock.W020",
            )
        )
    if ours is not None and not raw:
        messages.append(
            Warning(
                "LockMiddleware is in MIDDLEWARE but DLOCK_MIDDLEWARE_RULES is empty, so it "
                "does nothing.",
                hint="Add rules to DLOCK_MIDDLEWARE_RULES, or remove the middleware.",
                id="dlock.W022",
            )
        )
    csrf = _middleware_index(middleware, CSRF_MIDDLEWARE)
    if rules and ours is not None and csrf is not None and csrf > ours:
        messages.append(
            Warning(
                "LockMiddleware comes before CsrfViewMiddleware in MIDDLEWARE: a POST that "
                "fails the CSRF check takes the lock (and writes a lease row) before it is "
                "refused.",
                hint=f"Put {MIDDLEWARE_PATH!r} after {CSRF_MIDDLEWARE!r}.",
                id="dlock.W023",
            )
        )
    for index, rule in enumerate(rules):
        names = set(KeyTemplate.parse(rule["key"]).names)
        needed = []
        if names & {"user", "session"}:
            needed.append(SESSION_MIDDLEWARE)
        if "user" in names:
            needed.append(AUTH_MIDDLEWARE)
        for path in needed:
            place = _middleware_index(middleware, path)
            if ours is not None and (place is None or place > ours):
                messages.append(
                    Error(
                        f"DLOCK_MIDDLEWARE_RULES[{index}] uses "
                        f"{'{user}' if 'user' in names else '{session}'}, which needs {path} "
                        "before LockMiddleware in MIDDLEWARE.",
                        hint=f"Put {path!r} before {MIDDLEWARE_PATH!r}.",
                        id="dlock.E027",
                    )
                )
        if rule.get("on_contention") == "wait" and "timeout" in rule and rule["timeout"] is None:
            messages.append(
                Warning(
                    f"DLOCK_MIDDLEWARE_RULES[{index}] waits without limit "
                    '(on_contention="wait", timeout=None): a request may hold a worker '
                    "for as long as another holds the lock.",
                    hint="Give a timeout in seconds.",
                    id="dlock.W021",
                )
            )
    return messages


@register(Tags.compatibility)
def check_quorums(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E060, W060: the quorums in use (``using=[...]``, ``DLOCK_QUORUMS``)."""
    from django_dlock.strategies.quorum import quorum_problems

    return quorum_problems([])


@register(Tags.database)
def check_quorum_tables(**kwargs: Any) -> list[CheckMessage]:
    """dlock.W061, E062: a database of a quorum has no lock table; two of its
    aliases reach the same database.

    It connects, so it is a database check: Django runs it only for the
    databases named with ``check --database`` (Django 6 hands every alias to
    the other checks).
    """
    from django_dlock.strategies.quorum import quorum_problems

    found = quorum_problems(kwargs.get("databases") or [])
    return [message for message in found if message.id in ("dlock.W061", "dlock.E062")]
