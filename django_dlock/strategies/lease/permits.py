"""A semaphore on the lease table: at most ``permits`` holders of one key at a time.

Each permit is a lease row of its own, a *slot*, named after the
semaphore's key with its number: ``semaphore:exports#0`` …
``semaphore:exports#2`` for ``permits=3``. A slot holds at most one live
lease, exactly like a lock's row, so at most ``permits`` callers hold
the semaphore at once; a holder that dies frees its slot when its lease
runs out, judged on the database clock. Everything a lock's lease does,
a permit does on its slot row (extend, renew, release, ``owned()``, the
loss reasons, ``guard()``): the grant records the slot in the request
(:attr:`~django_dlock.strategies.base.Request.row`) and the lease code
acts on that row.

Waiting is the lock's queue, first come, first served: the semaphore's
waiters take tickets under the semaphore's own name, and a caller takes a
free slot only when fewer live tickets are ahead of it than slots are
free (a newcomer has every live ticket ahead), so a waiter that needs a
permit is never overtaken by a newcomer. On PostgreSQL a permit's release
wakes the head of the semaphore's queue, and a waiter granted a permit
wakes as many waiters behind it as permits are still free (so permits
freed together are all handed on); elsewhere waiters poll.

A take is one statement on PostgreSQL and SQLite (an upsert of the first
free slot, guarded like a lock's, so two callers racing for the same slot
never both get it: the loser tries the next one), and one short
transaction on MySQL/MariaDB that locks the semaphore's slot rows
(created free on first use). On PostgreSQL, as a lock's row does, the
slot rows say whether anybody may wait (``queued``: a ticket flags every
slot row of its semaphore): a newcomer first tries the first slot alone,
which costs what a lock's acquire costs, and a permit's release wakes the
queue only when its row is flagged. The statement that picks among the
slots (and reads the queue only when one of them is flagged) runs when
that first slot is busy, and for waiters.

``permits`` is the caller's: ``permits=N`` uses slots ``0 … N-1``. Lowering
N while holders hold higher slots lets them finish; new grants count only
the first N slots, so the semaphore settles at N holders as they leave.
"""

from __future__ import annotations

import functools
from typing import Any

from django.db import IntegrityError, OperationalError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.conf import conf
from django_dlock.exceptions import StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.strategies import queue
from django_dlock.strategies.base import HELD, Request
from django_dlock.strategies.connection import (
    DEADLOCK_RETRIES,
    cursor,
    deadlocked,
    fetch_one,
    lock_wait_ended,
)
from django_dlock.strategies.lease.sql import (
    _FENCE,
    FAST_COMMIT,
    MYSQL_CREATE,
    TABLE,
    WAITERS,
    read,
)
from django_dlock.strategies.lease.strategy import QUEUED_AHEAD, LeaseStrategy
from django_dlock.strategies.lease.waiting import Look
from django_dlock.tables import FENCE_FLOOR_TABLE

__all__ = ["PermitStrategy", "permit_strategy", "slot_names"]

#: how many times a take races another caller for the same free slot before
#: it reports the semaphore full (each race means another caller took a permit)
_RACES = 8


def slot_names(key: Key, permits: int) -> list[str]:
    """The names of the lease rows of ``key``'s permits ``0 … permits-1``."""
    return [f"{key.name}#{i}" for i in range(permits)]


def _ahead(now: str) -> str:
    return (
        f"(SELECT count(*) FROM {WAITERS} w WHERE w.name = %s "
        f"AND w.expire_at > {now} AND w.id < %s)"
    )


def _pick(now: str) -> str:
    """CTEs ``live`` and ``pick``: the caller's own live slot, else the first
    free slot if fewer live tickets are ahead of the caller than slots are free."""
    return f"""live AS (
    SELECT l.name, l.token FROM {TABLE} l JOIN slots s ON l.name = s.name
    WHERE l.expire_at > {now}),
pick AS (
    SELECT s.name FROM slots s LEFT JOIN live ON live.name = s.name
    WHERE live.token = %s
       OR (live.name IS NULL AND {_ahead(now)} < %s - (SELECT count(*) FROM live))
    ORDER BY live.name IS NULL, s.i LIMIT 1)"""


# PostgreSQL: the queue is read only when one of the slot rows says that
# somebody may wait (``queued``: every ticket flags all the slot rows of its
# semaphore, see the queue). The taken slot's flag is cleared once no
# ticket but the caller's is left, judged after its row is locked.
_PG_PICK = """present AS (
    SELECT l.name, l.token, l.expire_at > {now} AS live, l.queued
    FROM {table} l JOIN slots s ON l.name = s.name),
pick AS (
    SELECT s.name FROM slots s LEFT JOIN present p ON p.name = s.name AND p.live
    WHERE p.token = %s
       OR (p.name IS NULL AND ((SELECT bool_or(queued) FROM present) IS NOT TRUE
           OR {ahead} < %s - (SELECT count(*) FROM present WHERE live)))
    ORDER BY p.name IS NULL, s.i LIMIT 1)"""


