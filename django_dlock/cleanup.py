"""Deleting free lease rows in batches, without losing fencing history.

Free rows (released or expired) are deleted in batches so no transaction
holds many row locks, and a batch never deletes a live lease: the
``DELETE`` re-checks ``expire_at`` on the database clock for every row, so a
row re-acquired between the batch's selection and its deletion is kept.

A run is bounded by what was free when it started: :func:`delete_free` reads
a cutoff from the database clock once (now minus ``older_than``) and every
batch deletes only rows whose lease ended before it. Locks released while
the run goes on end after the cutoff, so a run under steady load finishes
after the rows that were free at its start, instead of chasing new ones.

* PostgreSQL: each batch is one ``DELETE`` addressed by ``ctid`` (no index
  scan per row). Fencing numbers come from the
  ``django_dlock_fence`` sequence, so deleting rows loses nothing, except
  for the clock-based numbers of the fast durability mode, which can be
  above the sequence: when the mode is on, or a row's number is above the
  sequence (one query before the first batch), each batch also raises the
  sequence above the highest number it deletes.
* SQLite, MySQL/MariaDB: each batch is one short transaction that also
  raises ``FenceFloor`` to the highest fencing number it deletes, so a key
  acquired again later starts above every number issued before. On
  MySQL/MariaDB a row that another session keeps locked (a stalled
  transaction) is skipped and left for a later run, with a warning in the
  log; the floor's row is locked last. On SQLite
  the transaction starts with ``BEGIN IMMEDIATE``, which waits (up to the
  database's ``timeout`` option) for the write lock; a batch that still
  finds the database locked is tried again until that timeout has passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from django.db import OperationalError, connections, transaction

from django_dlock import dbclock
from django_dlock.strategies.connection import again_if_deadlocked, lock_wait_ended
from django_dlock.tables import FENCE_FLOOR_TABLE, FENCE_SEQUENCE, LOCK_TABLE, WAITER_TABLE

logger = logging.getLogger("django_dlock")

TABLE = LOCK_TABLE
FLOOR = FENCE_FLOOR_TABLE
WAITERS = WAITER_TABLE

# A free row whose key has live waiters stays: its queue decides who is next.
# {{queue}}: the name of the row's queue (a SQL expression), {{now}}: the clock.
_NO_WAITERS = (
    f"NOT EXISTS (SELECT 1 FROM {WAITERS} w WHERE w.name = {{queue}} AND w.expire_at > {{now}})"
)

# PostgreSQL: a semaphore's permit row that a ticket flagged (``queued``)
# stays too while its semaphore has live waiters: the flag tells a newcomer
# to read the semaphore's queue. A permit row is named after its semaphore's
# key with ``#`` and the permit's number; no other row's name starts with
# ``semaphore``.
_PG_NO_WAITERS = _NO_WAITERS.format(
    queue=f"CASE WHEN {TABLE}.queued AND {TABLE}.name LIKE 'semaphore%%' "
    f"THEN regexp_replace({TABLE}.name, '#[0-9]+$', '') ELSE {TABLE}.name END",
    now="statement_timestamp()",
)

# One batch: delete by ctid, re-checking expiry against the run's cutoff
# (a time on the database clock, in the past: such a lease has ended). A row
# that a ticket flagged while the batch waited for it is a new row version,
# not the one judged free of tickets: the delete by ctid skips it.
# {{where}}: the part of the table the batch looks at: a range of the
# table's pages (a run walks the table once, in the order it lies on disk),
# or "AND id = ANY(%s)" for a chosen set of rows.
_PG_PLAIN_BATCH = f"""
DELETE FROM {TABLE}
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {TABLE}
        WHERE expire_at <= %s AND {_PG_NO_WAITERS}{{where}}
        LIMIT %s))
  AND expire_at <= %s
"""
#: a range of pages [first, end), read with a TID range scan (PostgreSQL 14+)
_PG_PAGES = " AND ctid >= %s::tid AND ctid < %s::tid"

# The same batch, also raising the fence sequence above every number it
# deletes (for clock-based fences of the fast durability mode).
_PG_BATCH = f"""
WITH deleted AS ({_PG_PLAIN_BATCH} RETURNING fence),
top AS (SELECT count(*) AS n, max(fence) AS fence FROM deleted)
SELECT n, CASE WHEN fence > (SELECT last_value FROM {FENCE_SEQUENCE})
               THEN setval('{FENCE_SEQUENCE}', fence) END
