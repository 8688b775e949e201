"""``python -m tests.benchmarks.lease_parts``: where an uncontended lease pair's time goes.

One psycopg connection, statements prepared, interleaved round by round
against the raw floor (:data:`tests.benchmarks.uncontended.FLOOR_LEASE_ACQUIRE`
and its DELETE): our own acquire and release statements run raw (the
server's share of our pair, with the least client work), the same without
their queue parts (the "no live ticket ahead" checks and the wake-up of the
queue's head), that again with the floor's DELETE as the release (a row
kept and updated, or deleted and inserted again), our statements sent as
the lock sends them (through its connection layer on Django's connection,
without the lock API above it), and ours the way users write it (``with
dlock.lock(key)``, a new lock per call). Each row's ratio
is the median of the per-round ratios to the floor.

Then two measures of the client alone: the CPU time a pair costs the client
process (``time.process_time`` over a few thousand pairs, rounds in turn)
for the floor, the statements through the connection layer and ours; and
the lock API above the statements timed without a database, its statements
answered at once by a stand-in for the function that sends them (warm in
the cache: the least the API can cost).

A lean front (:func:`lean_front`): the lock's own pieces over our
statements without the layers above them, for what the layering costs;
and the Python calls one pair makes, ours and the lean front's.

Last, what the client's work between two round trips costs on this machine.
Among the interleaved contenders, our statements through the connection
layer with a busy wait of 10, 20 or 30 µs after each answer (client work
that touches no memory, the same on every machine): what a pair's rate
loses to that many µs of client time between an answer and the next
statement. And ours' own two such gaps, timed in the same loop as they run
there (their cache cold after the server's turn): from the acquire's answer
to the release's statement, and from the release's answer to the next
acquire's statement (the next lock built, its options read, its walk down
to the statement).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

from .common import ensure_databases, interleaved, raw_connection, setup_django

#: the acquire without its queue parts (the same upsert, fence from the sequence)
NO_QUEUE_ACQUIRE = """
INSERT INTO django_dlock_lock AS l (name, token, owner, fence, acquired_at, expire_at)
SELECT %s, %s, %s, nextval('django_dlock_fence'), statement_timestamp(),
       statement_timestamp() + %s * interval '1 second'
ON CONFLICT (name) DO UPDATE SET token = EXCLUDED.token, owner = EXCLUDED.owner,
    fence = GREATEST(EXCLUDED.fence, l.fence + 1), acquired_at = EXCLUDED.acquired_at,
    expire_at = EXCLUDED.expire_at
WHERE (l.token = EXCLUDED.token AND l.expire_at > statement_timestamp())
   OR l.expire_at <= statement_timestamp()
RETURNING fence
"""


#: the fencing number as one expression, its subquery in the statement (the
#: logic of the function ``django_dlock_next_fence`` for a session on the
#: recorded timeline: a look at the era table, then ``nextval``)
SUBQUERY_FENCE = (
    "(SELECT CASE WHEN e.timeline = "
    "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint "
    "THEN nextval('django_dlock_fence') ELSE django_dlock_next_fence() END "
    "FROM django_dlock_fence_era e WHERE e.id = 1)"
)


def acquire_with_fence(fence: str) -> str:
    """Our acquire (durable) with ``fence`` for the fencing number's expression."""
    from django_dlock.strategies.fence import NEXT_FENCE
    from django_dlock.strategies.lease.sql import PG_ACQUIRE_SQL

    if NEXT_FENCE not in PG_ACQUIRE_SQL[True]:
        raise RuntimeError("the acquire no longer takes its number from NEXT_FENCE")
    return PG_ACQUIRE_SQL[True].replace(NEXT_FENCE, fence)


def subquery_acquire() -> str:
    """Our acquire in the form it had before migration 0009: its "live ticket
    ahead?" check and its fencing number as subqueries, not functions (the
    same answers; fence and durability as ours)."""
    from django.db import connections

    from django_dlock.strategies import queue

    call = "NOT " + queue.PG_AHEAD.format(name="l.name", ticket="%s")
    acquire = acquire_with_fence(SUBQUERY_FENCE)
    if call not in acquire:
        raise RuntimeError("the acquire no longer calls django_dlock_ahead")
    return acquire.replace(call, queue.none_ahead_sql(connections["default"], "l.name"))


