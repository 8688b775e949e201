"""``python -m tests.benchmarks.server_instructions``: the server's instructions per lease pair.

What a PostgreSQL backend executes for one uncontended acquire + release,
counted by callgrind: repeatable where the rates of
:mod:`tests.benchmarks.server_share` move with the machine. A throw-away
cluster (``initdb`` in a temporary directory, a free port) runs under
``valgrind --tool=callgrind --trace-children=yes``, which writes one count
per backend when it exits; it gets the benchmark database's schema
(``pg_dump --schema-only``: tables, sequence, functions). Each contender
runs its statements prepared on a connection of its own, once with a few
pairs and once with many more; the difference divided by the extra pairs is
one pair's work in the backend (parse of the protocol messages, plan cache,
executor, commit; not the WAL writer's or the checkpointer's).

Contenders: the floor (:data:`tests.benchmarks.uncontended.FLOOR_LEASE_ACQUIRE`
and its DELETE), ours (the statements the lock sends, durable), ours in the
form they had before migration 0009 (the "live ticket ahead?" check and the
fencing number as subqueries, :func:`tests.benchmarks.lease_parts.subquery_acquire`),
ours as before migration 0010 (the fencing number's function called at every
number, :func:`tests.benchmarks.lease_parts.every_number_acquire`),
ours without the fencing number's fail-over check, without the queue parts
(:data:`tests.benchmarks.lease_parts.NO_QUEUE_ACQUIRE` and its release), and
that with the floor's DELETE as the release.

``--where`` also counts, for ours and the floor, the instructions inside a
few of the backend's functions (:data:`WHERE`, read with
``callgrind_annotate``); ``--fillfactor N`` sets the lock table's
``fillfactor`` in the counted cluster.

``--strategies`` counts the pairs of ``advisory``, ``advisory_xact`` and
``row`` instead, against their floors (:func:`strategy_contenders`): what
each sends now, and what it sent before.

Needs valgrind and PostgreSQL's server binaries (``initdb``, ``pg_dump``);
about two minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ..pgcluster import PrivateCluster
from . import lease_parts
from .common import ensure_databases, setup_django

FEW, MANY = 200, 1700

#: contender -> (acquire SQL, its parameters, release SQL, its parameters)
Contender = tuple[str, Callable[[str, str], list[Any]], str, Callable[[str, str], list[Any]]]


def contenders() -> dict[str, Contender]:
    from django_dlock.strategies import queue
    from django_dlock.strategies.lease.sql import PG_ACQUIRE_SQL, PG_RELEASE_SQL

    from . import uncontended

    def ours(name: str, token: str) -> list[Any]:
        return [name, token, "", 60.0, queue.NEWCOMER, queue.NEWCOMER]

    def release(name: str, token: str) -> list[Any]:
        return [name, token, name]

    def plain(name: str, token: str) -> list[Any]:
        return [name, token]

    def no_queue(name: str, token: str) -> list[Any]:
        return [name, token, "", 60.0]

    acquire, ours_release = PG_ACQUIRE_SQL[True], PG_RELEASE_SQL[True]
    before = lease_parts.subquery_acquire()
    return {
        "floor: lease upsert + DELETE": (
            uncontended.FLOOR_LEASE_ACQUIRE,
            plain,
            uncontended.FLOOR_LEASE_RELEASE,
            plain,
        ),
        "our statements": (acquire, ours, ours_release, release),
        "ours before migration 0010 (the fence function at every number)": (
            lease_parts.every_number_acquire(),
            ours,
            ours_release,
            release,
        ),
        "ours before migration 0009 (subqueries, not functions)": (
            before,
            ours,
            ours_release,
            release,
        ),
        "ours, the fencing number without its fail-over check": (
            lease_parts.no_epoch_acquire(),
            ours,
            ours_release,
            release,
        ),
        "ours without the queue parts": (
            lease_parts.NO_QUEUE_ACQUIRE,
            no_queue,
            lease_parts.NO_QUEUE_RELEASE,
            plain,
        ),
        "the same, the release a DELETE": (
            lease_parts.NO_QUEUE_ACQUIRE,
            no_queue,
            lease_parts.DELETE_RELEASE,
            plain,
        ),
    }


class CountedServer(PrivateCluster):
    """A throw-away PostgreSQL cluster (:class:`tests.pgcluster.PrivateCluster`)
    whose every process runs under callgrind."""

    def __init__(self) -> None:
        if shutil.which("valgrind") is None:
            raise SystemExit("valgrind is not installed")
        super().__init__()
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """The server under callgrind (:meth:`create` calls it after ``initdb``)."""
        command = [
            "valgrind",
            "--tool=callgrind",
            "--trace-children=yes",
            f"--callgrind-out-file={self.root}/counts.%p",
            str(self.bindir / "postgres"),
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.root),
            "-c",
            "listen_addresses=127.0.0.1",
        ]
        if self._as_postgres:  # PostgreSQL refuses to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                self.connect("postgres").close()
                return
            except Exception:  # noqa: BLE001 (starting up: refused, or not accepting yet)
                time.sleep(0.5)
        raise RuntimeError("the counted PostgreSQL server did not start")

    def connect(self, dbname: str) -> Any:
        import psycopg

        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True
        )

    def load_schema(self, source: dict[str, Any]) -> None:
        """The schema of the database ``source`` (Django settings) in database ``bench``."""
        with self.connect("postgres") as conn:
            conn.execute("CREATE DATABASE bench")
        dumped = subprocess.run(
            [
                str(self.bindir / "pg_dump"),
                "--schema-only",
                "--no-owner",
                f"--host={source.get('HOST') or 'localhost'}",
                f"--port={source.get('PORT') or 5432}",
                f"--username={source.get('USER') or 'postgres'}",
                source["NAME"],
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PGPASSWORD": str(source.get("PASSWORD") or "")},
        ).stdout
        # (through psql: a dump holds psql's meta-commands)
        subprocess.run(
            [str(self.bindir / "psql"), "--quiet", "--set=ON_ERROR_STOP=1"]
            + [f"--host={self.root}", f"--port={self.port}", "--username=postgres", "bench"],
            input=dumped,
            check=True,
            capture_output=True,
            text=True,
        )

    def backend_instructions(self, pid: int) -> int:
        """The instructions of backend ``pid`` (its count, written when it exits)."""
        path = self.root / f"counts.{pid}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if path.exists():
                found = re.search(r"^totals: (\d+)", path.read_text(), re.MULTILINE)
                if found:
                    return int(found.group(1))
            time.sleep(0.1)
        raise RuntimeError(f"no count for backend {pid}")

    def destroy(self) -> None:
        super().destroy()
        if self.process is not None:
            self.process.wait(60)

    def backend_functions(self, pid: int, names: tuple[str, ...]) -> dict[str, int]:
        """Backend ``pid``'s instructions inside each function of ``names``
        (inclusive: with what it calls), read by ``callgrind_annotate`` from
        the count that :meth:`backend_instructions` waited for."""
        annotated = subprocess.run(
            [
                "callgrind_annotate",
                "--inclusive=yes",
                "--threshold=100",
                f"{self.root}/counts.{pid}",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        found = dict.fromkeys(names, 0)
        for line in annotated.splitlines():
            match = re.match(r"\s*([\d,]+) .*\?\?\?:(\w+) \[", line)
            if match and match.group(2) in found and not found[match.group(2)]:
                found[match.group(2)] = int(match.group(1).replace(",", ""))
        return found


#: the backend's functions that ``--where`` counts, and what each does
WHERE = {
    "ExecutorStart": "setting the executor up (`ExecutorStart`)",
    "ExecutorRun": "running it (`ExecutorRun`)",
    "index_fetch_heap": "of which finding the row's live version (`index_fetch_heap`)",
}


def instructions(
    server: CountedServer,
    contender: Contender,
    pairs: int,
    label: str,
    functions: tuple[str, ...] = (),
) -> dict[str, int]:
    """Instructions of a backend that ran ``pairs`` pairs of ``contender``: in
    all (``"total"``) and inside each of ``functions``."""
    acquire, acquire_params, release, release_params = contender
    name, token = f"lock:bench-server-ir-{label}", "bench-server-ir"
    conn = server.connect("bench")
    pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
    for _ in range(pairs):
        if conn.execute(acquire, acquire_params(name, token), prepare=True).fetchone() is None:
            raise RuntimeError(f"{label}: uncontended acquire failed")
        conn.execute(release, release_params(name, token), prepare=True)
    conn.close()
    counts = {"total": server.backend_instructions(pid)}
    if functions:
        counts.update(server.backend_functions(pid, functions))
    return counts


#: one statement of a pair: (which connection, SQL with %s placeholders, its parameters)
Step = tuple[int, str, list[Any]]

_KEY = 4242
_ROW = "lock:bench-server-ir-row"


def strategy_contenders() -> dict[str, tuple[str, list[Step]]]:
    """``--strategies``: label -> (its floor's label, one pair's statements) for
    ``advisory``, ``advisory_xact`` and ``row``, as the lock sends them (the
    statements of the caller's transaction on connection 0; another
    connection, 1, for what runs beside it), and the forms they had before.
    The row (``_ROW``) exists: :func:`strategy_pairs` makes it."""
    from django_dlock.strategies import row as row_module
    from django_dlock.strategies.fence import _DURABLE_FENCE, NEXT_FENCE

    from . import uncontended

    pid = "pg_backend_pid()"
    try_ = f"SELECT CASE WHEN pg_try_advisory_lock(%s::bigint) THEN 0 END, {pid}"
    named = (
        "SELECT CASE WHEN pg_try_advisory_lock(%s::bigint) THEN 0 END, "
        f"set_config('application_name', %s, false), {pid}"
    )
    unlock = f"SELECT pg_advisory_unlock(%s::bigint), {pid}"
    unlock_named = (
        f"SELECT pg_advisory_unlock(%s::bigint), set_config('application_name', %s, false), {pid}"
    )
    holder, idle = "dlock host pid=4242 MainThread", "django-dlock"
    floor_advisory = "floor: pg_try_advisory_lock + unlock"
    floor_xact = "floor: BEGIN; pg_try_advisory_xact_lock; COMMIT"
    floor_row = "floor: BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT"
    xact_try = "SELECT CASE WHEN pg_try_advisory_xact_lock(CAST(%s AS bigint)) THEN 0 END"
    row_try = row_module._PG_TRY
    # the try before: one statement that also said whether the row exists
    row_try_before = f"""