FROM top
"""

# Can a row carry a fence above the sequence? Only a clock-based fence of the
# fast durability mode can; then every batch raises the sequence.
_PG_FENCES_AHEAD = f"""
SELECT COALESCE(max(fence), 0) > (SELECT last_value FROM {FENCE_SEQUENCE}) FROM {TABLE}
"""

# The table's size in pages now, and rows per page as last analysed.
_PG_PAGES_NOW = f"""
SELECT pg_relation_size('{TABLE}') / current_setting('block_size')::int,
       CASE WHEN c.relpages > 0 AND c.reltuples > 0 THEN c.reltuples / c.relpages END
FROM pg_class c WHERE c.oid = '{TABLE}'::regclass
"""
#: rows per page when the table was never analysed (a lease row is about 150 bytes)
_PG_ROWS_PER_PAGE = 50


def _pg_fences_ahead(using: str) -> bool:
    from django_dlock.conf import conf

    if not conf.LEASE_SYNCHRONOUS_COMMIT:
        return True
    with connections[using].cursor() as cur:
        cur.execute(_PG_FENCES_AHEAD)
        row = cur.fetchone()
    return bool(row and row[0])


def cutoff(using: str, older_than: float = 0.0) -> Any:
    """Now minus ``older_than`` seconds on the database clock (a run's bound)."""
    connection = connections[using]
    with connection.cursor() as cur:
        cur.execute(f"SELECT {dbclock.now_plus_sql(connection)}", [-older_than])
        row = cur.fetchone()
    assert row is not None
    return row[0]


def count_free(using: str, older_than: float = 0.0) -> int:
    """How many rows a cleanup with ``older_than`` would delete now."""
    connection = connections[using]
    cutoff = dbclock.now_plus_sql(connection)
    with connection.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM {TABLE} WHERE expire_at <= {cutoff}", [-older_than])
        row = cur.fetchone()
    return int(row[0]) if row else 0


def _check(batch_size: int, older_than: float = 0.0) -> None:
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if older_than < 0:
        raise ValueError("older_than must be >= 0")


def _pg_batch(
    using: str, batch_size: int, before: Any, fences_ahead: bool, where: str, params: list[Any]
) -> int:
    """One PostgreSQL batch in ``where``; the number of rows deleted.

    A batch deletes rows in the order they lie in the table, where a
    ticket flags a semaphore's permit rows in slot order: locked in opposite
    orders, PostgreSQL rolls one of the two back, and the batch picked runs
    again (its snapshot judged rows that the ticket has changed since).
    """
    connection = connections[using]
    args = [before, *params, batch_size, before]

    def run() -> int:
        with connection.cursor() as cur:
            if not fences_ahead:
                cur.execute(_PG_PLAIN_BATCH.format(where=where), args)
                return int(cur.rowcount)
            cur.execute(_PG_BATCH.format(where=where), args)
            row = cur.fetchone()
            return int(row[0]) if row else 0

    return again_if_deadlocked(connection, run)


def _pg_walk(using: str, batch_size: int, before: Any) -> Iterator[int]:
    """A run's batches on PostgreSQL: the table's pages in order, a range of
    them at a time, each range again until it holds no more than
    ``batch_size`` rows to delete. The first range's size comes from the
    table's statistics, each next one's from what the last range held (aiming
    at nine tenths of a batch, at most twice as many pages). The pages are
    those the table has when the run begins: a row freed before the run lies
    in one of them."""
    fences_ahead = _pg_fences_ahead(using)
    with connections[using].cursor() as cur:
        cur.execute(_PG_PAGES_NOW)
        pages, per_page = cur.fetchone()
    step = max(1, int(0.9 * batch_size / float(per_page or _PG_ROWS_PER_PAGE)))
    first = in_range = 0
    while first < pages:
        span = [f"({first},0)", f"({first + step},0)"]
        deleted = _pg_batch(using, batch_size, before, fences_ahead, _PG_PAGES, span)
        in_range += deleted
        if deleted:
            yield deleted
        if deleted < batch_size:
            first += step
            step = max(1, min(2 * step, int(step * 0.9 * batch_size / max(in_range, 1))))
            in_range = 0


def _generic_batch(
    cur: Any, vendor: str, batch_size: int, before: Any, where: str, params: list[Any]
) -> tuple[int, int | None]:
    """One SQLite or MySQL/MariaDB batch among the rows ``where`` picks, in
    ``id`` order; the number deleted, and the highest ``id`` looked at (None:
    no row was left to delete).

    On MySQL/MariaDB the batch locks the rows it chose that nobody else holds
    (``SKIP LOCKED``: a row a stalled transaction keeps locked is left for a
    later run, never waited for), deletes those still free, and only then
    raises the fence floor, whose row every acquire of a new key reads: it
    holds that row for the end of its transaction alone, never while it
    waits for another. On SQLite the transaction holds the database's write
    lock from its start."""
    cur.execute(
        f"SELECT id, fence FROM {TABLE} WHERE expire_at <= %s "
        f"AND {_NO_WAITERS.format(queue=f'{TABLE}.name', now=dbclock._NOW[vendor])}{where} "
        "ORDER BY id LIMIT %s",
        [before, *params, batch_size],
    )
    rows = cur.fetchall()
    if not rows:
        return 0, None
    chosen = [r[0] for r in rows]
    marks = ", ".join(["%s"] * len(chosen))
    if vendor == "mysql":
        # the newest version of each row this batch could lock, and whether it is still free
        cur.execute(
            f"SELECT id, fence, expire_at <= %s FROM {TABLE} WHERE id IN ({marks}) "
            "FOR UPDATE SKIP LOCKED",
            [before, *chosen],
        )
        locked = cur.fetchall()
        if len(locked) < len(chosen):
            logger.warning(
                "django-dlock: cleanup left %d free lease row(s) that another session "
                "holds locked (a later run deletes them)",
                len(chosen) - len(locked),
            )
        rows = [(r[0], r[1]) for r in locked if r[2]]
        if not rows:
            return 0, max(chosen)
    found = [r[0] for r in rows]
    marks = ", ".join(["%s"] * len(found))
    cur.execute(f"DELETE FROM {TABLE} WHERE id IN ({marks}) AND expire_at <= %s", [*found, before])
    deleted = int(cur.rowcount)
    # A key acquired again later starts above every number deleted here (the
    # floor commits with the deletion; an acquire that creates a deleted
    # key's row waits for that row, then reads the floor).
    highest = max(int(r[1]) for r in rows)
    lock_floor = " FOR UPDATE" if vendor == "mysql" else ""
    cur.execute(f"SELECT value FROM {FLOOR} WHERE id = 1{lock_floor}")
    row = cur.fetchone()
    if row is None:
        cur.execute(f"INSERT INTO {FLOOR} (id, value) VALUES (1, %s)", [highest])
    elif highest > int(row[0]):
        cur.execute(f"UPDATE {FLOOR} SET value = %s WHERE id = 1", [highest])
    return deleted, max(chosen)


def _sqlite_busy_timeout(using: str) -> float:
    """The ``timeout`` option of a SQLite alias (seconds; Python's default is 5)."""
    options = connections[using].settings_dict.get("OPTIONS") or {}
    value = options.get("timeout", 5.0)
    return float(value) if isinstance(value, (int, float)) else 5.0


def _sqlite_batch(
    using: str, batch_size: int, before: Any, where: str, params: list[Any]
) -> tuple[int, int | None]:
    """One batch in a ``BEGIN IMMEDIATE`` transaction, tried again while the database is busy."""
    connection = connections[using]
    deadline = time.monotonic() + _sqlite_busy_timeout(using)
    pause = 0.01
    while True:
        with connection.cursor() as cur:
            try:
                cur.execute("BEGIN IMMEDIATE")
            except OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, 0.5)
                continue
            try:
                done = _generic_batch(cur, "sqlite", batch_size, before, where, params)
            except BaseException:
                cur.execute("ROLLBACK")
                raise
            cur.execute("COMMIT")
            return done