#: the fencing number's function as migration 0009 made it, under a name of its own
EVERY_NUMBER_FENCE = "django_dlock_next_fence_0009()"


def every_number_function() -> str:
    """SQL that creates :data:`EVERY_NUMBER_FENCE`: the function of migration 0009,
    which reads the timeline at every number."""
    import importlib

    migration = importlib.import_module("django_dlock.migrations.0010_fence_epoch_per_session")
    return migration.PREVIOUS.replace("django_dlock_next_fence()", EVERY_NUMBER_FENCE)


def every_number_acquire() -> str:
    """Our acquire as before migration 0010: the fencing number's function called
    at every number (:func:`every_number_function` must exist)."""
    return acquire_with_fence(EVERY_NUMBER_FENCE)


def no_epoch_acquire() -> str:
    """Our acquire with a plain ``nextval`` for its fencing number: without the
    fail-over check that keeps numbers increasing across a fail-over."""
    from django_dlock.tables import FENCE_SEQUENCE

    return acquire_with_fence(f"nextval('{FENCE_SEQUENCE}')")


#: the release without the wake-up of the queue's head
NO_QUEUE_RELEASE = (
    "UPDATE django_dlock_lock SET token = '', expire_at = statement_timestamp() "
    "WHERE name = %s AND token = %s AND expire_at > statement_timestamp() RETURNING name"
)
DELETE_RELEASE = "DELETE FROM django_dlock_lock WHERE name = %s AND token = %s"


OURS = "ours: with dlock.lock(key)"
LEAN = "a lean front: the lock's pieces without its layers"

#: the contenders whose client CPU time is measured too
CLIENT_CPU = (
    "floor: lease upsert + DELETE",
    "our statements through the lock's connection layer",
    OURS,
)


def client_cpu(
    contenders: dict[str, Callable[[], None]], pairs: int = 3000, rounds: int = 4
) -> dict[str, list[float]]:
    """CPU time of the client process per pair, in µs, per round (rounds in turn)."""
    found: dict[str, list[float]] = {label: [] for label in contenders}
    for _ in range(rounds):
        for label, pair in contenders.items():
            started = time.process_time()
            for _ in range(pairs):
                pair()
            found[label].append((time.process_time() - started) / pairs * 1e6)
    return found


def api_without_database(pairs: int = 20000) -> float:
    """µs per ``with dlock.lock(key)`` pair, its statements answered at once (best of 5)."""
    from django_dlock.strategies import connection

    from . import uncontended

    pair = uncontended.user_pair("lease", "bench-parts-nodb")
    pair()  # the connection open, the statements prepared
    fence = iter(range(1, 10**9))
    sent = connection._execute_prepared

    def answered(conn: object, sql: str, params: object) -> tuple[tuple[object], int]:
        # an acquire's row is its fencing number, a release's the queue's wake-up
        return ((next(fence),) if sql.lstrip().startswith("INSERT") else (None,)), 1

    connection._execute_prepared = answered  # type: ignore[assignment]
    try:
        return min(timeit.repeat(pair, number=pairs, repeat=5)) / pairs * 1e6
    finally:
        connection._execute_prepared = sent


#: µs of client work after each statement's answer, for the gap contenders
GAPS = (10, 20, 30)


