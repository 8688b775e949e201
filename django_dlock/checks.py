"""System checks for the ``DLOCK_*`` settings (stable IDs, listed in the docs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, register

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
