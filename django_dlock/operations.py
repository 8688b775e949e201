"""Manual override for operators: inspect and force-release locks.

Shared by the admin and the operator commands (``dlock_list``,
``dlock_show``, ``dlock_release``):

* :func:`leases` lists lease rows with their state judged on the database
  clock;
* :func:`force_release` ends leases at once (``token = ''``,
  ``expire_at = now``), and on PostgreSQL wakes their waiters with
  ``pg_notify``. The old holder is not stopped: its next renew or release
  finds its token gone and raises :class:`~django_dlock.LockLost`;
* :func:`advisory_locks` lists the PostgreSQL advisory locks held or awaited
  in the lock database (``pg_locks`` joined with ``pg_stat_activity``), and
  :func:`terminate_backend` ends the session of a holder (the only way to
  free a session advisory lock that is not yours);
* :func:`user_locks` lists the MySQL/MariaDB ``GET_LOCK`` locks of the
  advisory strategy where the server can show them, and
  :func:`user_lock_holder` finds the holder of one key (``IS_USED_LOCK``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import BooleanField, Case, FloatField, Func, Q, QuerySet, Value, When
from django.db.models.sql.compiler import SQLCompiler

from django_dlock import dbclock, signals
from django_dlock.conf import lock_alias
from django_dlock.dbclock import DbNow
from django_dlock.keys import hash64
from django_dlock.models import Lock
from django_dlock.strategies.queue import PG_WAKE_HEAD

__all__ = [
    "AdvisoryLock",
    "Lease",
    "Released",
    "SecondsLeft",
    "advisory_locks",
    "default_alias",
    "find_lease",
    "force_release",
    "leases",
    "terminate_backend",
    "UserLock",
    "UserLocks",
    "user_lock_holder",
    "user_locks",
]

logger = logging.getLogger("django_dlock")

TABLE = Lock._meta.db_table
NOTIFY_CHANNEL = "django_dlock"
TOKEN_PREFIX = 8

_PG_FORCE = f"""
WITH released AS (
    UPDATE {TABLE} SET token = '', expire_at = statement_timestamp()
    WHERE id = %s AND token = %s
    RETURNING name
)
SELECT pg_notify('{NOTIFY_CHANNEL}', name), {PG_WAKE_HEAD.format(name="released.name")}
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
    """Add ``db_held`` and ``db_seconds_left``, both judged on the database clock."""
    return queryset.annotate(
        db_held=Case(
            When(expire_at__gt=DbNow(), then=Value(True)),
            default=Value(False),
            output_field=BooleanField(),
        ),
        db_seconds_left=SecondsLeft("expire_at"),
    )


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

    @classmethod
    def of(cls, row: Lock) -> Lease:
        held = bool(row.db_held)  # type: ignore[attr-defined]
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
    if name.partition(":")[0] in ("lock", "task", "leader"):
        return [name]
    return [name, f"lock:{name}"]


def find_lease(using: str, name: str) -> Lease | None:
    """The lease row named ``name`` (``"lock:x"``, or ``"x"`` for ``"lock:x"``)."""
    for candidate in candidate_names(name):
        row = annotate_state(Lock.objects.using(using).filter(name=candidate)).first()
        if row is not None:
            return Lease.of(row)
    return None


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


# -- PostgreSQL advisory locks -------------------------------------------------------


@dataclass(frozen=True)
class AdvisoryLock:
    """One row of ``pg_locks`` for an advisory lock (held or awaited)."""

    kind: str  # "int8" (one bigint key) or "int4 pair" (two int4 keys)
    key: tuple[int, ...]
    classid: int
    objid: int
    objsubid: int
    mode: str
    granted: bool
    pid: int
    application: str
    user: str
    client: str
    backend_state: str
    query_start: dt.datetime | None
    waiting_since: dt.datetime | None

    @property
    def key_text(self) -> str:
        if len(self.key) == 1:
            return str(self.key[0])
        return f"({self.key[0]}, {self.key[1]})"

    @property
    def shared(self) -> bool:
        return self.mode == "ShareLock"

    @property
    def state(self) -> str:
        return "held" if self.granted else "waiting"


def _signed(value: int, bits: int) -> int:
    return value - (1 << bits) if value >= 1 << (bits - 1) else value