WITH l AS MATERIALIZED (SELECT id FROM {row_module.TABLE} WHERE name = %s FOR UPDATE SKIP LOCKED)
SELECT EXISTS (SELECT 1 FROM l),
       EXISTS (SELECT 1 FROM {row_module.TABLE} WHERE name = %s)
"""
    # the other form the issue names: the number drawn by the lock's own statement
    # (flushed only when read, by a commit on another connection: not counted)
    row_try_fenced = row_try_before.rstrip() + (
        f",\n       CASE WHEN EXISTS (SELECT 1 FROM l) THEN {NEXT_FENCE} END\n"
    )
    begin, commit = (0, "BEGIN", []), (0, "COMMIT", [])
    return {
        floor_advisory: (
            floor_advisory,
            [
                (0, "SELECT pg_try_advisory_lock(%s)", [_KEY]),
                (0, "SELECT pg_advisory_unlock(%s)", [_KEY]),
            ],
        ),
        "advisory: ours, the holder's name set by each statement (before)": (
            floor_advisory,
            [(0, named, [_KEY, holder]), (0, unlock_named, [_KEY, idle])],
        ),
        "advisory: ours, the name set only when it changes (now)": (
            floor_advisory,
            [(0, try_, [_KEY]), (0, unlock, [_KEY])],
        ),
        floor_xact: (
            floor_xact,
            [begin, (0, "SELECT pg_try_advisory_xact_lock(%s)", [_KEY]), commit],
        ),
        "advisory_xact: ours": (floor_xact, [begin, (0, xact_try, [_KEY]), commit]),
        floor_row: (floor_row, [begin, (0, uncontended.FLOOR_ROW_SELECT, [_ROW]), commit]),
        "row: ours, the number drawn beside the lock (before)": (
            floor_row,
            [begin, (0, row_try_before, [_ROW, _ROW]), (1, _DURABLE_FENCE, []), commit],
        ),
        "row: ours, the number drawn when read (none read), the try before": (
            floor_row,
            [begin, (0, row_try_before, [_ROW, _ROW]), commit],
        ),
        "row: the number drawn by the lock's own statement (not kept)": (
            floor_row,
            [begin, (0, row_try_fenced, [_ROW, _ROW]), commit],
        ),
        "row: ours now (drawn when read, none read; the try alone)": (
            floor_row,
            [begin, (0, row_try, [_ROW]), commit],
        ),
    }


def strategy_pairs(server: CountedServer, steps: list[Step], pairs: int) -> int:
    """The instructions of the backends (one per connection used) that ran
    ``pairs`` pairs of ``steps``."""
    with server.connect("bench") as setup:
        setup.execute(
            "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
            "VALUES (%s, '', '', 0, now(), now()) ON CONFLICT DO NOTHING",
            [_ROW],
        )
    conns = [server.connect("bench") for _ in range(1 + max(step[0] for step in steps))]
    pids = [conn.execute("SELECT pg_backend_pid()").fetchone()[0] for conn in conns]
    for _ in range(pairs):
        for which, sql, params in steps:
            if sql in ("BEGIN", "COMMIT"):  # (as the floors send them)
                conns[which].execute(sql)
            else:
                conns[which].execute(sql, params, prepare=True).fetchone()
    for conn in conns:
        conn.close()
    return sum(server.backend_instructions(pid) for pid in pids)


def main_strategies(runs: int) -> int:
    """``--strategies``: the server's instructions per pair of the other strategies."""
    setup_django()
    ensure_databases()
    from django.db import connections

    server = CountedServer()
    found: dict[str, list[float]] = {}
    try:
        server.create()
        server.load_schema(connections["default"].settings_dict)
        for _ in range(runs):
            for label, (_, steps) in strategy_contenders().items():
                few = strategy_pairs(server, steps, FEW)
                many = strategy_pairs(server, steps, MANY)
                found.setdefault(label, []).append((many - few) / (MANY - FEW))
    finally:
        server.destroy()
    print(f"Server instructions per uncontended pair (callgrind, {runs} runs)")
    print()
    print("| statements | instructions per pair | vs its floor |")
    print("| --- | ---: | ---: |")
    for label, (floor, _) in strategy_contenders().items():
        value = statistics.median(found[label])
        ratio = value / statistics.median(found[floor])
        print(f"| {label} | {value / 1000:,.1f}k | {ratio:.2f}x |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.server_instructions")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument(
        "--where",
        action="store_true",
        help="also count, for ours and the floor, the backend's functions of WHERE",
    )
    parser.add_argument(
        "--fillfactor", type=int, help="the lock table's fillfactor in the counted cluster"
    )
    parser.add_argument(
        "--strategies",
        action="store_true",
        help="count the pairs of advisory, advisory_xact and row instead (strategy_contenders)",
    )
    args = parser.parse_args(argv)
    if args.strategies:
        return main_strategies(args.runs)
    setup_django()
    ensure_databases()
    from django.db import connections

    server = CountedServer()
    found: dict[str, list[float]] = {}
    where: dict[tuple[str, str], list[float]] = {}
    floor_label, ours_label = "floor: lease upsert + DELETE", "our statements"
    try:
        server.create()
        server.load_schema(connections["default"].settings_dict)
        with server.connect("bench") as conn:
            conn.execute(lease_parts.every_number_function())
            if args.fillfactor is not None:
                conn.execute(
                    f"ALTER TABLE django_dlock_lock SET (fillfactor = {args.fillfactor:d})"
                )
        for _ in range(args.runs):
            for index, (label, contender) in enumerate(contenders().items()):
                functions = (
                    tuple(WHERE) if args.where and label in (floor_label, ours_label) else ()
                )
                few = instructions(server, contender, FEW, str(index), functions)
                many = instructions(server, contender, MANY, str(index), functions)
                for part in many:
                    per_pair = (many[part] - few[part]) / (MANY - FEW)
                    if part == "total":
                        found.setdefault(label, []).append(per_pair)
                    else:
                        where.setdefault((label, part), []).append(per_pair)
    finally:
        server.destroy()
    floor = statistics.median(found[floor_label])
    print(f"Server instructions per uncontended lease pair (callgrind, {args.runs} runs)")
    if args.fillfactor is not None:
        print(f"(the lock table's fillfactor: {args.fillfactor})")
    print()
    print("| statements | instructions per pair | vs the floor |")
    print("| --- | ---: | ---: |")
    for label, counts in found.items():
        value = statistics.median(counts)
        print(f"| {label} | {value / 1000:,.1f}k | {value / floor:.2f}x |")
    if where:
        print()
        print("| where, per pair (inclusive) | ours | the floor |")
        print("| --- | ---: | ---: |")
        for part, what in WHERE.items():
            ours = statistics.median(where[(ours_label, part)])
            theirs = statistics.median(where[(floor_label, part)])
            print(f"| {what} | {ours / 1000:,.1f}k | {theirs / 1000:,.1f}k |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
