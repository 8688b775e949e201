"""5. Scaling: N processes, on distinct keys and on one hot key, ours vs the floor.

One pool of worker processes is started once (Django set up, connections
open); for each configuration the first N workers run acquire + release pairs
for the same window, started together, and report how many they completed.
Ours and the floor alternate round by round (A B A B …), and a cell's
ratio is the median of its rounds' ratios: each round's two windows run back
to back, so a slow spell of the machine that lasts a round moves both. The
``lease`` row on distinct keys, which a target judges at every N, runs
:data:`MORE_ROUNDS` times as many rounds: on a shared 2-core machine one
round's ratio moves by up to a tenth either way.

* Ours: ``with dlock.lock(key, strategy=...)``, a new lock per call (inside
  ``transaction.atomic`` for ``advisory_xact`` and ``row``); one try on
  distinct keys, waiting (``timeout=None``) on the hot key.
* Floor: the least SQL for the same guarantee, prepared, on one psycopg
  connection per process (see :mod:`tests.benchmarks.uncontended`). On the
  hot key the floors wait in PostgreSQL's lock queue (``pg_advisory_lock``,
  ``pg_advisory_xact_lock``, ``SELECT … FOR UPDATE``); the lease floor retries
  its upsert after 1 ms.

Before each window the lock tables are vacuumed (outside it: see
:func:`tests.benchmarks.common.vacuum`), so that no window starts on the dead
rows the ones before it left.

Each round also measures what a pair costs the machine's cores: each
client's CPU time over the window (``time.process_time``) and, when the
server runs on this machine, the CPU time of every PostgreSQL process
(backends, WAL writer and the rest, read from ``/proc``), per pair.
"""

from __future__ import annotations

import glob
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from .common import raw_connection, vacuum

STRATEGIES = ("advisory", "lease", "advisory_xact", "row")
COUNTS = (1, 2, 4, 8, 16)
MODES = ("distinct keys", "one hot key")
#: the rows measured on more rounds, and how many times as many
MORE_ROUNDS = {("lease", "distinct keys"): 3}


def _floor_hot(conn: Any, key: int, name: str, strategy: str) -> Callable[[], None]:
    from .uncontended import FLOOR_LEASE_ACQUIRE, FLOOR_LEASE_RELEASE

    conn.execute(
        "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
        "VALUES (%s, '', '', 0, now(), now()) ON CONFLICT DO NOTHING",
        [f"{name}:row"],
    )
    token = f"floor-{os.getpid()}"

    def advisory() -> None:
        conn.execute("SELECT pg_advisory_lock(%s)", [key], prepare=True).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%s)", [key], prepare=True).fetchone()

    def xact() -> None:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [key], prepare=True).fetchone()
        conn.execute("COMMIT")

    def row() -> None:
        conn.execute("BEGIN")
        conn.execute(
            "SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE",
            [f"{name}:row"],
            prepare=True,
        ).fetchone()
        conn.execute("COMMIT")

    def lease() -> None:
        while conn.execute(FLOOR_LEASE_ACQUIRE, [name, token], prepare=True).fetchone() is None:
            time.sleep(0.001)
        conn.execute(FLOOR_LEASE_RELEASE, [name, token], prepare=True)

    return {"advisory": advisory, "advisory_xact": xact, "row": row, "lease": lease}[strategy]


def _ours_hot(key: str, strategy: str) -> Callable[[], None]:
    from django.db import transaction

    import django_dlock as dlock

    if strategy in ("advisory_xact", "row"):

        def in_transaction() -> None:
            with transaction.atomic(), dlock.lock(key, strategy=strategy, timeout=None):
                pass

        return in_transaction

    def plain() -> None:
        with dlock.lock(key, strategy=strategy, ttl=60, timeout=None):
            pass

    return plain