# PostgreSQL, a newcomer's first try: the first slot, when it is free and not
# flagged (every ticket flags its semaphore's first slot, and the flag is
# cleared only once no ticket is left), or the caller's own live lease on
# it; never while the caller's token holds another slot. As cheap as a
# lock's acquire; the full take (``_pg_take``) runs when it takes nothing.
# Parameters: the first slot, token, owner, ttl, then the other slots and
# the token. The other slots are listed one parameter each: PostgreSQL
# estimates an array parameter at ten elements, finds the plan it keeps for
# a prepared statement dearer than one planned for the values, and plans
# the statement again at every call.
_PG_FIRST_SLOT = """
INSERT INTO {table} AS l (name, token, owner, fence, acquired_at, expire_at)
SELECT %s, %s, %s, {fence}, statement_timestamp(),
       statement_timestamp() + %s * interval '1 second'
{others}
ON CONFLICT (name) DO UPDATE SET
    token = EXCLUDED.token,
    owner = EXCLUDED.owner,
    fence = GREATEST(EXCLUDED.fence, l.fence + 1),
    acquired_at = EXCLUDED.acquired_at,
    expire_at = EXCLUDED.expire_at
WHERE (l.token = EXCLUDED.token AND l.expire_at > statement_timestamp())
   OR (l.expire_at <= statement_timestamp() AND l.queued IS NOT TRUE)
RETURNING fence{returning}
"""


@functools.lru_cache(maxsize=128)
def _pg_first_slot(durable: bool, permits: int) -> str:
    others = (
        ""
        if permits == 1
        else f"WHERE NOT EXISTS (SELECT 1 FROM {TABLE} o WHERE o.name IN {_in(permits - 1)} "
        "AND o.token = %s AND o.expire_at > statement_timestamp())"
    )
    returning = "" if durable else FAST_COMMIT
    return _PG_FIRST_SLOT.format(
        table=TABLE, fence=_FENCE[durable], others=others, returning=returning
    )


@functools.lru_cache(maxsize=128)
def _pg_take(durable: bool, waiter: bool, permits: int) -> str:
    """A newcomer's take, or a waiter's (which also deletes its ticket and
    wakes as many waiters behind it as slots are still free). The slots are
    one parameter each, for the reason given above ``_pg_first_slot``."""
    now = "statement_timestamp()"
    returning = "" if durable else FAST_COMMIT
    pick = _PG_PICK.format(now=now, table=TABLE, ahead=_ahead(now))
    queued = queue.PG_QUEUED.format(name="%s", besides="%s")
    values = ", ".join(f"(%s::text, {i})" for i in range(permits))
    sql = f"""
WITH slots(name, i) AS (VALUES {values}),
{pick},
taken AS (
    INSERT INTO {TABLE} AS l (name, token, owner, fence, acquired_at, expire_at)
    SELECT pick.name, %s, %s, {_FENCE[durable]}, {now}, {now} + %s * interval '1 second'
    FROM pick
    ON CONFLICT (name) DO UPDATE SET
        token = EXCLUDED.token,
        owner = EXCLUDED.owner,
        fence = GREATEST(EXCLUDED.fence, l.fence + 1),
        acquired_at = EXCLUDED.acquired_at,
        expire_at = EXCLUDED.expire_at,
        queued = CASE WHEN l.queued THEN {queued} END
    WHERE l.token = EXCLUDED.token OR l.expire_at <= {now}
    RETURNING l.name, l.fence{returning})"""
    if not waiter:
        return f"""{sql}
SELECT (SELECT name FROM taken), (SELECT fence FROM taken), EXISTS (SELECT 1 FROM pick)
"""
    return f"""{sql},
gone AS (DELETE FROM {WAITERS} WHERE id = %s AND EXISTS (SELECT 1 FROM taken)),
wake AS (
    SELECT pg_notify('{queue.CHANNEL}', '{queue.WAKE_PREFIX}' || w.id) FROM (
        SELECT w.id FROM {WAITERS} w
        WHERE w.name = %s AND w.expire_at > {now} AND w.id > %s
        ORDER BY w.id LIMIT GREATEST(0, %s - 1 - (SELECT count(*) FROM present WHERE live))
    ) w WHERE EXISTS (SELECT 1 FROM taken))
SELECT (SELECT name FROM taken), (SELECT fence FROM taken), EXISTS (SELECT 1 FROM pick),
       (SELECT count(*) FROM wake)
"""