def _one_batch(
    using: str, batch_size: int, before: Any, where: str, params: list[Any]
) -> tuple[int, int | None]:
    """One SQLite or MySQL/MariaDB batch (see :func:`_generic_batch`); on
    MySQL/MariaDB run again when InnoDB picks it as a deadlock's victim."""
    connection = connections[using]
    if connection.vendor == "sqlite" and not connection.in_atomic_block:
        return _sqlite_batch(using, batch_size, before, where, params)

    def run() -> tuple[int, int | None]:
        with transaction.atomic(using=using), connection.cursor() as cur:
            return _generic_batch(cur, connection.vendor, batch_size, before, where, params)

    try:
        return again_if_deadlocked(connection, run)
    except OperationalError as exc:
        if connection.in_atomic_block or not lock_wait_ended(exc):
            raise
        # (the fence floor's row, held by a stalled transaction: the next run goes on)
        logger.warning("django-dlock: cleanup of %r stopped: %s", using, exc)
        return 0, None


def _id_walk(using: str, batch_size: int, before: Any) -> Iterator[int]:
    """A run's batches on SQLite and MySQL/MariaDB: the table in ``id``
    order, each batch after the highest ``id`` the last one looked at."""
    after = 0
    while True:
        deleted, last = _one_batch(using, batch_size, before, " AND id > %s", [after])
        if last is None:
            return
        if deleted:
            yield deleted
        after = last


