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
    args = parser.parse_args(argv)
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