def advisory_key(classid: int, objid: int, objsubid: int) -> tuple[str, tuple[int, ...]]:
    """The advisory key a ``pg_locks`` row stands for.

    ``objsubid = 1``: one int8 key, high half in ``classid``, low half in
    ``objid``; ``objsubid = 2``: two int4 keys in ``classid`` and ``objid``.
    """
    if objsubid == 1:
        return "int8", (_signed((classid << 32) | objid, 64),)
    return "int4 pair", (_signed(classid, 32), _signed(objid, 32))


def advisory_key_of(name: str) -> int:
    """The int8 advisory key of a string lock name (``"lock:x"`` or ``"x"``)."""
    return hash64(candidate_names(name)[-1])


_ADVISORY_SQL = """
SELECT l.classid::bigint, l.objid::bigint, l.objsubid, l.mode, l.granted, l.pid,
       COALESCE(a.application_name, ''), COALESCE(a.usename::text, ''),
       COALESCE(a.client_addr::text, ''), COALESCE(a.state, ''), a.query_start,
       {waiting_since}
FROM pg_locks l
LEFT JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory'
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, 12 NULLS FIRST, l.pid
"""


def is_postgresql(using: str) -> bool:
    return connections[using].vendor == "postgresql"


def advisory_locks(using: str) -> list[AdvisoryLock]:
    """Advisory locks held or awaited in the database of ``using`` (PostgreSQL).

    Returns an empty list on other databases.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return []
    connection.ensure_connection()
    version = int(getattr(connection, "pg_version", 0) or 0)
    waiting_since = (
        "l.waitstart"
        if version >= 140000
        else "CASE WHEN l.granted THEN NULL ELSE a.state_change END"
    )
    with connection.cursor() as cur:
        cur.execute(_ADVISORY_SQL.format(waiting_since=waiting_since))
        rows = cur.fetchall()
    found = []
    for row in rows:
        classid, objid, objsubid = int(row[0]), int(row[1]), int(row[2])
        kind, key = advisory_key(classid, objid, objsubid)
        found.append(
            AdvisoryLock(
                kind=kind,
                key=key,
                classid=classid,
                objid=objid,
                objsubid=objsubid,
                mode=row[3],
                granted=bool(row[4]),
                pid=int(row[5]),
                application=row[6],
                user=row[7],
                client=row[8],
                backend_state=row[9],
                query_start=row[10],
                waiting_since=row[11],
            )
        )
    return found


_TERMINATE_SQL = """
SELECT pg_terminate_backend(pid) FROM (
    SELECT DISTINCT pid FROM pg_locks
    WHERE locktype = 'advisory' AND pid = %s AND pid <> pg_backend_pid()
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
) AS holders
"""


def terminate_backend(using: str, pid: int, *, user: Any = None) -> bool:
    """End the PostgreSQL session ``pid`` if it holds or awaits an advisory lock.

    Only sessions that hold or wait for an advisory lock in this database
    can be ended this way (never our own). Their session locks are freed
    at once; the client sees its connection closed.

    Returns:
        Whether a session was ended.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cur:
        cur.execute(_TERMINATE_SQL, [pid])
        row = cur.fetchone()
    done = bool(row and row[0])
    if done:
        who = getattr(user, "get_username", lambda: None)() or "an operator"
        logger.warning("django-dlock: %s terminated PostgreSQL backend %s", who, pid)
    return done


# -- MySQL/MariaDB user locks (the advisory strategy's GET_LOCK) ------------------------


@dataclass(frozen=True)
class UserLock:
    """A MySQL/MariaDB user lock of django-dlock (``GET_LOCK``), held or awaited."""

    #: the ``GET_LOCK`` name: ``<readable prefix of the key>#<32 hex digits>``
    name: str
    state: str  # "held" or "waiting"
    connection_id: int
    user: str
    host: str

    @property
    def readable(self) -> str:
        """The readable prefix of the key's name (its first 31 characters)."""
        return self.name.rpartition("#")[0]


@dataclass(frozen=True)
class UserLocks:
    """What the server can show of its user locks (see :func:`user_locks`)."""

    locks: list[UserLock]
    #: where they were read, or ``None`` if the server cannot show them
    source: str | None
    #: why they cannot be listed (when ``source`` is ``None``)
    problem: str = ""


