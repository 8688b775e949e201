"""Typed, lazy access to the ``DLOCK_*`` settings.

Every value is read from ``django.conf.settings`` at call time, so
``override_settings`` always works. Validation lives in :mod:`checks`
(system checks) and in :func:`validate_*` helpers that the lock calls
before any SQL runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from django.conf import settings

#: A retry policy: seconds as a number (jittered) or a function of the
#: attempt number (0-based) returning seconds (used as is).
RetryInterval = float | Callable[[int], float]

STRATEGIES = ("lease", "row", "advisory", "advisory_xact")

DEFAULTS: dict[str, Any] = {
    "DLOCK_DEFAULT_STRATEGY": "lease",
    "DLOCK_DEFAULT_TTL": 60.0,
    "DLOCK_DEFAULT_TIMEOUT": None,
    "DLOCK_RETRY_INTERVAL": 0.05,
    "DLOCK_LEASE_SYNCHRONOUS_COMMIT": True,
    "DLOCK_MIDDLEWARE_RULES": [],
    "DLOCK_WORKER_JOBS": [],
    "DLOCK_METRICS": None,
    "DLOCK_DIRECT_DATABASES": {},
}


class Settings:
    """Lazy view of the ``DLOCK_*`` settings with their defaults."""

    def _get(self, name: str) -> Any:
        return getattr(settings, name, DEFAULTS[name])

    @property
    def DEFAULT_STRATEGY(self) -> str:  # noqa: N802 (mirrors the setting name)
        value: str = self._get("DLOCK_DEFAULT_STRATEGY")
        return value

    @property
    def DEFAULT_TTL(self) -> float:  # noqa: N802
        return float(self._get("DLOCK_DEFAULT_TTL"))

    @property
    def DEFAULT_TIMEOUT(self) -> float | None:  # noqa: N802
        value = self._get("DLOCK_DEFAULT_TIMEOUT")
        return None if value is None else float(value)

    @property
    def RETRY_INTERVAL(self) -> RetryInterval:  # noqa: N802
        value: RetryInterval = self._get("DLOCK_RETRY_INTERVAL")
        return value

    @property
    def LEASE_SYNCHRONOUS_COMMIT(self) -> bool:  # noqa: N802
        """False: PostgreSQL lease writes skip the WAL flush wait (see strategies.lease)."""
        return bool(self._get("DLOCK_LEASE_SYNCHRONOUS_COMMIT"))

    @property
    def MIDDLEWARE_RULES(self) -> object:  # noqa: N802
        """Rules of ``LockMiddleware`` (validated by dlock.E020-E027)."""
        return self._get("DLOCK_MIDDLEWARE_RULES")

    @property
    def WORKER_JOBS(self) -> object:  # noqa: N802
        """Jobs of ``manage.py runworker`` (validated by dlock.E030-E033)."""
        return self._get("DLOCK_WORKER_JOBS")

    @property
    def DIRECT_DATABASES(self) -> dict[str, str]:  # noqa: N802
        """Alias -> alias of the same database reached without a pooler (dlock.E050)."""
        value = self._get("DLOCK_DIRECT_DATABASES")
        return dict(value) if isinstance(value, dict) else {}


conf = Settings()


#: the longest lease (and hold) in seconds, about 31 years: every database
#: can add it to its clock (longer ones overflow a date or an interval)
MAX_SECONDS = 1e9


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ttl_error(value: object) -> str | None:
    """Return why ``value`` is not a valid lease TTL, or ``None``."""
    if not _is_number(value):
        return f"ttl must be a number of seconds, not {type(value).__name__}"
    assert isinstance(value, (int, float))
    if not math.isfinite(value) or value <= 0:
        return f"ttl must be a finite number of seconds > 0, got {value!r}"
    if value > MAX_SECONDS:
        return f"ttl must be at most {MAX_SECONDS:g} seconds (about 31 years), got {value!r}"
    return None


def timeout_error(value: object) -> str | None:
    """Return why ``value`` is not a valid timeout (None, or seconds >= 0)."""
    if value is None:
        return None
    if not _is_number(value):
        return f"timeout must be None or a number of seconds, not {type(value).__name__}"
    assert isinstance(value, (int, float))
    if math.isnan(value) or value < 0:
        return f"timeout must be None (wait forever) or seconds >= 0, got {value!r}"
    return None


def retry_interval_error(value: object) -> str | None:
    """Return why ``value`` is not a valid retry policy, or ``None``."""
    if callable(value):
        return None
    if not _is_number(value):
        return (
            "retry_interval must be seconds (a number) or a function of the attempt "
            f"number, not {type(value).__name__}"
        )
    assert isinstance(value, (int, float))
    if not math.isfinite(value) or value < 0:
        return f"retry_interval must be a finite number of seconds >= 0, got {value!r}"
    if value > MAX_SECONDS:
        return f"retry_interval must be at most {MAX_SECONDS:g} seconds, got {value!r}"
    return None


def bool_error(value: object) -> str | None:
    """Return why ``value`` is not a bool, or ``None``."""
    if not isinstance(value, bool):
        return f"must be True or False, not {type(value).__name__}"
    return None


def strategy_error(value: object) -> str | None:
    """Return why ``value`` is not a known strategy name, or ``None``."""
    if value not in STRATEGIES:
        return f"unknown strategy {value!r}; choose one of {', '.join(STRATEGIES)}"
    return None


def direct_databases_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``DLOCK_DIRECT_DATABASES``, or ``None``."""
    if not isinstance(value, dict):
        return f"must be a dict of database aliases, not {type(value).__name__}"
    from django.db import connections

    for alias, direct in value.items():
        for name in (alias, direct):
            if not isinstance(name, str) or name not in connections:
                return f"{name!r} is not a database alias (known: {', '.join(connections)})"
        if alias == direct:
            return f"{alias!r} maps to itself"
    return None
