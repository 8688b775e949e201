"""The ``row`` strategy: a row lock on the key's row of the ``Lock`` table.

``SELECT … FOR UPDATE`` on the row named after the key, in the caller's
transaction (PostgreSQL, MySQL 8 / MariaDB 10.6+; refused on SQLite). The
lock is held until the transaction ends; see :mod:`.xact` for what
transaction-scoped locks share (``transaction.atomic`` required,
``release()`` refused, holdings end with the transaction, waits in a
savepoint).

* **Try** is one statement that locks the row if no one else has it
  (``FOR UPDATE SKIP LOCKED``, which raises no error, so the caller's
  transaction needs no savepoint); on PostgreSQL, only when it returns no
  row does a second one ask whether the row exists (someone else holds it,
  or it is missing)::

      SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE SKIP LOCKED
      SELECT EXISTS (SELECT 1 FROM django_dlock_lock WHERE name = %s)

* **A missing row** is inserted as a *free* lease row (empty token,
  ``expire_at`` = now, so the ``lease`` strategy and ``dlock_cleanup`` see it
  free) on a separate autocommit connection, so that it is committed and
  visible to everyone at once, then the try is repeated. Under REPEATABLE
  READ or SERIALIZABLE (the Django setting ``OPTIONS["isolation_level"]``),
  where a row committed after the transaction's snapshot stays invisible,
  the row is created before the first look.
* **Waiting**: PostgreSQL waits in ``FOR UPDATE`` with ``lock_timeout`` set
  for the statement (one statement sets it, waits and restores it);
  MySQL/MariaDB set ``innodb_lock_wait_timeout`` (whole seconds) around the
  ``FOR UPDATE`` and poll with ``SKIP LOCKED`` and the retry interval for the
  last fraction of a second. Both wait inside a savepoint, so a timeout
  leaves the caller's transaction usable.
* **Fencing**: on PostgreSQL ``nextval('django_dlock_fence')``, drawn when
  ``fence`` is first read while the row is locked (most holders never read
  it: the lock itself is one statement), in a transaction of its own that
  commits (and is flushed) before the number is handed out
  (:meth:`~django_dlock.strategies.transactional.TransactionScoped.draw_fence`):
  drawn in the caller's transaction, a number could be issued again after a
  crash of the server, since that transaction never commits. On MySQL/MariaDB a row lock
  has no fencing number (``fence`` is ``None``): a number stored in the row
  would be rolled back with the caller's transaction and issued twice.

The row strategy and the ``lease`` strategy use the same rows but do not
exclude each other: pick one strategy per key.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DatabaseUnavailable, DLockError, StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline, interval
from django_dlock.strategies._pg import (
    MAX_LOCK_TIMEOUT_MS,
    deadlock_error,
    lock_timeout_ms,
    sqlstate,
)
from django_dlock.strategies.base import Grant, Request, Strategy
from django_dlock.strategies.connection import (
    cursor,
    fetch_one,
    in_savepoint,
    lock_connection,
    with_reconnect,
)
from django_dlock.strategies.transactional import TransactionScoped
from django_dlock.tables import FENCE_FLOOR_TABLE, LOCK_TABLE

TABLE = LOCK_TABLE

# The try: a row if the row is ours now. Only when none comes back does a
# second look ask whether the row exists (held by someone else, or missing):
# a free key costs what SELECT ... FOR UPDATE costs, and the busy or missing
# one a round trip more.
_PG_TRY = f"SELECT 1 FROM {TABLE} WHERE name = %s FOR UPDATE SKIP LOCKED"
_PG_PRESENT = f"SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s)"

# Sets lock_timeout for the transaction, waits for the row lock and restores
# lock_timeout, in this order (the CTEs fix it).
_PG_WAIT = f"""
WITH t AS MATERIALIZED (SELECT current_setting('lock_timeout') AS prev,
                               set_config('lock_timeout', %s, true) AS cur),
     l AS MATERIALIZED (SELECT r.id FROM {TABLE} r, t WHERE r.name = %s FOR UPDATE OF r)
