"""MySQL/MariaDB user locks (``GET_LOCK``) as an operator sees them.

The ``advisory`` strategy on MySQL/MariaDB holds ``GET_LOCK`` user locks.
:func:`user_locks` lists django-dlock's ones where the server can show them
(``performance_schema.metadata_locks``, or MariaDB's ``METADATA_LOCK_INFO``
plugin), and :func:`user_lock_holder` finds the holder of one key
(``IS_USED_LOCK``), which works on every server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db import connections

from django_dlock.operations.lease_rows import candidate_names

__all__ = [
    "CANNOT_LIST_USER_LOCKS",
    "UserLock",
    "UserLocks",
    "is_mysql",
    "user_lock_holder",
    "user_locks",
]


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