@functools.lru_cache(maxsize=64)
def _sqlite_take(permits: int) -> str:
    now = dbclock._NOW["sqlite"]
    now_plus = dbclock._NOW_PLUS["sqlite"]
    values = ", ".join(f"(%s, {i})" for i in range(permits))
    return f"""
WITH slots(name, i) AS (VALUES {values}),
{_pick(now)}
INSERT INTO {TABLE} (name, token, owner, fence, acquired_at, expire_at)
SELECT pick.name, %s, %s,
       COALESCE((SELECT value FROM {FENCE_FLOOR_TABLE} WHERE id = 1), 0) + 1, {now}, {now_plus}
FROM pick WHERE true
ON CONFLICT (name) DO UPDATE SET
    token = excluded.token,
    owner = excluded.owner,
    fence = {TABLE}.fence + 1,
    acquired_at = excluded.acquired_at,
    expire_at = excluded.expire_at
WHERE {TABLE}.token = excluded.token OR {TABLE}.expire_at <= {now}
RETURNING name, fence
"""


def _in(permits: int) -> str:
    return "(" + ", ".join(["%s"] * permits) + ")"


@functools.lru_cache(maxsize=64)
def _mysql_slots(permits: int) -> str:
    return (
        f"SELECT name, token, expire_at <= UTC_TIMESTAMP(6), fence FROM {TABLE} "
        f"WHERE name IN {_in(permits)} ORDER BY name FOR UPDATE"
    )


_MYSQL_AHEAD = (
    f"SELECT count(*) FROM {WAITERS} w WHERE w.name = %s "
    "AND w.expire_at > UTC_TIMESTAMP(6) AND w.id < %s"
)
_MYSQL_TAKE = (
    f"UPDATE {TABLE} SET acquired_at = UTC_TIMESTAMP(6), token = %s, owner = %s, fence = %s, "
    "expire_at = UTC_TIMESTAMP(6) + INTERVAL ROUND(%s * 1000000) MICROSECOND WHERE name = %s"
)


@functools.lru_cache(maxsize=64)
def _look(permits: int) -> str:
    names = _in(permits)
    return (
        f"SELECT (SELECT count(*) FROM {TABLE} WHERE name IN {names} AND expire_at > {{now}}), "
        f"(SELECT min({{left}}) FROM {TABLE} WHERE name IN {names} AND expire_at > {{now}}), "
        f"(SELECT count(*) FROM {WAITERS} w WHERE w.name = %s "
        "AND w.expire_at > {now} AND w.id < %s)"
    )


