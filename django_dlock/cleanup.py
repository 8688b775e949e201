"""Deleting free lease rows in batches, without losing fencing history.

Free rows (released or expired) are deleted in batches so no transaction
holds many row locks, and a batch never deletes a live lease: the
``DELETE`` re-checks ``expire_at`` on the database clock for every row, so a
row re-acquired between the batch's selection and its deletion is kept.

* PostgreSQL: each batch is one ``DELETE`` addressed by ``ctid`` (no index
  scan per row; see PERFORMANCE.md, lesson 5). Fencing numbers come from the
  ``django_dlock_fence`` sequence, so deleting rows loses nothing, except
  for the clock-based numbers of the fast durability mode, which can be
  above the sequence: when the mode is on, or a row's number is above the
  sequence (one query before the first batch), each batch also raises the
  sequence above the highest number it deletes.
* SQLite, MySQL/MariaDB: each batch is one short transaction that first
  raises ``FenceFloor`` to the highest fencing number it deletes, so a key
  acquired again later starts above every number issued before.
"""

from __future__ import annotations

from collections.abc import Callable

from django.db import connections, transaction

from django_dlock import dbclock

TABLE = "django_dlock_lock"
FLOOR = "django_dlock_fencefloor"

# One batch: delete by ctid, re-checking expiry on the database clock.
_PG_PLAIN_BATCH = f"""
DELETE FROM {TABLE}
WHERE ctid = ANY(ARRAY(
        SELECT ctid FROM {TABLE}
        WHERE expire_at <= statement_timestamp() - %s * interval '1 second'
        LIMIT %s))
  AND expire_at <= statement_timestamp() - %s * interval '1 second'
"""

# The same batch, also raising the fence sequence above every number it
# deletes (for clock-based fences of the fast durability mode).
_PG_BATCH = f"""
WITH deleted AS ({_PG_PLAIN_BATCH} RETURNING fence),
top AS (SELECT count(*) AS n, max(fence) AS fence FROM deleted)
SELECT n, CASE WHEN fence > (SELECT last_value FROM django_dlock_fence)
               THEN setval('django_dlock_fence', fence) END
FROM top
"""

# Can a row carry a fence above the sequence? Only a clock-based fence of the
# fast durability mode can; then every batch raises the sequence.
_PG_FENCES_AHEAD = f"""
SELECT COALESCE(max(fence), 0) > (SELECT last_value FROM django_dlock_fence) FROM {TABLE}
"""


def _pg_fences_ahead(using: str) -> bool:
    from django_dlock.conf import conf

    if not conf.LEASE_SYNCHRONOUS_COMMIT:
        return True
    with connections[using].cursor() as cur:
        cur.execute(_PG_FENCES_AHEAD)
        row = cur.fetchone()
    return bool(row and row[0])


def count_free(using: str, older_than: float = 0.0) -> int:
    """How many rows a cleanup with ``older_than`` would delete now."""
    connection = connections[using]
    cutoff = dbclock.now_plus_sql(connection)
    with connection.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM {TABLE} WHERE expire_at <= {cutoff}", [-older_than])
        row = cur.fetchone()
    return int(row[0]) if row else 0


def delete_batch(
    using: str, batch_size: int, older_than: float = 0.0, *, fences_ahead: bool | None = None
) -> int:
    """Delete up to ``batch_size`` rows free for at least ``older_than`` seconds.

    ``fences_ahead`` (PostgreSQL): whether rows may carry fencing numbers
    above the fence sequence, so that the batch must raise the sequence over
    what it deletes; ``None`` finds out (one query). Returns the number of
    rows deleted (0 when nothing is left).
    """
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    if older_than < 0:
        raise ValueError("older_than must be >= 0")
    connection = connections[using]
    if connection.vendor == "postgresql":
        if fences_ahead is None:
            fences_ahead = _pg_fences_ahead(using)
        params = [older_than, batch_size, older_than]
        with connection.cursor() as cur:
            if not fences_ahead:
                cur.execute(_PG_PLAIN_BATCH, params)
                return int(cur.rowcount)
            cur.execute(_PG_BATCH, params)
            row = cur.fetchone()
            return int(row[0]) if row else 0
    return _generic_batch(using, batch_size, older_than)


def _generic_batch(using: str, batch_size: int, older_than: float) -> int:
    connection = connections[using]
    cutoff = dbclock.now_plus_sql(connection)
    lock_floor = " FOR UPDATE" if connection.vendor == "mysql" else ""
    with transaction.atomic(using=using), connection.cursor() as cur:
        # On MySQL the floor row lock orders us with acquirers that insert
        # new rows (they read the floor with LOCK IN SHARE MODE). On SQLite
        # the first write below takes the database's write lock.
        cur.execute(f"SELECT value FROM {FLOOR} WHERE id = 1{lock_floor}")
        row = cur.fetchone()
        floor = int(row[0]) if row else None
        cur.execute(
            f"SELECT id, fence FROM {TABLE} WHERE expire_at <= {cutoff} ORDER BY id LIMIT %s",
            [-older_than, batch_size],
        )
        rows = cur.fetchall()
        if not rows:
            return 0
        ids = [r[0] for r in rows]
        highest = max(int(r[1]) for r in rows)
        if floor is None:
            cur.execute(f"INSERT INTO {FLOOR} (id, value) VALUES (1, %s)", [highest])
        elif highest > floor:
            cur.execute(f"UPDATE {FLOOR} SET value = %s WHERE id = 1", [highest])
        marks = ", ".join(["%s"] * len(ids))
        cur.execute(
            f"DELETE FROM {TABLE} WHERE id IN ({marks}) AND expire_at <= {cutoff}",
            [*ids, -older_than],
        )
        return int(cur.rowcount)


def delete_free(
    using: str,
    *,
    batch_size: int = 10_000,
    older_than: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Delete every row free for at least ``older_than`` seconds, in batches.

    ``progress(batch_deleted, total_so_far)`` is called after each batch.
    Returns the total number of rows deleted.
    """
    total = 0
    fences_ahead = _pg_fences_ahead(using) if connections[using].vendor == "postgresql" else None
    while True:
        deleted = delete_batch(using, batch_size, older_than, fences_ahead=fences_ahead)
        if deleted == 0:
            return total
        total += deleted
        if progress is not None:
            progress(deleted, total)
