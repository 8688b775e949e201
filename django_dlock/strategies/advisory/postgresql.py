"""The ``advisory`` strategy: PostgreSQL session-level advisory locks.

``pg_try_advisory_lock`` / ``pg_advisory_lock`` (``_shared`` variants with
``shared=True``: many readers, one writer) on a dedicated session of the
holder (see :mod:`django_dlock.strategies.advisory.sessions` for the connection model). The lock
is held until it is released or the session ends, so a crashed holder frees
it at once.

* **Keys**: a string key is ``pg_advisory_lock(bigint)`` with the key's
  64-bit hash, a two-part key ``(a, b)`` is ``pg_advisory_lock(int4, int4)``
  (see :mod:`django_dlock.keys`; :func:`pg_locks_ids` gives the
  ``classid``/``objid``/``objsubid`` an operator finds in ``pg_locks``).
* **Acquire** is one statement that also reports the backend pid::

      SELECT CASE WHEN pg_try_advisory_lock($1) THEN 0 END, pg_backend_pid()

  If that fails and the caller may wait, one more statement sets
  ``lock_timeout`` to what is left of the timeout and waits in
  PostgreSQL's own lock queue (FIFO, the lock is handed over at once when
  it is released); SQLSTATE 55P03 (``lock_not_available``) means the time
  ran out. ``pg_try_advisory_lock`` respects that queue: a newcomer does
  not overtake a waiter.
* **Release** is ``pg_advisory_unlock``; ``false`` (the session no longer
  holds the lock) is reported, never ignored: the front object raises
  :class:`~django_dlock.exceptions.LockLost`.
* The short statements (try, unlock, checks) are prepared once per session
  and run straight through libpq; waits go through psycopg so that they can
  be cancelled and interrupted.
* **Fencing** is opt-in: with ``DLOCK_ADVISORY_FENCING = True`` the
  acquiring statement also takes ``nextval('django_dlock_fence')`` (no extra
  round trip; a number strictly greater than every number issued before,
  for any key and strategy of the database). It is off by default because
  it is not free: ``nextval`` writes WAL every 32 numbers, and the commit of
  that statement then waits for a flush; measured, an uncontended
  acquire/release pair is about 20 % slower with it. Without it
  ``lock.fence`` is ``None``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from psycopg.types.numeric import Int4, Int8

from django_dlock.exceptions import DLockError
from django_dlock.keys import Key, pg_locks_ids
from django_dlock.retry import Deadline
from django_dlock.strategies._pg import (
    DATABASE,
    MAX_LOCK_TIMEOUT_MS,
    PG_LOCKS_MATCH,
    deadlock_error,
    fencing,
    lock_timeout_ms,
)
from django_dlock.strategies.advisory.acquire import AsyncWait, SessionAsyncAcquire
from django_dlock.strategies.advisory.sessions import (
    Session,
    Statement,
    WaitCancelled,
)
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.connection import (
    fetch_one,
    lock_connection,
    not_migrated,
    require_postgresql,
)
from django_dlock.strategies.fence import NEXT_FENCE

logger = logging.getLogger("django_dlock")


def lock_params(key: Key) -> list[bytes]:
    """Text parameters of the advisory lock functions for ``key`` (libpq)."""
    return [b"%d" % part for part in key.advisory]


def wait_params(key: Key) -> list[Any]:
    """Typed parameters of the advisory lock functions for ``key`` (psycopg)."""
    if len(key.advisory) == 1:
        return [Int8(key.advisory[0])]
    return [Int4(key.advisory[0]), Int4(key.advisory[1])]


def application_name(req: Request) -> bytes:
    """The session's ``application_name`` while it holds or awaits ``req``'s key:
    ``dlock`` and the holder's owner text (host, pid, thread or task, what it is
    doing), cut to PostgreSQL's 63 bytes; the database's own ``OPTIONS``
    ``application_name``, when the settings give one.

    Set by the acquiring statement only when the session's name is another
    (a new holder, or the same doing something else), and kept after the
    release: a session that holds nothing keeps its last holder's name until
    the next holder takes it (the pair of a holder that takes one key at a
    time, over and over, renames nothing: ``set_config`` is server work)."""
    own = _configured_name(req.alias)
    if own is not None:
        return own
    return f"dlock {req.owner}".encode()[:63].decode(errors="ignore").encode()


def _configured_name(alias: str) -> bytes | None:
    # (the alias's settings: the dict every thread's wrapper shares, read
    # without asgiref's per-thread look-up of a wrapper)
    name = connections.settings[alias].get("OPTIONS", {}).get("application_name")
    return None if name is None else str(name).encode()


def holds_params(req: Request) -> list[bytes]:
    """Parameters of :attr:`_Statements.holds`: where the key shows in ``pg_locks``."""
    classid, objid, objsubid = pg_locks_ids(req.key)
    mode = b"ShareLock" if req.shared else b"ExclusiveLock"
    return [b"%d" % classid, b"%d" % objid, b"%d" % objsubid, mode]


_BIGINT, _INT4, _TEXT = 20, 23, 25


@dataclass(frozen=True)
class _Statements:
    try_: Statement
    #: the try that also names the session after its holder
    try_named: Statement
    unlock: Statement
    holds: Statement
    #: run through psycopg (interruptible): %s placeholders
    wait: str


def _statements(shared: bool, parts: int, fencing: bool) -> _Statements:
    suffix = "_shared" if shared else ""
    args, types = ("$1", (_BIGINT,)) if parts == 1 else ("$1, $2", (_INT4, _INT4))
    wait_args = "%s::bigint" if parts == 1 else "%s::int4, %s::int4"
    fence = NEXT_FENCE if fencing else "0"
    # Without fencing the first column is 0 (acquired) or NULL.
    try_ = f"SELECT CASE WHEN pg_try_advisory_lock{suffix}({args}) THEN {fence} END, "
    return _Statements(
        try_=Statement(try_ + "pg_backend_pid()", types),
        # A session whose name is not its holder's takes it first (pg_locks rows
        # get a name in pg_stat_activity): the same statement, no round trip.
        try_named=Statement(
            try_ + f"set_config('application_name', ${len(types) + 1}, false), pg_backend_pid()",
            (*types, _TEXT),
        ),
        unlock=Statement(
            f"SELECT pg_advisory_unlock{suffix}({args}), pg_backend_pid()",
            types,
        ),
        holds=Statement(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND "
            "locktype = 'advisory' AND granted AND database = " + DATABASE + " AND "
            "classid = $1::oid AND objid = $2::oid AND objsubid = $3 AND mode = $4), "
            "pg_backend_pid()",
            (_BIGINT, _BIGINT, _INT4, _TEXT),
        ),
        # The CTEs fix the order: set lock_timeout, wait, then take the fence.
        wait=(
            "WITH t AS MATERIALIZED (SELECT set_config('lock_timeout', %s, false) AS v), "
            f"l AS MATERIALIZED (SELECT pg_advisory_lock{suffix}({wait_args}) FROM t) "
            f"SELECT {fence}, pg_backend_pid() FROM l"
        ),
    )


_SQL = {
    (shared, parts, fencing): _statements(shared, parts, fencing)
    for shared in (False, True)
    for parts in (1, 2)
    for fencing in (False, True)
}


def _sql(req: Request, fenced: bool = False) -> _Statements:
    return _SQL[(req.shared, len(req.key.advisory), fenced)]


class AdvisoryStrategy(SessionAsyncAcquire):
    """Session-level advisory locks on dedicated sessions (module docstring)."""

    name = "advisory"
    family = "advisory"
    shares = True

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        require_postgresql(self.name, connection)

    # -- the statements ------------------------------------------------------------

    def _take(
        self, session: Session, req: Request, deadline: Deadline, waiter: AsyncWait | None
    ) -> Grant | None:
        fenced = fencing()
        sql = _sql(req, fenced)
        name = application_name(req)
        if session.named == name:
            value = session.run(sql.try_, lock_params(req.key))[0]
        else:
            value = session.run(sql.try_named, [*lock_params(req.key), name])[0]
            session.named = name
        fence = None if value is None else int(value)
        if fence is None and not deadline.expired():
            fence = self._wait(session, req, sql, deadline, waiter)
        if fence is None:
            return None
        return Grant(fence if fenced else None)

    def _wait(
        self,
        session: Session,
        req: Request,
        sql: _Statements,
        deadline: Deadline,
        waiter: AsyncWait | None,
    ) -> int | None:
        """Wait in PostgreSQL's lock queue, bounded by ``lock_timeout``."""
        while True:
            timeout_ms = lock_timeout_ms(deadline)  # 0: wait forever
            if timeout_ms is None:
                return None
            try:
                row = session.wait(sql.wait, [str(timeout_ms), *wait_params(req.key)], waiter)
            except WaitCancelled:
                return None
            except psycopg.errors.LockNotAvailable:  # 55P03: lock_timeout ran out
                if deadline.timeout is not None and timeout_ms == MAX_LOCK_TIMEOUT_MS:
                    continue
                return None
            except psycopg.errors.DeadlockDetected as exc:
                error = deadlock_error(req.key.name, exc)
                logger.warning("django-dlock: %s", error)
                raise error from exc
            except psycopg.errors.QueryCanceled:
                # Our own cancellation, or someone's pg_cancel_backend(): the
                # lock may have been granted just before; find out.
                self._settle(session, req)
                if waiter is not None and waiter.cancelled:
                    return None
                continue
            return int(row[0])

    def _holds(self, session: Session, req: Request) -> bool:
        return bool(session.run(_sql(req).holds, holds_params(req))[0] == b"t")

    def _unlock(self, session: Session, req: Request) -> bool:
        return bool(session.run(_sql(req).unlock, lock_params(req.key))[0] == b"t")

    def _database_error(self) -> type[Exception]:
        return psycopg.Error

    def _failed(self, req: Request, exc: Exception) -> DLockError:
        if isinstance(exc, psycopg.errors.UndefinedTable):  # the fence sequence
            return not_migrated(req.alias)
        return DLockError(f"the advisory lock statement for {req.key.name!r} failed: {exc}")

    # -- inspect -------------------------------------------------------------------

    def locked(self, alias: str, key: Key) -> bool:
        sql = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE " + PG_LOCKS_MATCH + ")"
        row = fetch_one(lock_connection(alias), sql, list(pg_locks_ids(key)))
        return bool(row[0])


advisory = AdvisoryStrategy()
_implements_strategy: Strategy = advisory  # (checked by mypy)