#: MySQL shows user locks there (and MariaDB from 10.5.2) when the
#: performance schema is on and its metadata-lock instrument is enabled
_PS_INSTRUMENT = (
    "SELECT ENABLED FROM performance_schema.setup_instruments "
    "WHERE NAME = 'wait/lock/metadata/sql/mdl'"
)
_PS_LOCKS = """
SELECT m.OBJECT_NAME, m.LOCK_STATUS, t.PROCESSLIST_ID,
       COALESCE(t.PROCESSLIST_USER, ''), COALESCE(t.PROCESSLIST_HOST, '')
FROM performance_schema.metadata_locks m
JOIN performance_schema.threads t ON t.THREAD_ID = m.OWNER_THREAD_ID
WHERE m.OBJECT_TYPE = 'USER LEVEL LOCK'
ORDER BY m.OBJECT_NAME, m.LOCK_STATUS, t.PROCESSLIST_ID
"""
#: MariaDB's metadata_lock_info plugin (granted locks only)
_MDL_INFO_PLUGIN = (
    "SELECT COUNT(*) FROM information_schema.PLUGINS "
    "WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE'"
)
_MDL_INFO_LOCKS = """
SELECT m.TABLE_SCHEMA, 'GRANTED', m.THREAD_ID, COALESCE(p.USER, ''), COALESCE(p.HOST, '')
FROM information_schema.METADATA_LOCK_INFO m
LEFT JOIN information_schema.PROCESSLIST p ON p.ID = m.THREAD_ID
WHERE m.LOCK_TYPE = 'User lock'
ORDER BY m.TABLE_SCHEMA, m.THREAD_ID
"""
CANNOT_LIST_USER_LOCKS = (
    "the server shows GET_LOCK locks only in performance_schema.metadata_locks "
    "(performance_schema = ON and the wait/lock/metadata/sql/mdl instrument enabled) "
    "or, on MariaDB, in information_schema.METADATA_LOCK_INFO "
    "(INSTALL SONAME 'metadata_lock_info'); neither is available. "
    "One key can still be looked up: dlock_show NAME (IS_USED_LOCK)"
)


def is_mysql(using: str) -> bool:
    return connections[using].vendor == "mysql"


def _ours(name: str) -> bool:
    readable, sep, digest = name.rpartition("#")
    return bool(sep) and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest)


def user_locks(using: str) -> UserLocks:
    """django-dlock's ``GET_LOCK`` locks on the MySQL/MariaDB server of ``using``.

    Read from ``performance_schema.metadata_locks`` (held and awaited) when
    the server records them there, else from MariaDB's
    ``information_schema.METADATA_LOCK_INFO`` (held only). Without either,
    the result says so (``source`` is ``None``). User locks are global to
    the server: locks of other databases of the server are listed too. Only
    names of django-dlock's form (``…#`` and 32 hex digits) are listed.
    """
    connection = connections[using]
    if connection.vendor != "mysql":
        return UserLocks([], None, "not a MySQL/MariaDB database")
    rows: list[Any] = []
    source: str | None = None
    with connection.cursor() as cur:
        cur.execute("SELECT @@performance_schema")
        row = cur.fetchone()
        if row is not None and int(row[0] or 0):
            cur.execute(_PS_INSTRUMENT)
            enabled = cur.fetchone()
            if enabled is not None and str(enabled[0]).upper() == "YES":
                cur.execute(_PS_LOCKS)
                rows, source = list(cur.fetchall()), "performance_schema.metadata_locks"
        if source is None:
            cur.execute(_MDL_INFO_PLUGIN)
            plugin = cur.fetchone()
            if plugin is not None and int(plugin[0]):
                cur.execute(_MDL_INFO_LOCKS)
                rows = list(cur.fetchall())
                source = "information_schema.METADATA_LOCK_INFO"
    if source is None:
        return UserLocks([], None, CANNOT_LIST_USER_LOCKS)
    found = [
        UserLock(
            name=str(name),
            state="held" if str(status).upper() == "GRANTED" else "waiting",
            connection_id=int(connection_id),
            user=str(user),
            host=str(host),
        )
        for name, status, connection_id, user, host in rows
        if name is not None and _ours(str(name))
    ]
    return UserLocks(found, source)


def user_lock_holder(using: str, name: str) -> tuple[str, int | None]:
    """``(GET_LOCK name, connection id holding it or None)`` of the lock ``name``.

    ``name`` is ``"lock:x"``, or ``"x"`` for ``"lock:x"`` (``IS_USED_LOCK``).
    """
    from django_dlock.strategies.advisory.mysql import database_name, lock_name

    mysql_name = lock_name(database_name(using), candidate_names(name)[-1])
    with connections[using].cursor() as cur:
        cur.execute("SELECT IS_USED_LOCK(%s)", [mysql_name])
        row = cur.fetchone()
    holder = None if row is None or row[0] is None else int(row[0])
    return mysql_name, holder
