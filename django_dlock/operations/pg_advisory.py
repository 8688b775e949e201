"""PostgreSQL advisory locks as an operator sees them.

:func:`advisory_locks` lists the advisory locks held or awaited in the lock
database (``pg_locks`` joined with ``pg_stat_activity``), :func:`advisory_key`
reads the key a ``pg_locks`` row stands for, :func:`advisory_names` finds the
lock names behind keys, and :func:`terminate_backend` ends the session of a
holder: the only way to free a session advisory lock that is not yours.

An advisory key is a hash of the lock's name (see :mod:`django_dlock.keys`),
so a name cannot be read back from a key: :func:`advisory_names` hashes the
names it knows (:data:`KNOWN_NAMES`, names given by the caller, and the
names in the lock and waiter tables) and keeps those whose key is locked.
"""

from __future__ import annotations

import ast
import datetime as dt
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connections

from django_dlock.exceptions import InvalidLockKey
from django_dlock.keys import NAMESPACES, hash64, make_key
from django_dlock.operations.lease_rows import candidate_names
from django_dlock.tables import LOCK_TABLE, WAITER_TABLE

__all__ = [
    "AdvisoryLock",
    "advisory_key",
    "advisory_key_of",
    "advisory_key_of_name",
    "advisory_locks",
    "advisory_names",
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


def advisory_key_of_name(name: str) -> tuple[int, ...] | None:
    """The advisory key of a lock name as stored or typed, or ``None``.

    ``"lock:x"`` and ``"x"`` (the ``lock:`` namespace) give one int8;
    a two-part name such as ``"lock('order', 42)"`` gives its two int4.
    """
    for candidate in candidate_names(name.strip()):
        key = _key_of_name(candidate)
        if key is not None:
            return key
    return None


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


#: names whose advisory keys are known without a row: the default election of
#: ``manage.py dlock_runworker`` (``LeaderElection("runworker")``, its default election)
KNOWN_NAMES = ("leader:runworker",)

# SQL for the signed 64-bit and 32-bit hashes of keys.hash64 / keys.hash32
_H64 = "('x' || left(encode(sha256(convert_to({}, 'UTF8')), 'hex'), 16))::bit(64)::bigint"
_H32 = "('x' || left(encode(sha256(convert_to({}, 'UTF8')), 'hex'), 8))::bit(32)::int"
_NAMES = f"(SELECT name FROM {LOCK_TABLE} UNION SELECT name FROM {WAITER_TABLE}) AS names"
_SPACES = "|".join(NAMESPACES)

# String keys "<namespace>:<key>" whose int8 key is one of %s.
_INT8_NAMES_SQL = f"""
SELECT name FROM {_NAMES}
WHERE name ~ '^({_SPACES}):' AND {_H64.format("name")} = ANY(%s::bigint[])
"""

# Two-part keys "<namespace>(<a>, <b>)", a part an int or a quoted string
# (hashed): those whose pg_locks (classid, objid) packed in a bigint is one of
# %s. A string part with a quote or an escape in its repr is not read here.
_PART = r"""(?:'([^'\\]*)'|"([^"\\]*)"|(-?[0-9]{1,10}))"""
_PAIR_RE = rf"^(?:{_SPACES})\({_PART}, {_PART}\)$"
_PAIR = "(COALESCE({h}, m[{n}]::bigint) & 4294967295)"
_PAIR_NAMES_SQL = rf"""
SELECT name FROM (
    SELECT name, regexp_match(name, %s) AS m FROM {_NAMES} WHERE name ~ '^({_SPACES})\('
) AS parsed
WHERE m IS NOT NULL
  AND (({_PAIR.format(h=_H32.format("COALESCE(m[1], m[2])"), n=3)} << 32)
       | {_PAIR.format(h=_H32.format("COALESCE(m[4], m[5])"), n=6)}) = ANY(%s::bigint[])
"""


def blocking_pids(using: str, pids: list[int]) -> dict[int, list[int]]:
    """For each waiting backend of ``pids``: the backends it waits for, as the
    server says (``pg_blocking_pids``). PostgreSQL only."""
    if not pids:
        return {}
    with connections[using].cursor() as cur:
        cur.execute(
            "SELECT p, pg_blocking_pids(p) FROM unnest(%s::int[]) AS p",
            [list(pids)],
        )
        return {int(pid): sorted(int(b) for b in blockers) for pid, blockers in cur.fetchall()}


def _key_of_name(name: str) -> tuple[int, ...] | None:
    """The advisory key of a stored name, or ``None`` if it is not one."""
    namespace, colon, rest = name.partition(":")
    try:
        if colon and namespace in NAMESPACES:
            return make_key(rest, namespace).advisory
        for namespace in NAMESPACES:
            if name.startswith(namespace + "("):
                parts = ast.literal_eval(name[len(namespace) :])
                if isinstance(parts, tuple):
                    return make_key(parts, namespace).advisory
    except (InvalidLockKey, ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
    return None


def _packed(key: tuple[int, ...]) -> int:
    """A two-part key's ``pg_locks`` (classid, objid) packed in one bigint."""
    packed = ((key[0] & 0xFFFFFFFF) << 32) | (key[1] & 0xFFFFFFFF)
    return _signed(packed, 64)  # as PostgreSQL's bigint shift wraps it


def advisory_names(
    using: str, keys: Iterable[tuple[int, ...]], names: Iterable[str] = ()
) -> dict[tuple[int, ...], str]:
    """The lock names of advisory ``keys`` (PostgreSQL), where one can be known.

    A key is named when it is the key of one of :data:`KNOWN_NAMES`, of
    ``names``, or of a name in the lock or waiter table of ``using`` (those
    are hashed in the database, PostgreSQL 11 or later). A two-part key
    whose parts were both ints has the same key in every namespace: the
    name found first is shown. Keys of no known name are left out.
    """
    wanted = set(keys)
    found: dict[tuple[int, ...], str] = {}

    def take(candidates: Iterable[str]) -> None:
        for name in candidates:
            key = _key_of_name(name)
            if key is not None and key in wanted and key not in found:
                found[key] = name

    take([*KNOWN_NAMES, *(c for name in names for c in candidate_names(name))])
    connection = connections[using]
    if connection.vendor != "postgresql":
        return found
    connection.ensure_connection()
    if int(getattr(connection, "pg_version", 0) or 0) < 110000:  # no sha256()
        return found
    single = sorted(k[0] for k in wanted - set(found) if len(k) == 1)
    pairs = sorted(_packed(k) for k in wanted - set(found) if len(k) == 2)
    with connection.cursor() as cur:
        if single:
            cur.execute(_INT8_NAMES_SQL, [single])
            take(sorted(row[0] for row in cur.fetchall()))
        if pairs:
            cur.execute(_PAIR_NAMES_SQL, [_PAIR_RE, pairs])
            take(sorted(row[0] for row in cur.fetchall()))
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