class PermitStrategy(LeaseStrategy):
    """The lease strategy handing out ``permits`` leases of one key (see the module)."""

    shares = False  # a permit is a holding of its own, never a shared one

    def __init__(self, permits: int) -> None:
        self.permits = permits

    def __repr__(self) -> str:
        return f"<lease strategy, {self.permits} permits>"

    # -- taking a permit -------------------------------------------------------

    def acquire_on(
        self, connection: BaseDatabaseWrapper, req: Request, ticket: int | None
    ) -> int | None:
        slots = slot_names(req.key, self.permits)
        place = queue.NEWCOMER if ticket is None else ticket
        vendor = connection.vendor
        # the parameters of the ``pick`` CTE, then of the row written
        pick = [req.token, req.key.name, place, self.permits]
        write = [req.token, req.owner, req.ttl]
        if vendor == "postgresql" and ticket is None:
            sql = _pg_first_slot(conf.LEASE_SYNCHRONOUS_COMMIT, self.permits)
            others = [*slots[1:], req.token] if self.permits > 1 else []
            first = [slots[0], *write, *others]
            found = fetch_one(connection, sql, first, True)
            if found is not None:
                req.row = slots[0]
                return int(found[0])
        for _race in range(_RACES):
            if vendor == "postgresql":
                sql = _pg_take(conf.LEASE_SYNCHRONOUS_COMMIT, ticket is not None, self.permits)
                params = [*slots, *pick, *write, req.key.name, place]
                if ticket is not None:
                    params += [ticket, req.key.name, ticket, self.permits]
                slot, fence, picked = fetch_one(connection, sql, params, True)[:3]
                if slot is None and picked:
                    continue  # another caller took that slot first: look again
            elif vendor == "sqlite":
                sql = _sqlite_take(self.permits)
                found = fetch_one(connection, sql, [*slots, *pick, *write], True)
                slot, fence = (None, None) if found is None else found
                if slot is not None and ticket is not None:
                    queue.forget(connection, ticket)
            else:
                slot, fence = self._mysql_take(connection, req, slots, place, ticket)
            if slot is None:
                return None
            req.row = str(slot)
            return int(fence)
        return None

    def _mysql_take(
        self,
        connection: BaseDatabaseWrapper,
        req: Request,
        slots: list[str],
        place: int,
        ticket: int | None,
    ) -> tuple[str | None, int | None]:
        # One short transaction that locks the semaphore's slot rows, decides
        # and writes. Missing slots (first use, or deleted by cleanup) are
        # created free first, so that the lock never falls on a gap. A
        # deadlock's victim (a cleanup or another statement may lock the
        # same rows in another order) runs again.
        for _attempt in range(DEADLOCK_RETRIES):
            with cursor(connection) as cur:
                cur.execute("START TRANSACTION")
                try:
                    cur.execute(_mysql_slots(self.permits), slots)
                    rows = cur.fetchall()
                    if len(rows) < len(slots):
                        cur.execute("ROLLBACK")
                        present = {row[0] for row in rows}
                        for name in slots:
                            if name not in present:
                                cur.execute(MYSQL_CREATE, [name])  # free, above the fence floor
                        continue
                    taken = self._mysql_decide(cur, req, slots, rows, place)
                    if taken is not None and ticket is not None:
                        cur.execute(f"DELETE FROM {WAITERS} WHERE id = %s", [ticket])
                except IntegrityError:
                    cur.execute("ROLLBACK")
                    continue
                except OperationalError as exc:
                    cur.execute("ROLLBACK")
                    if lock_wait_ended(exc):  # a slot held elsewhere until the deadline
                        return None, None
                    if deadlocked(exc):  # rolled back whole: nothing was taken
                        continue
                    raise
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT" if taken is not None else "ROLLBACK")
                return (None, None) if taken is None else taken
        return None, None

    def _mysql_decide(
        self, cur: Any, req: Request, slots: list[str], rows: list[Any], place: int
    ) -> tuple[str, int] | None:
        order = {name: i for i, name in enumerate(slots)}
        rows = sorted(rows, key=lambda row: order[row[0]])
        own = [row for row in rows if row[1] == req.token and not row[2]]
        free = [row for row in rows if row[2]]
        if own:
            chosen = own[0]
        else:
            if not free:
                return None
            cur.execute(_MYSQL_AHEAD, [req.key.name, place])
            if int(cur.fetchone()[0]) >= len(free):
                return None
            chosen = free[0]
        fence = int(chosen[3]) + 1  # a new grant, also over the caller's own live lease
        cur.execute(_MYSQL_TAKE, [req.token, req.owner, fence, req.ttl, chosen[0]])
        return str(chosen[0]), fence

    def enqueue(self, req: Request) -> int:
        """Take a ticket in the semaphore's queue; its number."""
        req.queue_rows = tuple(slot_names(req.key, self.permits))
        return queue.enqueue(req)

    # -- what waiters and callers see ------------------------------------------

    def _counts(self, alias: str, key: Key, ticket: int) -> tuple[int, float, int]:
        """Live permits, seconds until the first of them ends, live tickets ahead."""
        found = read(
            alias, _look(self.permits), [*slot_names(key, self.permits) * 2, key.name, ticket]
        )
        if found is None:
            return 0, -1.0, 0
        live, left, ahead = found
        return int(live), -1.0 if left is None else float(left), int(ahead)

    def look(self, req: Request, ticket: int) -> Look:
        live, left, ahead = self._counts(req.alias, req.key, ticket)
        free = self.permits - live
        if ahead < free:
            return Look(-1.0, False)  # a permit is free for this waiter
        if free > 0:
            return Look(-1.0, True)  # free permits, kept for the waiters ahead
        return Look(left, False)

    def locked(self, alias: str, key: Key) -> bool:
        """Whether every permit is held (an acquire would have to wait)."""
        live, _, _ = self._counts(alias, key, queue.NEWCOMER)
        return live >= self.permits

    def busy_reason(self, alias: str, key: Key) -> str:
        live, _, ahead = self._counts(alias, key, queue.NEWCOMER)
        if live < self.permits and ahead:
            return QUEUED_AHEAD
        if live >= self.permits:
            return f"has no free permit (all {self.permits} are held)"
        return HELD

    def seconds_left(self, alias: str, key: Key) -> float:
        """Seconds until the first held permit ends (<= 0: a permit is free now)."""
        live, left, _ = self._counts(alias, key, queue.NEWCOMER)
        return left if live >= self.permits else -1.0

    def take_over(self, req: Request, over: str) -> int | None:
        raise StrategyNotSupported("a semaphore's permits cannot be taken over")


@functools.lru_cache(maxsize=256)
def permit_strategy(permits: int) -> PermitStrategy:
    """The lease strategy with ``permits`` permits per key (one object per count)."""
    return PermitStrategy(permits)
