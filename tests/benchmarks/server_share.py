"""``python -m tests.benchmarks.server_share``: the server's share of a lease pair, many clients.

PostgreSQL's own benchmark client, ``pgbench`` (C, prepared statements,
``-M prepared``), runs the lease statements with 16 clients on distinct
keys, so that the server's work decides the rate and no Python client's
does: the floor's two statements
(:data:`tests.benchmarks.uncontended.FLOOR_LEASE_ACQUIRE` and its DELETE),
ours (the statements the lock sends), ours in the form they had before
migration 0009 (the "live ticket ahead?" check and the fencing number as
subqueries, not functions), ours with a plain ``nextval`` for the
fencing number (without the fail-over check that keeps numbers increasing
across a fail-over), ours without their queue parts
(:data:`tests.benchmarks.lease_parts.NO_QUEUE_ACQUIRE` and its release), and
that again with the floor's DELETE as the release. Contenders run in turn,
round by round; each ratio is the median of the per-round ratios to the
floor. Durable commits, as the benchmark page's ``lease`` rows.

pgbench comes with PostgreSQL (``pg_config --bindir``; Debian keeps it in
``/usr/lib/postgresql/<version>/bin``).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import tempfile

from ..pgcluster import bindir
from .common import ensure_databases, setup_django

#: a key of its own per pgbench client (pgbench reads ``:name`` as a variable,
#: also inside a string: the key's text has no colon)
NAME = "'pgbench-' || CAST(CAST(:client_id AS int) AS text)"
TOKEN = "'pgbench'"


def _pgbench() -> str:
    found = bindir() / "pgbench"
    if not found.exists():
        raise SystemExit("pgbench is not installed (it comes with PostgreSQL's server packages)")
    return str(found)


def script(sql: str, values: list[str]) -> str:
    """``sql`` with its ``%s`` placeholders filled in order, as pgbench reads it."""
    filled = iter(values)
    text = re.sub(r"%s", lambda _match: next(filled), sql)
    # pgbench reads ``::type`` as a variable: casts are written out
    text = re.sub(
        r"(\('x' \|\| [^;]*?\)\))::bit\(32\)::bigint", r"CAST(CAST(\1 AS bit(32)) AS bigint)", text
    )
    text = " ".join(text.split())
    if re.search(r":(?!client_id\b)[A-Za-z_]", text):
        raise ValueError(f"a colon pgbench would read as a variable is left in: {text}")
    return text + ";\n"


def scripts() -> dict[str, str]:
    """Contender -> the pgbench script of its acquire and release."""
    from django_dlock.strategies import queue
    from django_dlock.strategies.lease.sql import PG_ACQUIRE_SQL, PG_RELEASE_SQL

    from . import lease_parts, uncontended

    newcomer = str(queue.NEWCOMER)
    acquire = [NAME, TOKEN, "''", "60.0"]
    return {
        "floor: lease upsert + DELETE": script(uncontended.FLOOR_LEASE_ACQUIRE, [NAME, TOKEN])
        + script(uncontended.FLOOR_LEASE_RELEASE, [NAME, TOKEN]),
        "our statements": script(PG_ACQUIRE_SQL[True], [*acquire, newcomer, newcomer])
        + script(PG_RELEASE_SQL[True], [NAME, TOKEN, NAME]),
        "ours before migration 0009 (subqueries, not functions)": script(
            lease_parts.subquery_acquire(), [*acquire, newcomer, newcomer]
        )
        + script(PG_RELEASE_SQL[True], [NAME, TOKEN, NAME]),
        "our statements, the fencing number without its fail-over check": script(
            lease_parts.no_epoch_acquire(),
            [*acquire, newcomer, newcomer],
        )
        + script(PG_RELEASE_SQL[True], [NAME, TOKEN, NAME]),
        "our statements without the queue parts": script(lease_parts.NO_QUEUE_ACQUIRE, acquire)
        + script(lease_parts.NO_QUEUE_RELEASE, [NAME, TOKEN]),
        "the same, the release a DELETE": script(lease_parts.NO_QUEUE_ACQUIRE, acquire)
        + script(lease_parts.DELETE_RELEASE, [NAME, TOKEN]),
    }


def run_pgbench(path: str, clients: int, seconds: float) -> float:
    """Pairs per second of one pgbench run of the script at ``path``."""
    from django.db import connections

    database = connections["default"].settings_dict
    command = [
        _pgbench(),
        "--no-vacuum",
        "--protocol=prepared",
        f"--client={clients}",
        f"--jobs={min(clients, 2)}",
        f"--time={max(1, round(seconds))}",
        f"--file={path}",
        f"--host={database.get('HOST') or 'localhost'}",
        f"--port={database.get('PORT') or 5432}",
        f"--username={database.get('USER') or 'postgres'}",
        database["NAME"],
    ]
    env = {**os.environ, "PGPASSWORD": str(database.get("PASSWORD") or "")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"^tps = ([\d.]+)", done.stdout, re.MULTILINE)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"pgbench failed: {done.stderr[-800:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.server_share")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args(argv)
    setup_django()
    ensure_databases()
    rates: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for index, (label, text) in enumerate(scripts().items()):
            paths[label] = os.path.join(tmp, f"contender{index}.sql")
            with open(paths[label], "w") as f:
                f.write(text)
        for _ in range(args.rounds):
            for label, path in paths.items():
                rates.setdefault(label, []).append(run_pgbench(path, args.clients, args.seconds))
    floor = next(iter(rates.values()))
    print(f"pgbench, {args.clients} clients on distinct keys, {args.rounds} rounds in turn")
    print()
    print("| statements | pairs/s per round | vs the floor |")
    print("| --- | ---: | ---: |")
    for label, found in rates.items():
        ratio = statistics.median(b / a for a, b in zip(floor, found, strict=True))
        print(f"| {label} | {', '.join(f'{rate:,.0f}' for rate in found)} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