SELECT l.id IS NOT NULL, set_config('lock_timeout', t.prev, true)
FROM t LEFT JOIN l ON true
"""

_PG_CREATE = (
    f"INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
    "VALUES (%s, '', '', 0, NULL, statement_timestamp()) ON CONFLICT (name) DO NOTHING"
)

_MYSQL_TRY = (
    f"SELECT (SELECT id FROM {TABLE} WHERE name = %s FOR UPDATE SKIP LOCKED), "
    f"EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s)"
)
_MYSQL_WAIT = f"SELECT id FROM {TABLE} WHERE name = %s FOR UPDATE"
_MYSQL_SET_WAIT = (
    "SET @django_dlock_wait = @@SESSION.innodb_lock_wait_timeout, "
    "SESSION innodb_lock_wait_timeout = %s"
)
_MYSQL_RESET_WAIT = "SET SESSION innodb_lock_wait_timeout = @django_dlock_wait"
# The fence of a new row starts at the fence floor, as the lease strategy's do.
_MYSQL_CREATE = (
    f"INSERT IGNORE INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at) "
    f"SELECT %s, '', '', COALESCE((SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1), 0), "
    f"NULL, UTC_TIMESTAMP(6) FROM DUAL WHERE NOT EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s)"
)
#: innodb_lock_wait_timeout's maximum: "forever"
_MYSQL_FOREVER = 1073741824
#: MySQL error numbers: lock wait timeout, deadlock, NOWAIT
_MYSQL_TIMEOUT, _MYSQL_DEADLOCK, _MYSQL_NOWAIT = 1205, 1213, 3572

#: the grants (one each: a grant is a tuple): the number drawn when first read, none
_LATER, _NO_FENCE = Grant(None, later=True), Grant(None)

#: how often a row that keeps disappearing is re-created before giving up
_MAX_CREATIONS = 5


def _mysql_errno(exc: BaseException) -> int | None:
    for err in (exc, exc.__cause__):
        args = getattr(err, "args", ())
        if args and isinstance(args[0], int):
            return int(args[0])
    return None


def _read_committed(connection: BaseDatabaseWrapper) -> bool:
    """Whether the connection's configured isolation level reads committed rows."""
    level = getattr(connection, "isolation_level", None)
    if level is None:
        return True
    if isinstance(level, int) and not hasattr(level, "name"):
        return level in (1, 4)  # psycopg2: READ COMMITTED, READ UNCOMMITTED
    text = str(getattr(level, "name", level)).lower().replace("_", " ")
    return text in ("read committed", "read uncommitted")


