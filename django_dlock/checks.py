"""System checks for the ``DLOCK_*`` settings (stable IDs, listed in the docs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register

from django_dlock.conf import (
    DEFAULTS,
    bool_error,
    retry_interval_error,
    strategy_error,
    timeout_error,
    ttl_error,
)

_SETTING_CHECKS: list[tuple[str, str, Callable[[object], str | None]]] = [
    ("dlock.E001", "DLOCK_DEFAULT_STRATEGY", strategy_error),
    ("dlock.E002", "DLOCK_DEFAULT_TTL", ttl_error),
    ("dlock.E003", "DLOCK_DEFAULT_TIMEOUT", timeout_error),
    ("dlock.E004", "DLOCK_RETRY_INTERVAL", retry_interval_error),
    ("dlock.E005", "DLOCK_LEASE_SYNCHRONOUS_COMMIT", bool_error),
]


@register(Tags.compatibility)
def check_settings(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E001-E005: each ``DLOCK_*`` setting has a valid value."""
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
def check_middleware_rules(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E020-E027, W020-W022: ``DLOCK_MIDDLEWARE_RULES`` and LockMiddleware's place."""
    from django_dlock.middleware import check_rules

    return check_rules()


@register(Tags.compatibility)
def check_worker_jobs(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E030-E033: ``DLOCK_WORKER_JOBS`` (jobs of ``manage.py runworker``)."""
    from django_dlock.jobs import setting_problems

    hint = 'Each entry is "dotted.path" or {"job": "dotted.path", "interval": seconds}.'
    return [
        Error(f"DLOCK_WORKER_JOBS is invalid: {problem}.", hint=hint, id=check_id)
        for check_id, problem in setting_problems(getattr(settings, "DLOCK_WORKER_JOBS", []))
    ]


@register(Tags.compatibility)
def check_strategy_database(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E010-E013, W010-W011: the default strategy fits the lock database."""
    from django_dlock.strategies.support import strategy_messages

    return strategy_messages()


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
                hint='Install the "prometheus" extra: django-dlock[prometheus].',
                id="dlock.E041",
            )
        ]
    return []


def check_direct_databases(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E050: ``DLOCK_DIRECT_DATABASES`` maps database aliases to database aliases."""
    from django_dlock.conf import direct_databases_error

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


@register(Tags.database)
def check_poolers(**kwargs: Any) -> list[CheckMessage]:
    """dlock.W050-W051: PostgreSQL databases reached through a pooler (connects; ``--database``)."""
    from django.db import DatabaseError, connections

    from django_dlock.conf import conf
    from django_dlock.strategies.base import behind_pooler

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
                    "the ones transactions hold.",
                    hint=f"Add an alias that connects to PostgreSQL directly and set "
                    f'DLOCK_DIRECT_DATABASES = {{{alias!r}: "<that alias>"}}, or size the '
                    "pooler's pool above the number of concurrent transactions that lock.",
                    id="dlock.W051",
                )
            )
    return found


@register(Tags.compatibility)
def check_quorums(**kwargs: Any) -> list[CheckMessage]:
    """dlock.E060, E061, W060: the quorums in use (``using=[...]``, ``DLOCK_QUORUMS``).

    E061 (the lock table is missing on a database of a quorum) connects, so
    it runs only with ``check --database``.
    """
    from django_dlock.strategies.quorum import quorum_problems

    return quorum_problems(kwargs.get("databases") or [])
