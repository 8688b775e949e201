"""Typed, lazy access to the ``DLOCK_*`` settings.

Every value is read from ``django.conf.settings`` when first used and
remembered until a ``setting_changed`` signal says it changed, so
``override_settings`` (and pytest-django's ``settings`` fixture) always
works, and the hot path never asks Django for a setting it does not have
(which costs an ``AttributeError`` each time). Validation lives in
:mod:`django_dlock.validation` (one function per value, used by the system
checks at start-up and by the lock before any SQL runs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from django.conf import settings
from django.core.signals import setting_changed
from django.db import router
from django.db.models import Model
from django.dispatch import receiver

from django_dlock.exceptions import StrategyNotSupported
from django_dlock.validation import (
    deadlock_timeout_error,
    long_hold_error,
    retry_interval_error,
    strategy_error,
    timeout_error,
    ttl_error,
)

__all__ = [
    "DEFAULTS",
    "KNOWN_SETTINGS",
    "NOT_INSTALLED",
    "UNSET",
    "FromSetting",
    "RetryInterval",
    "Settings",
    "checked",
    "conf",
    "lock_alias",
]

#: A retry policy: seconds as a number (jittered) or a function of the
#: attempt number (0-based) returning seconds (used as is).
RetryInterval = float | Callable[[int], float]

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
    "DLOCK_ADVISORY_FENCING": False,
    "DLOCK_QUEUE_TICKET_TTL": 6.0,
    "DLOCK_DEADLOCK_TIMEOUT": 1.0,
    "DLOCK_LONG_HOLD": None,
}

#: the message of the check dlock.E000 and of the error a lock raises when
#: ``"django_dlock"`` is not in ``INSTALLED_APPS`` (the same words)
NOT_INSTALLED = (
    '"django_dlock" is not in INSTALLED_APPS: add it there, then run '
    "`python manage.py migrate django_dlock`"
)

#: every ``DLOCK_*`` setting django-dlock reads (those of :data:`DEFAULTS` and
#: those read where they are used); the system check ``dlock.W001`` warns
#: about any other ``DLOCK_*`` name in the settings (a misspelt one is ignored)
KNOWN_SETTINGS: frozenset[str] = frozenset(DEFAULTS) | {
    "DLOCK_HOLDER_INFO",
    "DLOCK_METRICS",
    "DLOCK_TRACING",
    "DLOCK_TRACING_LOCK_NAMES",
    "DLOCK_QUORUMS",
}


#: each setting's value as read, until settings change
_READ: dict[str, Any] = {}
_MISSING = object()


class Settings:
    """Lazy view of the ``DLOCK_*`` settings with their defaults."""

    def _get(self, name: str) -> Any:
        value = _READ.get(name, _MISSING)
        if value is _MISSING:
            value = _READ[name] = getattr(settings, name, DEFAULTS[name])
        return value

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
        value = _READ.get("DLOCK_LEASE_SYNCHRONOUS_COMMIT", _MISSING)  # (read per statement)
        if value is _MISSING:
            value = self._get("DLOCK_LEASE_SYNCHRONOUS_COMMIT")
        return bool(value)

    @property
    def MIDDLEWARE_RULES(self) -> object:  # noqa: N802
        """Rules of ``LockMiddleware`` (validated by dlock.E020-E027)."""
        return self._get("DLOCK_MIDDLEWARE_RULES")

    @property
    def WORKER_JOBS(self) -> object:  # noqa: N802
        """Jobs of ``manage.py dlock_runworker`` (validated by dlock.E030-E033)."""
        return self._get("DLOCK_WORKER_JOBS")

    @property
    def DIRECT_DATABASES(self) -> dict[str, str]:  # noqa: N802
        """Alias -> alias of the same database reached without a pooler (dlock.E050)."""
        value = self._get("DLOCK_DIRECT_DATABASES")
        return dict(value) if isinstance(value, dict) else {}

    @property
    def ADVISORY_FENCING(self) -> bool:  # noqa: N802
        """Whether advisory locks take fencing numbers (only ``True`` enables it)."""
        return self._get("DLOCK_ADVISORY_FENCING") is True

    @property
    def DEADLOCK_TIMEOUT(self) -> float | None:  # noqa: N802
        """Seconds a lease waiter waits before it looks for a deadlock (``None``: never).

        Raises:
            ValueError: the setting is invalid (dlock.E007).
        """
        return self._optional_seconds("DLOCK_DEADLOCK_TIMEOUT", deadlock_timeout_error)

    @property
    def LONG_HOLD(self) -> float | None:  # noqa: N802
        """Seconds after which a held lease counts as held long (``None``: never).

        Raises:
            ValueError: the setting is invalid (dlock.E008).
        """
        return self._optional_seconds("DLOCK_LONG_HOLD", long_hold_error)

    def _optional_seconds(self, name: str, error: Callable[[Any], str | None]) -> float | None:
        """A setting of seconds or ``None``, checked by ``error`` (its check's words)."""
        value = self._get(name)
        problem = error(value)
        if problem is not None:
            raise ValueError(f"the {name} setting is invalid: {problem}")
        return None if value is None else float(value)


conf = Settings()


#: the checks a lock's defaults pass when read, and the error a bad value raises
_DEFAULT_CHECKS: dict[str, tuple[Callable[[Any], str | None], type[Exception]]] = {
    "DLOCK_DEFAULT_STRATEGY": (strategy_error, StrategyNotSupported),
    "DLOCK_DEFAULT_TTL": (ttl_error, ValueError),
    "DLOCK_DEFAULT_TIMEOUT": (timeout_error, ValueError),
    "DLOCK_RETRY_INTERVAL": (retry_interval_error, ValueError),
}

#: the checked value of each default a lock reads, until settings change
_CHECKED: dict[str, Any] = {}


def checked(setting: str) -> Any:
    """The value of a lock default (``DLOCK_DEFAULT_*``, ``DLOCK_RETRY_INTERVAL``), checked.

    A bad value raises a named error (``ValueError``, ``StrategyNotSupported``)
    before any SQL. Read when a lock is used, never when it is created, and
    remembered until a ``setting_changed`` signal (``override_settings``)
    says otherwise, so that the hot path does not re-read and re-check the
    settings on every call.
    """
    try:
        return _CHECKED[setting]
    except KeyError:
        pass
    value = conf._get(setting)
    check, error = _DEFAULT_CHECKS[setting]
    problem = check(value)
    if problem is not None:
        raise error(f"the {setting} setting: {problem}")
    if setting in ("DLOCK_DEFAULT_TTL", "DLOCK_DEFAULT_TIMEOUT") and value is not None:
        value = float(value)
    _CHECKED[setting] = value
    return value


@receiver(setting_changed)
def _forget_checked(setting: str, **kwargs: Any) -> None:
    if setting in DEFAULTS:
        _READ.pop(setting, None)
    if setting in _DEFAULT_CHECKS:
        _CHECKED.clear()


def lock_alias(using: str | None = None) -> str:
    """The database alias of the lock table: ``using``, else the router's choice.

    The router is asked for the write database of
    :class:`django_dlock.models.Lock`; ``"default"`` if it has no opinion.
    """
    if using is not None:
        return using
    if not router.routers:  # no router: Django's answer, without the call
        return "default"
    global _lock_model
    if _lock_model is None:  # (imported once: an import statement costs as much as a dozen calls)
        from django_dlock.models import Lock

        _lock_model = Lock
    return router.db_for_write(_lock_model) or "default"


_lock_model: type[Model] | None = None


T = TypeVar("T")


class _Unset:
    def __repr__(self) -> str:
        return "<default>"


UNSET: Any = _Unset()


class FromSetting(Generic[T]):
    """An option of an object: the value given to it, else its setting's (checked when read).

    The given value lives in the instance attribute ``_<option>_arg``;
    ``unset`` is the value that means "not given".
    """

    def __init__(self, setting: str, unset: Any = None) -> None:
        self.setting = setting
        self.unset = unset
        self.attr = ""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.attr = f"_{name}_arg"

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> FromSetting[T]: ...

    @overload
    def __get__(self, instance: object, owner: type[Any]) -> T: ...

    def __get__(self, instance: object, owner: type[Any]) -> T | FromSetting[T]:
        if instance is None:
            return self
        value: T = instance.__dict__[self.attr]
        if value is self.unset:
            # (the cache is read here first: this runs several times per acquire)
            value = _CHECKED[self.setting] if self.setting in _CHECKED else checked(self.setting)
        return value