def _worker(index: int, inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.settings")
    import django

    django.setup()
    from django.db import connections

    from .common import raw_connection
    from .uncontended import floor_pairs, user_pair

    conn = raw_connection()
    pairs: dict[tuple[str, str, str], Callable[[], None]] = {}
    for strategy in STRATEGIES:
        own = f"bench-scale-{index}"
        floors = floor_pairs(conn, 7000 + index, f"lock:bench-scale-floor-{index}")
        pairs["ours", strategy, MODES[0]] = user_pair(strategy, f"{own}-{strategy}")
        pairs["floor", strategy, MODES[0]] = floors[strategy]
        pairs["ours", strategy, MODES[1]] = _ours_hot(f"bench-scale-hot-{strategy}", strategy)
        pairs["floor", strategy, MODES[1]] = _floor_hot(
            conn, 6999, f"lock:bench-scale-floor-hot-{strategy}", strategy
        )
    outbox.put(("ready", index, 0))
    while True:
        job = inbox.get()
        if job is None:
            break
        who, strategy, mode, start_at, seconds = job
        pair = pairs[who, strategy, mode]
        pair()  # warm: statements prepared, sessions open
        while time.monotonic() < start_at:
            time.sleep(0.0005)
        end = start_at + seconds
        done = 0
        cpu = time.process_time()
        while time.monotonic() < end:
            pair()
            done += 1
        outbox.put(("done", index, (done, time.process_time() - cpu)))
    conn.close()
    connections.close_all()


@dataclass
class Point:
    strategy: str
    mode: str
    processes: int
    ours: list[float] = field(default_factory=list)  # aggregate pairs/s per round
    floor: list[float] = field(default_factory=list)
    #: per round: (client CPU, server CPU or None) in µs per pair
    ours_cpu: list[tuple[float, float | None]] = field(default_factory=list)
    floor_cpu: list[tuple[float, float | None]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """Ours / the floor: the median of the rounds' ratios."""
        return median(ours / floor for ours, floor in zip(self.ours, self.floor, strict=True))


_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu() -> float | None:
    """CPU seconds used so far by this machine's PostgreSQL processes (None: none seen)."""
    total, seen = 0, False
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                raw = f.read()
        except OSError:
            continue
        if raw[raw.index("(") + 1 : raw.rindex(")")].startswith("postgres"):
            fields = raw.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
            seen = True
    return total / _TICK if seen else None


def run(rounds: int = 3, seconds: float = 1.5, counts: tuple[int, ...] = COUNTS) -> list[Point]:
    ctx = multiprocessing.get_context("spawn")
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(max(counts))]
    procs = [
        ctx.Process(target=_worker, args=(i, inbox, outbox), daemon=True)
        for i, inbox in enumerate(inboxes)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        outbox.get(timeout=300)
    conn = raw_connection()
    vacuum(conn, full=True)
    points: list[Point] = []
    try:
        for strategy in STRATEGIES:
            for mode in MODES:
                for n in counts:
                    point = Point(strategy, mode, n)
                    for _ in range(rounds * MORE_ROUNDS.get((strategy, mode), 1)):
                        for who, results, cpus in (
                            ("ours", point.ours, point.ours_cpu),
                            ("floor", point.floor, point.floor_cpu),
                        ):
                            vacuum(conn)
                            start_at = time.monotonic() + 0.3
                            for inbox in inboxes[:n]:
                                inbox.put((who, strategy, mode, start_at, seconds))
                            while time.monotonic() < start_at:
                                time.sleep(0.001)
                            server_before = server_cpu()
                            done = [outbox.get(timeout=seconds + 120)[2] for _ in range(n)]
                            server_after = server_cpu()
                            total = sum(pairs for pairs, _ in done)
                            results.append(total / seconds)
                            client = sum(cpu for _, cpu in done) / max(total, 1) * 1e6
                            server = (
                                None
                                if server_before is None or server_after is None
                                else (server_after - server_before) / max(total, 1) * 1e6
                            )
                            cpus.append((client, server))
                    points.append(point)
    finally:
        conn.close()
        for inbox in inboxes:
            inbox.put(None)
        for proc in procs:
            proc.join(30)
    return points
