"""The ``advisory_xact`` strategy: PostgreSQL transaction-level advisory locks.

``pg_try_advisory_xact_lock`` / ``pg_advisory_xact_lock`` (``_shared`` with
``shared=True``) on the caller's own connection, inside its
``transaction.atomic`` block, on the keys of :mod:`django_dlock.keys`. The
lock ends with the transaction (see
:mod:`django_dlock.strategies.transactional` for what that means for
``release()``, savepoints and async code), so it is safe behind PgBouncer in
transaction mode and Django's connection pool: nothing outlives the
transaction. A wait that times out or fails runs inside a savepoint, so the
caller's transaction stays usable, and ``lock_timeout`` is set for the wait
only (``set_config(..., true)`` and restored in the same statement; a failed
wait is rolled back with its savepoint, which also restores it). Fencing
numbers (``DLOCK_ADVISORY_FENCING``) come from
``nextval('django_dlock_fence')``, drawn when ``fence`` is first read while
the lock is held, in a transaction of their own, committed and flushed
before the number is handed out
(:meth:`~django_dlock.strategies.transactional.TransactionScoped.draw_fence`),
so that a crash of the server cannot issue it again.
"""

from __future__ import annotations

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DLockError
from django_dlock.keys import Key, pg_locks_ids
from django_dlock.retry import Deadline
from django_dlock.strategies._pg import (
    MAX_LOCK_TIMEOUT_MS,
    PG_LOCKS_MATCH,
    deadlock_error,
    fencing,
    lock_timeout_ms,
    sqlstate,
)
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.connection import (
    fetch_one,
    in_savepoint,
    lock_connection,
    require_postgresql,
)
from django_dlock.strategies.transactional import TransactionScoped

# -- advisory_xact ---------------------------------------------------------------------


def _args_sql(key: Key) -> str:
    # CAST, not ``::``: with client-side binding ``-2147483648::int4`` would
    # parse as ``-(2147483648::int4)``, out of range.
    if len(key.advisory) == 1:
        return "CAST(%s AS bigint)"
    return "CAST(%s AS integer), CAST(%s AS integer)"


def _xact_try_sql(req: Request) -> str:
    # The value is 0 (acquired) or NULL. Built once per form.
    form = (req.shared, len(req.key.advisory))
    sql = _TRY_SQL.get(form)
    if sql is None:
        suffix = "_shared" if req.shared else ""
        sql = _TRY_SQL[form] = (
            f"SELECT CASE WHEN pg_try_advisory_xact_lock{suffix}({_args_sql(req.key)}) THEN 0 END"
        )
    return sql


#: the grants (one each: a grant is a tuple): the number drawn when first read, none
_LATER, _NO_FENCE = Grant(None, later=True), Grant(None)

#: (shared, key parts) -> the try statement
_TRY_SQL: dict[tuple[bool, int], str] = {}


def _xact_wait_sql(req: Request) -> str:
    # One statement: set lock_timeout for this transaction, wait in the
    # server's queue, restore lock_timeout. (A timeout rolls back the
    # savepoint around it, which restores lock_timeout too.)
    suffix = "_shared" if req.shared else ""
    return (
        "WITH t AS MATERIALIZED (SELECT current_setting('lock_timeout') AS prev, "
        "set_config('lock_timeout', %s, true) AS cur), "
        f"l AS MATERIALIZED (SELECT pg_advisory_xact_lock{suffix}({_args_sql(req.key)}) FROM t) "
        "SELECT 0, set_config('lock_timeout', t.prev, true) FROM l, t"
    )


class AdvisoryXactStrategy(TransactionScoped):
    """``pg_advisory_xact_lock`` in the caller's transaction (module docstring)."""

    name = "advisory_xact"
    family = "advisory_xact"
    shares = True

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        require_postgresql(self.name, connection)

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        connection = self.atomic_connection(req)
        if self.sibling_holds(connection, req):
            if deadline.timeout == 0:
                return None
            raise self.refuse_sibling_wait(req)
        args = list(req.key.advisory)
        # Prepared on the caller's connection (see ``execute``): the server
        # parses and plans the try once per session, not at every call.
        row = fetch_one(connection, _xact_try_sql(req), args)
        got = None if row is None else row[0]
        while got is None:
            timeout_ms = lock_timeout_ms(deadline)
            if timeout_ms is None:
                return None
            try:
                with in_savepoint(connection) as cur:
                    cur.execute(_xact_wait_sql(req), [str(timeout_ms), *args])
                    row = cur.fetchone()
            except DatabaseError as exc:
                state = sqlstate(exc)
                if state == "55P03" and timeout_ms == MAX_LOCK_TIMEOUT_MS:
                    continue  # a very long timeout, waited in steps
                if state == "40P01":  # the server's deadlock detection chose us
                    raise deadlock_error(req.key.name, exc) from exc
                if state in ("55P03", "57014"):
                    return None  # lock_timeout, statement_timeout
                raise
            got = None if row is None else row[0]
            if got is None:
                raise DLockError(f"waiting for {req.key.name!r} returned no row")
        self.remember(connection, req)
        # the fencing number (if on) is drawn when first read (draw_fence)
        return _LATER if fencing() else _NO_FENCE

    def owned(self, req: Request) -> bool:
        marker = self.marker(req)
        if marker is None or not marker.pending():
            return False
        connection = marker.connection()
        if connection is None or connection is not connections[req.alias]:
            return True  # asked from another thread: the transaction is still open
        mode = "ShareLock" if req.shared else "ExclusiveLock"
        sql = (
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND "
            + PG_LOCKS_MATCH
            + " AND mode = %s)"
        )
        row = fetch_one(connection, sql, [*pg_locks_ids(req.key), mode])
        return bool(row[0])

    def locked(self, alias: str, key: Key) -> bool:
        sql = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE " + PG_LOCKS_MATCH + ")"
        row = fetch_one(lock_connection(alias), sql, list(pg_locks_ids(key)))
        return bool(row[0])


advisory_xact = AdvisoryXactStrategy()
_implements_strategy: Strategy = advisory_xact  # (checked by mypy)
