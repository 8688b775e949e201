"""Lease rows as an operator sees them, and how to end them by force.

:func:`leases` and :func:`find_lease` read lease rows with their state
judged on the database clock. :func:`force_release` ends leases at once
(``token = ''``, ``expire_at = now``), and on PostgreSQL wakes their waiters
with ``pg_notify``. The old holder is not stopped: its next renew or release
finds its token gone and raises :class:`~django_dlock.LockLost`.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, Case, FloatField, Func, Q, QuerySet, Value, When
from django.db.models.sql.compiler import SQLCompiler

from django_dlock import dbclock, long_holds, signals
from django_dlock.conf import lock_alias
from django_dlock.dbclock import DbNow
from django_dlock.models import Lock
from django_dlock.notify import CHANNEL
from django_dlock.strategies.lease.shared import READER_INFIX
from django_dlock.strategies.queue import PG_WAKE_HEAD

__all__ = [
    "Lease",
    "Released",
    "SecondsLeft",
    "annotate_state",
    "candidate_names",
    "default_alias",
    "find_lease",
    "force_release",
    "held_for",
    "is_held_long",
    "leases",
    "state_of",
    "token_prefix",
]

logger = logging.getLogger("django_dlock")

TABLE = Lock._meta.db_table
TOKEN_PREFIX = 8

# The queue a released row's waiters are in: the row's own, or for a
# semaphore's permit (semaphore:<key>#<n>) its semaphore's.
_QUEUE = (
    "CASE WHEN released.name LIKE 'semaphore:%%' "
    "THEN regexp_replace(released.name, '#[0-9]+$', '') ELSE released.name END"
)

_PG_FORCE = f"""
WITH released AS (
    UPDATE {TABLE} SET token = '', expire_at = statement_timestamp()
    WHERE id = %s AND token = %s
    RETURNING name
)
SELECT pg_notify('{CHANNEL}', name), {PG_WAKE_HEAD.format(name=_QUEUE)}
FROM released
"""


def default_alias() -> str:
    """The database the lease rows live in (the router's choice for ``Lock``)."""
    return lock_alias()


class SecondsLeft(Func):
    """Seconds from the database's now until a datetime column (negative: past)."""

    output_field = FloatField()

    def as_sql(  # type: ignore[override]
        self,
        compiler: SQLCompiler,
        connection: BaseDatabaseWrapper,
        **extra_context: Any,
    ) -> tuple[str, list[Any]]:
        column, params = compiler.compile(self.source_expressions[0])
        return dbclock.seconds_until_sql(connection, column), list(params)


def annotate_state(queryset: QuerySet[Lock]) -> QuerySet[Lock]:
    """Add ``db_held``, ``db_seconds_left`` and ``db_since_acquired`` (seconds
    until ``acquired_at``: negative), all judged on the database clock."""
    return queryset.annotate(
        db_held=Case(
            When(expire_at__gt=DbNow(), then=Value(True)),
            default=Value(False),
            output_field=BooleanField(),
        ),
        db_seconds_left=SecondsLeft("expire_at"),
        db_since_acquired=SecondsLeft("acquired_at"),
    )


def held_for(row: Lock) -> float | None:
    """Seconds since ``row`` (annotated by :func:`annotate_state`) was acquired,
    on the database clock; ``None`` if it never was."""
    since = row.db_since_acquired  # type: ignore[attr-defined]
    return None if since is None else max(0.0, -float(since))


def is_held_long(held: bool, seconds: float | None) -> bool:
    """Whether a lease held for ``seconds`` is held longer than ``DLOCK_LONG_HOLD``."""
    limit = long_holds.bound()
    return held and limit is not None and seconds is not None and seconds >= limit


def state_of(held: bool, token: str) -> str:
    """``"held"``, ``"expired"`` (ran out, never released) or ``"released"``."""
    if held:
        return "held"
    return "expired" if token else "released"


def token_prefix(token: str) -> str:
    """A short prefix of a token: enough to tell holders apart, never the token."""
    return f"{token[:TOKEN_PREFIX]}…" if token else ""


@dataclass(frozen=True)
class Lease:
    """A lease row as an operator sees it (state on the database clock)."""

    pk: int
    name: str
    state: str
    owner: str
    fence: int
    token_prefix: str
    acquired_at: dt.datetime | None
    expire_at: dt.datetime
    seconds_left: float
    #: seconds since it was acquired (database clock), ``None`` if never
    held_for: float | None = None
    #: held longer than ``DLOCK_LONG_HOLD``
    held_long: bool = False

    @classmethod
    def of(cls, row: Lock) -> Lease:
        held = bool(row.db_held)  # type: ignore[attr-defined]
        seconds = held_for(row)
        return cls(
            pk=row.pk,
            name=row.name,
            state=state_of(held, row.token),
            owner=row.owner,
            fence=row.fence,
            token_prefix=token_prefix(row.token),
            acquired_at=row.acquired_at,
            expire_at=row.expire_at,
            seconds_left=float(row.db_seconds_left or 0.0),  # type: ignore[attr-defined]
            held_for=seconds,
            held_long=is_held_long(held, seconds),
        )


def leases(using: str, *, held_only: bool = True, limit: int | None = None) -> list[Lease]:
    """Lease rows of ``using`` (only the held ones unless ``held_only=False``)."""
    queryset: QuerySet[Lock] = Lock.objects.using(using).all()
    if held_only:
        queryset = queryset.filter(expire_at__gt=DbNow())
    queryset = annotate_state(queryset).order_by("name")
    if limit is not None:
        queryset = queryset[:limit]
    return [Lease.of(row) for row in queryset]


def candidate_names(name: str) -> list[str]:
    """``name`` as stored, or with the ``lock:`` namespace if it has none."""
    if name.partition(":")[0] in ("lock", "task", "leader", "semaphore"):
        return [name]
    return [name, f"lock:{name}"]


def find_lease(using: str, name: str) -> Lease | None:
    """The lease row named ``name`` (``"lock:x"``, or ``"x"`` for ``"lock:x"``)."""
    for candidate in candidate_names(name):
        row = annotate_state(Lock.objects.using(using).filter(name=candidate)).first()
        if row is not None:
            return Lease.of(row)
    return None


def find_permits(using: str, name: str) -> list[Lease]:
    """The permit rows of the semaphore named ``name`` (``"semaphore:x"``, or
    ``"x"``), in permit order: ``semaphore:x#0``, ``#1``, ... (held or not)."""
    stored = name if name.startswith("semaphore:") else f"semaphore:{name}"
    pattern = re.compile(re.escape(stored) + r"#(\d+)")
    rows = annotate_state(Lock.objects.using(using).filter(name__startswith=f"{stored}#"))
    found = []
    for row in rows:
        match = pattern.fullmatch(row.name)
        if match is not None:
            found.append((int(match.group(1)), Lease.of(row)))
    return [lease for _, lease in sorted(found, key=lambda each: each[0])]


def find_readers(using: str, name: str) -> list[tuple[str, Lease]]:
    """The live readers of the read-write lock named ``name`` (``"lock:x"``):
    each reader's label (its row's last part: a digest of its holder, or
    ``"upgradeable"``) and its lease, in name order."""
    prefix = f"{name}{READER_INFIX}"
    rows = annotate_state(Lock.objects.using(using).filter(name__startswith=prefix))
    found = [(row.name[len(prefix) :], Lease.of(row)) for row in rows]
    return [(label, lease) for label, lease in sorted(found) if lease.state == "held"]


@dataclass(frozen=True)
class Released:
    """One lease that :func:`force_release` ended."""

    pk: int
    name: str
    owner: str
    fence: int


def force_release(
    using: str,
    *,
    pks: Iterable[int] | None = None,
    names: Iterable[str] | None = None,
    user: Any = None,
    source: str = "admin",
) -> list[Released]:
    """End the leases of the given rows now, whoever holds them.

    Each row is released by one statement that matches the token read just
    before, so a lease that changed hands in between is left alone. Rows
    already released are skipped. For each lease ended: a WARNING on the
    ``django_dlock`` logger and the ``lock_force_released`` signal.

    Returns:
        The leases that were ended.
    """
    if pks is None and names is None:
        raise ValueError("give pks or names")
    condition = Q()
    if pks is not None:
        condition |= Q(pk__in=list(pks))
    if names is not None:
        condition |= Q(name__in=list(names))
    rows = list(
        Lock.objects.using(using)
        .filter(condition)
        .exclude(token="")
        .values_list("pk", "name", "token", "owner", "fence")
    )
    connection = connections[using]
    released: list[Released] = []
    for pk, name, token, owner, fence in rows:
        with connection.cursor() as cur:
            if connection.vendor == "postgresql":
                cur.execute(_PG_FORCE, [pk, token])
                done = cur.fetchone() is not None
            else:
                now = dbclock.now_sql(connection)
                cur.execute(
                    f"UPDATE {TABLE} SET token = '', expire_at = {now} "
                    "WHERE id = %s AND token = %s",
                    [pk, token],
                )
                done = bool(cur.rowcount)
        if done:
            released.append(Released(pk=pk, name=name, owner=owner, fence=int(fence)))
    who = getattr(user, "get_username", lambda: None)() or source
    for item in released:
        logger.warning(
            "django-dlock: %s force-released %s (was held by %s, fence %s)",
            who,
            item.name,
            item.owner,
            item.fence,
            extra={
                "lock_name": item.name,
                "lock_fence": item.fence,
                "lock_owner": item.owner,
                "lock_source": source,
            },
        )
        signals.lock_force_released.send(
            Lock,
            name=item.name,
            owner=item.owner,
            fence=item.fence,
            using=using,
            user=user,
            source=source,
        )
    return released