def delete_free(
    using: str,
    *,
    batch_size: int = 10_000,
    older_than: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Delete every row that was free for at least ``older_than`` seconds when the run began.

    The run reads its :func:`cutoff` once, so rows freed while it goes on
    are left for the next run: it finishes under load. It walks the table
    once, in batches of at most ``batch_size`` rows, each in a transaction
    of its own: on PostgreSQL by ranges of the table's pages (a TID range
    scan, PostgreSQL 14 and later; older servers read the whole table for
    each batch), elsewhere in primary key order. ``progress(batch_deleted,
    total_so_far)`` is called after each batch that deleted rows. Returns
    the total number of rows deleted.
    """
    _check(batch_size, older_than)
    delete_dead_waiters(using)
    before = cutoff(using, older_than)
    walk = _pg_walk if connections[using].vendor == "postgresql" else _id_walk
    total = 0
    for deleted in walk(using, batch_size, before):
        total += deleted
        if progress is not None:
            progress(deleted, total)
    return total


def delete_free_rows(using: str, ids: Iterable[int], *, batch_size: int = 10_000) -> int:
    """Delete the rows among ``ids`` (primary keys) whose lease has ended.

    The same batches as :func:`delete_free`, on the chosen rows only: a row
    is deleted when its ``expire_at`` is not after the database's now (read
    once from the database clock, never this server's), so a held lease is
    never deleted, nor a free row whose key has live waiters; the fencing
    history is kept. Returns the number of rows deleted.
    """
    _check(batch_size)
    chosen = sorted(set(ids))
    if not chosen:
        return 0
    postgresql = connections[using].vendor == "postgresql"
    fences_ahead = _pg_fences_ahead(using) if postgresql else False
    before = cutoff(using)
    total = 0
    for start in range(0, len(chosen), batch_size):
        part = chosen[start : start + batch_size]
        if postgresql:
            where = " AND id = ANY(%s)"
            total += _pg_batch(using, len(part), before, fences_ahead, where, [part])
        else:
            where = f" AND id IN ({', '.join(['%s'] * len(part))})"
            total += _one_batch(using, len(part), before, where, part)[0]
    return total


# PostgreSQL: delete the tickets that ran out and wake the new head of each
# affected key that is free.
_PG_DEAD_WAITERS = f"""
WITH gone AS (
    DELETE FROM {WAITERS} WHERE expire_at <= statement_timestamp() RETURNING name
), names AS (SELECT DISTINCT name FROM gone),
woken AS (
    SELECT {{wake}} FROM names WHERE NOT EXISTS (
        SELECT 1 FROM {TABLE} l WHERE l.name = names.name AND l.expire_at > statement_timestamp()
    )
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM woken)
"""


def delete_dead_waiters(using: str) -> int:
    """Delete the waiter tickets whose own lease ran out (their waiters are gone).

    On PostgreSQL the new head of a free key is woken. Returns how many
    tickets were deleted.
    """
    from django_dlock.strategies.queue import PG_WAKE_HEAD

    connection = connections[using]
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            wake = PG_WAKE_HEAD.format(name="names.name")
            cur.execute(_PG_DEAD_WAITERS.format(wake=wake))
            row = cur.fetchone()
            return int(row[0]) if row else 0
        if connection.vendor == "mysql":
            return _mysql_dead_waiters(connection, cur)
        cur.execute(f"DELETE FROM {WAITERS} WHERE expire_at <= {dbclock.now_sql(connection)}", [])
        return int(cur.rowcount)


def _mysql_dead_waiters(connection: Any, cur: Any) -> int:
    """MySQL/MariaDB: delete the tickets that ran out, but for those that
    another session keeps locked (a stalled transaction): never waited for."""
    with transaction.atomic(using=connection.alias):
        cur.execute(
            f"SELECT id FROM {WAITERS} WHERE expire_at <= UTC_TIMESTAMP(6) FOR UPDATE SKIP LOCKED"
        )
        found = [row[0] for row in cur.fetchall()]
        if not found:
            return 0
        marks = ", ".join(["%s"] * len(found))
        cur.execute(f"DELETE FROM {WAITERS} WHERE id IN ({marks})", found)
        return int(cur.rowcount)