class RowStrategy(TransactionScoped):
    """Row locks on the ``Lock`` table, in the caller's transaction (module docstring)."""

    name = "row"
    family = "row"

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        if connection.vendor not in ("postgresql", "mysql"):
            raise StrategyNotSupported(
                f"the row strategy needs PostgreSQL or MySQL/MariaDB; database "
                f"{connection.alias!r} is {connection.vendor}: use the lease strategy"
            )

    # -- acquire ---------------------------------------------------------------

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        connection = self.atomic_connection(req)
        if (
            connection.vendor == "mysql"
            and not connection.features.has_select_for_update_skip_locked
        ):
            raise StrategyNotSupported(
                "the row strategy needs SELECT ... FOR UPDATE SKIP LOCKED "
                "(MySQL 8.0.1+ or MariaDB 10.6+)"
            )
        if self.sibling_holds(connection, req):
            if deadline.timeout == 0:
                return None
            raise self.refuse_sibling_wait(req)
        creations = 0
        if not _read_committed(connection):
            self._create(req)  # before the transaction's snapshot may be taken
            creations += 1
        while True:
            got, present = self._try(connection, req)
            if not got and present and not deadline.expired():
                if connection.vendor == "postgresql":
                    got, present = self._pg_wait(connection, req, deadline)
                else:
                    got, present = self._mysql_wait(connection, req, deadline, policy)
            if got:
                self.remember(connection, req)
                # PostgreSQL: the fencing number is drawn when first read (draw_fence)
                return _LATER if connection.vendor == "postgresql" else _NO_FENCE
            if present:
                return None  # held by someone else until the deadline
            if creations >= _MAX_CREATIONS:
                raise DLockError(
                    f"the row of {req.key.name!r} stays invisible to this transaction: it "
                    "was created after the transaction's snapshot (REPEATABLE READ or "
                    "SERIALIZABLE). Acquire row locks first in the transaction, use READ "
                    "COMMITTED, or use the advisory_xact strategy"
                )
            self._create(req)
            creations += 1

    def _try(self, connection: BaseDatabaseWrapper, req: Request) -> tuple[bool, bool]:
        """One look: (locked by us now, the row exists)."""
        if connection.vendor == "postgresql":
            # Prepared on the caller's connection (see ``execute``): parsed
            # and planned once per session, not at every call.
            if fetch_one(connection, _PG_TRY, [req.key.name]) is not None:
                return True, True
            row = fetch_one(connection, _PG_PRESENT, [req.key.name])
            return False, bool(row[0])
        with cursor(connection) as cur:
            cur.execute(_MYSQL_TRY, [req.key.name, req.key.name])
            row = cur.fetchone()
        return row[0] is not None, bool(row[1])

    def _pg_wait(
        self, connection: BaseDatabaseWrapper, req: Request, deadline: Deadline
    ) -> tuple[bool, bool]:
        while True:
            timeout_ms = lock_timeout_ms(deadline)
            if timeout_ms is None:
                return False, True
            try:
                with in_savepoint(connection) as cur:
                    cur.execute(_PG_WAIT, [str(timeout_ms), req.key.name])
                    row = cur.fetchone()
            except DatabaseError as exc:
                state = sqlstate(exc)
                if state == "55P03" and timeout_ms == MAX_LOCK_TIMEOUT_MS:
                    continue
                if state == "40P01":  # the server's deadlock detection chose us
                    raise deadlock_error(req.key.name, exc) from exc
                if state in ("55P03", "57014"):
                    return False, True  # lock_timeout, statement_timeout
                raise
            if not row[0]:
                return False, False  # the row was deleted while we waited
            return True, True

    def _mysql_wait(
        self,
        connection: BaseDatabaseWrapper,
        req: Request,
        deadline: Deadline,
        policy: RetryInterval,
    ) -> tuple[bool, bool]:
        attempt = 0
        while True:
            if deadline.timeout is None:
                seconds = _MYSQL_FOREVER
            else:
                left = deadline.remaining()
                if left <= 0:
                    return False, True
                seconds = int(left)
            if seconds < 1:
                # innodb_lock_wait_timeout counts whole seconds: poll the rest.
                time.sleep(max(0.0, min(interval(policy, attempt), deadline.remaining())))
                attempt += 1
                got, present = self._try(connection, req)
                if got or not present:
                    return got, present
                continue
            try:
                found = self._mysql_wait_once(connection, req, seconds)
            except DatabaseError as exc:
                errno = _mysql_errno(exc)
                if errno in (_MYSQL_TIMEOUT, _MYSQL_NOWAIT):
                    continue
                if errno == _MYSQL_DEADLOCK:
                    raise DLockError(
                        f"deadlock while waiting for the row of {req.key.name!r}: the "
                        "database rolled back the whole transaction"
                    ) from exc
                raise
            return found, found

    def _mysql_wait_once(self, connection: BaseDatabaseWrapper, req: Request, seconds: int) -> bool:
        with in_savepoint(connection) as cur:
            cur.execute(_MYSQL_SET_WAIT, [seconds])
            try:
                cur.execute(_MYSQL_WAIT, [req.key.name])
                return cur.fetchone() is not None
            finally:
                cur.execute(_MYSQL_RESET_WAIT)

    def _create(self, req: Request) -> None:
        """Insert the key's row, free, committed at once on a separate connection
        (reconnected once if it had dropped: the statement changes nothing twice)."""

        def create(side: BaseDatabaseWrapper) -> None:
            sql = _PG_CREATE if side.vendor == "postgresql" else _MYSQL_CREATE
            params: list[Any] = [req.key.name]
            if side.vendor != "postgresql":
                params.append(req.key.name)
            with cursor(side) as cur:
                cur.execute(sql, params)

        with_reconnect(req.alias, create)

    # -- inspect ---------------------------------------------------------------

    def owned(self, req: Request) -> bool:
        """True while the transaction that locked the row is open.

        A row lock cannot be lost while its transaction lives; there is no
        catalog of row locks to ask, so asked from the holder's thread the
        transaction's connection is asked whether it still answers (a
        database that cannot be reached raises :class:`DatabaseUnavailable`:
        its transaction, and the row lock, may be gone).
        """
        marker = self.marker(req)
        if marker is None or not marker.pending():
            return False
        connection = marker.connection()
        if connection is not None and connection is connections[req.alias]:
            try:
                fetch_one(connection, "SELECT 1", [])
            except DatabaseUnavailable:
                raise
            except DatabaseError:
                pass  # an aborted transaction still holds its locks until it ends
        return True

    def locked(self, alias: str, key: Key) -> bool:
        """Whether someone holds the row lock (looks with ``SKIP LOCKED``, holds nothing)."""
        connection = lock_connection(alias)
        with cursor(connection) as cur:
            if connection.vendor == "postgresql":
                cur.execute(
                    f"SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE name = %s), "
                    f"EXISTS (SELECT 1 FROM (SELECT id FROM {TABLE} WHERE name = %s "
                    "FOR UPDATE SKIP LOCKED) s)",
                    [key.name, key.name],
                )
                present, free = cur.fetchone()
            else:
                cur.execute(_MYSQL_TRY, [key.name, key.name])
                free_id, present = cur.fetchone()
                free = free_id is not None
        return bool(present) and not free


row = RowStrategy()
_implements_strategy: Strategy = row  # (checked by mypy)
