"""Every argument and setting validator, one function per kind of value.

The same functions serve the system checks (at start-up) and the objects
that take the value (before any SQL runs), so a value is judged the same
way wherever it comes from. A ``*_error`` function returns why a value is
invalid, or ``None``; :func:`validated` turns that into a ``ValueError``.
"""

from __future__ import annotations

import math

__all__ = [
    "JITTER",
    "MAX_SECONDS",
    "STRATEGIES",
    "alias_error",
    "bool_error",
    "contention_policy_error",
    "direct_databases_error",
    "positive_seconds",
    "retry_after_error",
    "retry_interval_error",
    "seconds_or_none",
    "strategy_error",
    "timeout_error",
    "ttl_error",
    "validate_timing",
    "validated",
]

#: the strategies a lock can use
STRATEGIES = ("lease", "row", "advisory", "advisory_xact")

#: the longest lease (and hold) in seconds, about 31 years: every database
#: can add it to its clock (longer ones overflow a date or an interval). A
#: timeout longer than this waits forever, like ``None``.
MAX_SECONDS = 1e9


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def ttl_error(value: object) -> str | None:
    """Return why ``value`` is not a valid lease TTL, or ``None``."""
    # (_is_number, inline: checked for every lock made)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return f"ttl must be a number of seconds, not {type(value).__name__}"
    assert isinstance(value, (int, float))
    if not math.isfinite(value) or value <= 0:
        return f"ttl must be a finite number of seconds > 0, got {value!r}"
    if value > MAX_SECONDS:
        return f"ttl must be at most {MAX_SECONDS:g} seconds (about 31 years), got {value!r}"
    return None


def timeout_error(value: object) -> str | None:
    """Return why ``value`` is not a valid timeout (None, or seconds >= 0).

    Any number of seconds >= 0 is one: a timeout above :data:`MAX_SECONDS`
    (``float("inf")`` too) waits forever, like ``None``.
    """
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):  # (_is_number, inline)
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


def alias_error(alias: object, where: str = "") -> str | None:
    """Return why ``alias`` is not a database alias (naming the known ones), or ``None``.

    ``where`` is added after the alias, e.g. ``" in using=[...]"``.
    """
    from django.db import connections

    if isinstance(alias, str) and alias in connections:
        return None
    known = ", ".join(connections) or "none"
    return f"unknown database alias {alias!r}{where} (known: {known})"


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


#: the most permits a semaphore may have (a permit's number is part of its row's name)
MAX_PERMITS = 1000


def permits_error(value: object) -> str | None:
    """Return why ``value`` is not a semaphore's number of permits, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"permits must be a whole number, got {value!r}"
    if not 1 <= value <= MAX_PERMITS:
        return f"permits must be between 1 and {MAX_PERMITS}, got {value}"
    return None


def validated(problem: str | None) -> None:
    """Raise ``ValueError(problem)`` unless ``problem`` is ``None``."""
    if problem is not None:
        raise ValueError(problem)


def seconds_or_none(value: object, what: str, allow_zero: bool) -> float | None:
    """``value`` as float seconds (``None`` stays ``None``), at most :data:`MAX_SECONDS`.

    Raises:
        ValueError: not a finite number of seconds > 0 (>= 0 with ``allow_zero``).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{what} must be a finite number of seconds {bound}, got {value!r}")
    if value > MAX_SECONDS:
        raise ValueError(f"{what} must be at most {MAX_SECONDS:g} seconds, got {value!r}")
    return float(value)


def positive_seconds(value: object, what: str) -> float:
    """``value`` as float seconds > 0 (no upper bound).

    Raises:
        ValueError: not a finite number of seconds > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


#: Kubernetes' jitter factor: renew_deadline must exceed retry * JITTER
JITTER = 1.2


def validate_timing(
    lease: object, renew_deadline: object, retry: object
) -> tuple[float, float, float]:
    """Check ``lease > renew_deadline > retry * 1.2``; return the three as floats.

    Raises:
        ValueError: a value is not a positive number, or the rule is broken.
    """
    lease_s = positive_seconds(lease, "lease")
    deadline_s = positive_seconds(renew_deadline, "renew_deadline")
    retry_s = positive_seconds(retry, "retry")
    if not lease_s > deadline_s:
        raise ValueError(
            f"lease ({lease_s:g} s) must be greater than renew_deadline ({deadline_s:g} s): "
            "a leader must give up before its lease can be taken over"
        )
    if not deadline_s > retry_s * JITTER:
        raise ValueError(
            f"renew_deadline ({deadline_s:g} s) must be greater than retry * {JITTER} "
            f"({retry_s * JITTER:g} s): a leader must get more than one renewal attempt "
            "before its deadline"
        )
    return lease_s, deadline_s, retry_s


def retry_after_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``retry_after`` (None or int >= 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"retry_after must be None or whole seconds >= 0, got {value!r}"
    return None


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


#: longest ticket lease accepted for ``DLOCK_QUEUE_TICKET_TTL`` (a dead waiter blocks its
#: queue this long)
MAX_TICKET_TTL = 3600.0


def ticket_ttl_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``DLOCK_QUEUE_TICKET_TTL``, or ``None``."""
    number = value if _is_number(value) else math.nan
    assert isinstance(number, (int, float))
    if not 0 < number <= MAX_TICKET_TTL:  # (NaN compares false)
        return f"it must be a number of seconds > 0 and <= {MAX_TICKET_TTL:g}, got {value!r}"
    return None


#: longest wait accepted for ``DLOCK_DEADLOCK_TIMEOUT`` before a waiter looks for a deadlock
MAX_DEADLOCK_TIMEOUT = 3600.0


def deadlock_timeout_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``DLOCK_DEADLOCK_TIMEOUT``, or ``None``."""
    if value is None:
        return None
    number = value if _is_number(value) else math.nan
    assert isinstance(number, (int, float))
    if not 0 < number <= MAX_DEADLOCK_TIMEOUT:  # (NaN compares false)
        return (
            f"it must be None (no deadlock detection) or a number of seconds > 0 and "
            f"<= {MAX_DEADLOCK_TIMEOUT:g}, got {value!r}"
        )
    return None


def long_hold_error(value: object) -> str | None:
    """Return why ``value`` is not a valid ``DLOCK_LONG_HOLD``, or ``None``."""
    if value is None:
        return None
    number = value if _is_number(value) else math.nan
    assert isinstance(number, (int, float))
    if not 0 < number < math.inf:  # (NaN compares false)
        return f"it must be None (off) or a number of seconds > 0, got {value!r}"
    return None
