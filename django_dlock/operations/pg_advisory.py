"""PostgreSQL advisory locks as an operator sees them.

:func:`advisory_locks` lists the advisory locks held or awaited in the lock
database (``pg_locks`` joined with ``pg_stat_activity``), :func:`advisory_key`
reads the key a ``pg_locks`` row stands for, and :func:`terminate_backend`
ends the session of a holder: the only way to free a session advisory lock
that is not yours.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any

from django.db import connections

from django_dlock.keys import hash64
from django_dlock.operations.lease_rows import candidate_names

__all__ = [
    "AdvisoryLock",
    "advisory_key",
    "advisory_key_of",
    "advisory_locks",
    "is_postgresql",
    "terminate_backend",
]

logger = logging.getLogger("django_dlock")


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
