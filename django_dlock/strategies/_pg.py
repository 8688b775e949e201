"""PostgreSQL helpers shared by the advisory strategies and ``row``.

Where an advisory lock shows in ``pg_locks`` (:data:`PG_LOCKS_MATCH`, with
:func:`django_dlock.keys.pg_locks_ids`), the ``lock_timeout`` of a bounded wait
(:func:`lock_timeout_ms`), the SQLSTATE of an error (:func:`sqlstate`) and
the ``DLOCK_ADVISORY_FENCING`` setting (:func:`fencing`). See the PostgreSQL
documentation on advisory locks and on the ``pg_locks`` view.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from django_dlock.retry import Deadline

if TYPE_CHECKING:
    from django_dlock.exceptions import LockDeadlock
from django_dlock.strategies.connection import psycopg3

#: ``lock_timeout`` is an int4 of milliseconds: longer waits go in steps
MAX_LOCK_TIMEOUT_MS = 2_000_000_000

#: SQL for the oid of the current database (``pg_locks.database``)
DATABASE = "(SELECT oid FROM pg_database WHERE datname = current_database())"

#: SQL that finds a key in ``pg_locks``: classid, objid, objsubid (unsigned)
PG_LOCKS_MATCH = (
    "locktype = 'advisory' AND granted AND database = " + DATABASE + " AND classid = "
    "%s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s"
)


#: the install command that brings psycopg 3 (from a checkout of the project)
PSYCOPG_INSTALL = 'pip install -e ".[postgresql]"'


def require_psycopg3(what: str) -> None:
    """Raise :class:`StrategyNotSupported` naming the missing driver, if it is missing."""
    if not psycopg3():
        from django_dlock.exceptions import StrategyNotSupported

        raise StrategyNotSupported(
            f"{what} needs psycopg 3, which is not installed (Django runs PostgreSQL "
            f"on psycopg2 here): install the postgresql extra, `{PSYCOPG_INSTALL}` in "
            "a checkout of django-dlock, or use the lease strategy"
        )


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a (Django-wrapped) PostgreSQL error, if any."""
    for err in (exc, exc.__cause__):
        code = getattr(err, "sqlstate", None) or getattr(err, "pgcode", None)
        if code:
            return str(code)
    return None


def deadlock_error(name: str, exc: BaseException) -> LockDeadlock:
    """PostgreSQL's deadlock error (SQLSTATE 40P01) while waiting for ``name``,
    as :class:`~django_dlock.LockDeadlock`: the server's own detection chose
    this waiter to give up. Its detail names the processes of the cycle."""
    from django_dlock.exceptions import LockDeadlock

    cause = exc.__cause__ if sqlstate(exc) is None or exc.__cause__ is not None else exc
    diag = getattr(cause, "diag", None)
    detail = str(getattr(diag, "message_detail", None) or "") or str(exc)
    pids = list(dict.fromkeys(re.findall(r"Process (\d+)", detail)))
    return LockDeadlock(
        f"PostgreSQL detected a deadlock while waiting for {name!r}; this waiter gives "
        f"up (take several locks in one lock([...]) to avoid this): {detail.strip()}",
        keys=(name,),
        holders=tuple(f"backend pid {pid}" for pid in pids),
    )


def lock_timeout_ms(deadline: Deadline) -> int | None:
    """``lock_timeout`` for the next wait: 0 = forever, ``None`` = no time left."""
    if deadline.timeout is None:
        return 0
    left = deadline.remaining()
    if left <= 0:
        return None
    return min(max(1, math.ceil(left * 1000)), MAX_LOCK_TIMEOUT_MS)


_fencing: bool | None = None


def fencing() -> bool:
    """``DLOCK_ADVISORY_FENCING``: whether advisory locks take fencing numbers.

    Read once (a missing setting costs a raised error to find out), and
    again after a ``setting_changed`` signal (``override_settings``).
    """
    global _fencing
    if _fencing is None:
        _fencing = getattr(settings, "DLOCK_ADVISORY_FENCING", False) is True
    return _fencing


@receiver(setting_changed)
def _forget_fencing(setting: str, **kwargs: Any) -> None:
    global _fencing
    if setting == "DLOCK_ADVISORY_FENCING":
        _fencing = None