def _busy(us: float) -> None:
    """Spin for ``us`` µs (client work that touches no memory)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def client_gaps(pairs: int = 3000) -> tuple[float, float]:
    """Median µs between an answer and the next statement of ``with dlock.lock(key)``,
    in a loop of pairs: (acquire's answer -> release sent, release's answer -> the
    next acquire sent)."""
    from django_dlock.strategies import connection

    from . import uncontended

    pair = uncontended.user_pair("lease", "bench-parts-gaps")
    sent = connection._execute_prepared
    marks: list[float] = []
    clock = time.perf_counter

    def timed(conn: Any, sql: str, params: Any) -> tuple[Any, int]:
        marks.append(clock())
        try:
            return sent(conn, sql, params)
        finally:
            marks.append(clock())

    connection._execute_prepared = timed  # type: ignore[assignment]
    try:
        for _ in range(200):  # warm
            pair()
        marks.clear()
        for _ in range(pairs):
            pair()
    finally:
        connection._execute_prepared = sent
    if len(marks) != 4 * pairs:
        raise RuntimeError("a pair of ours sent other than two statements")
    # per pair: acquire sent, answered, release sent, answered
    between = [marks[i + 2] - marks[i + 1] for i in range(0, len(marks), 4)]
    before = [marks[i + 4] - marks[i + 3] for i in range(0, len(marks) - 4, 4)]
    return statistics.median(between) * 1e6, statistics.median(before) * 1e6


def lean_front() -> Callable[[], None]:
    """A front over our statements made of the lock's own pieces, without the
    layers above them: what the layering of ``with dlock.lock(key)`` costs.

    Kept: the key's validation and cache, the arguments' checks, the database
    alias and the strategy resolved, the holder and its table of holdings
    (re-entry refused, not counted), the request's token and owner, the
    statement's deadline (a try-once's), the lock connection and its
    reconnect, the prepared statements, a ``Holding`` taken and released as
    the lock does it (signals and log checks included). Left out: the
    ``Lock`` and its options value per call, the acquiring walk and its
    coroutine, the strategy's methods down to the statement. Not an API: no
    waiting, one key, PostgreSQL only.
    """
    import django_dlock as dlock
    from django_dlock import holdings
    from django_dlock.conf import conf, lock_alias
    from django_dlock.identity import current_holder
    from django_dlock.keys import make_key
    from django_dlock.retry import Deadline
    from django_dlock.strategies import queue, supported
    from django_dlock.strategies.base import Request
    from django_dlock.strategies.connection import (
        DIRECT_GRACE,
        _execute_prepared,
        given_up_at,
        watch_end,
        with_reconnect,
    )
    from django_dlock.strategies.lease.sql import PG_ACQUIRE_SQL
    from django_dlock.validation import timeout_error, ttl_error

    def pair() -> None:
        key = make_key("bench-parts-lean")
        ttl, timeout = 60.0, 0.0
        if ttl_error(ttl) is not None or timeout_error(timeout) is not None:
            raise ValueError("bad arguments")
        alias = lock_alias()
        strategy = supported("lease", alias)
        holder = current_holder()
        slot = (alias, strategy.family, key.name)
        if holder.holdings.get(slot) is not None:
            raise RuntimeError("already held")
        req = Request(
            key=key, alias=alias, token=holder.token(), owner=holder.owner(), ttl=ttl, row=key.name
        )
        deadline = Deadline(timeout)
        sent_at = time.monotonic()
        sql = PG_ACQUIRE_SQL[conf.LEASE_SYNCHRONOUS_COMMIT]
        params = [key.name, req.token, req.owner, ttl, queue.NEWCOMER, queue.NEWCOMER]

        end = watch_end(deadline, sent_at)

        def send(connection: Any) -> tuple[Any, int]:
            return _execute_prepared(connection, sql, params, given_up_at(end) + DIRECT_GRACE)

        (row, _), _ = with_reconnect(alias, send)
        if row is None:
            raise RuntimeError("uncontended acquire failed")
        holding = holdings.Holding(req, strategy, int(row[0]), dlock.Lock)
        wait = time.monotonic() - deadline.start
        holdings.take(holder, holding, sent_at=sent_at, wait=wait, renewal=None)
        holdings.release_one(holder, holder.holdings[slot])

    return pair


def python_calls(pair: Callable[[], None]) -> int:
    """Python function calls made by one ``pair()`` (warm), itself included."""
    for _ in range(20):
        pair()
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        pair()
    finally:
        sys.setprofile(None)
    return calls


def contenders() -> dict[str, Callable[[], None]]:
    from django.db import connections

    from django_dlock.strategies import queue
    from django_dlock.strategies.connection import execute
    from django_dlock.strategies.lease.sql import PG_ACQUIRE_SQL, PG_RELEASE_SQL

    from . import uncontended

    conn = raw_connection()
    acquire, release = PG_ACQUIRE_SQL[True], PG_RELEASE_SQL[True]
    newcomer = queue.NEWCOMER

    def ours_raw() -> None:
        name, token = "lock:bench-parts-raw", "parts-raw"
        params = [name, token, "", 60.0, newcomer, newcomer]
        if conn.execute(acquire, params, prepare=True).fetchone() is None:
            raise RuntimeError("uncontended acquire failed")
        conn.execute(release, [name, token, name], prepare=True).fetchone()

    def no_queue() -> None:
        name, token = "lock:bench-parts-noqueue", "parts-noqueue"
        if conn.execute(NO_QUEUE_ACQUIRE, [name, token, "", 60.0], prepare=True).fetchone() is None:
            raise RuntimeError("uncontended acquire failed")
        conn.execute(NO_QUEUE_RELEASE, [name, token], prepare=True).fetchone()

    def no_queue_delete() -> None:
        name, token = "lock:bench-parts-delete", "parts-delete"
        if conn.execute(NO_QUEUE_ACQUIRE, [name, token, "", 60.0], prepare=True).fetchone() is None:
            raise RuntimeError("uncontended acquire failed")
        conn.execute(DELETE_RELEASE, [name, token], prepare=True)

    def layer(us: int = 0) -> Callable[[], None]:
        """Our statements through the connection layer, ``us`` µs of client
        work after each answer."""
        name, token = f"lock:bench-parts-layer-{us}", "parts-layer"
        connection = connections["default"]
        params = [name, token, "", 60.0, newcomer, newcomer]

        def pair() -> None:
            if execute(connection, acquire, params, True)[0] is None:
                raise RuntimeError("uncontended acquire failed")
            if us:
                _busy(us)
            execute(connection, release, [name, token, name])
            if us:
                _busy(us)

        return pair

    floor = uncontended.floor_pairs(conn, 4545, "lock:bench-parts-floor")["lease"]
    return {
        "floor: lease upsert + DELETE": floor,
        "our statements, raw": ours_raw,
        "our statements without the queue parts": no_queue,
        "the same, the release a DELETE": no_queue_delete,
        "our statements through the lock's connection layer": layer(),
        **{f"the same, {us} µs of client work after each answer": layer(us) for us in GAPS},
        LEAN: lean_front(),
        OURS: uncontended.user_pair("lease", "bench-parts-api"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.lease_parts")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    setup_django()
    ensure_databases()
    pairs = contenders()
    series = interleaved(pairs, args.rounds, args.seconds)
    floor = next(iter(series.values()))
    print("| pair | pairs/s | vs the floor |")
    print("| --- | ---: | ---: |")
    for label, found in series.items():
        ratio = statistics.median(b / a for a, b in zip(floor.rates, found.rates, strict=True))
        print(f"| {label} | {found.rate:,.0f} | {ratio:.2f}x |")
    print()
    print("| pair | client CPU µs per pair, per round |")
    print("| --- | ---: |")
    for label, cpu in client_cpu({label: pairs[label] for label in CLIENT_CPU}).items():
        print(f"| {label} | {', '.join(f'{each:.0f}' for each in cpu)} |")
    print()
    print(f"The lock API without a database: {api_without_database():.1f} µs per pair.")
    ours, lean = (pairs[label] for label in (OURS, LEAN))
    print(f"Python calls per pair: ours {python_calls(ours)}, the lean front {python_calls(lean)}.")
    between, before = client_gaps()
    print(
        f"Ours between a pair's round trips (median, in the loop): {between:.1f} µs from "
        f"the acquire's answer to the release; {before:.1f} µs from the release's answer "
        "to the next acquire."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
