"""Client instructions per uncontended acquire + release, counted by callgrind.

Wall-clock ratios move from run to run on a shared machine; instruction
counts do not (the same binary, inputs and hash seed give the same count,
whatever else the machine does). Each contender runs in a child process
under ``valgrind --tool=callgrind``, once with a few pairs and once with
many more; the difference divided by the extra pairs is the client work of
one pair: Python, psycopg and libpq in our process, not the server's.

Contenders: the raw floors (prepared statements on one psycopg connection,
:func:`tests.benchmarks.uncontended.floor_pairs`), Django's share
(``transaction.atomic`` around the floor's one statement) and ours, written
the way users write it (a new lock per call).

Run: ``python -m tests.benchmarks.instructions`` (valgrind must be
installed; about ten minutes).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile

from .common import setup_django

#: contender -> (the child's argument, the floor it is compared with)
CONTENDERS = {
    "floor: pg_try_advisory_lock + unlock": ("floor:advisory", None),
    "floor: lease upsert + DELETE": ("floor:lease", None),
    "floor: BEGIN; pg_try_advisory_xact_lock; COMMIT": ("floor:advisory_xact", None),
    "floor: BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT": ("floor:row", None),
    "Django's share: transaction.atomic + the advisory_xact floor's statement": (
        "share:advisory_xact",
        "floor:advisory_xact",
    ),
    "Django's share: transaction.atomic + the row floor's statement": ("share:row", "floor:row"),
    "advisory": ("ours:advisory", "floor:advisory"),
    "lease": ("ours:lease", "floor:lease"),
    "advisory_xact": ("ours:advisory_xact", "floor:advisory_xact"),
    "row": ("ours:row", "floor:row"),
}

FEW, MANY = 100, 1100


def _pair(which: str) -> object:
    """The pair function for ``kind:strategy`` (in the child, Django set up)."""
    from . import uncontended
    from .common import raw_connection

    kind, strategy = which.split(":")
    if kind == "ours":
        return uncontended.user_pair(strategy, f"bench-instructions-{strategy}")
    conn = raw_connection()
    if kind == "floor":
        return uncontended.floor_pairs(conn, 4242, "lock:bench-instructions")[strategy]
    shares = uncontended.django_share(conn)
    label = uncontended.DJANGO_XACT if strategy == "advisory_xact" else uncontended.DJANGO_ROW
    return shares[label]


def child(which: str, pairs: int) -> None:
    setup_django()
    pair = _pair(which)
    for _ in range(50):  # warm up: caches, prepared statements, connections
        pair()  # type: ignore[operator]
    for _ in range(pairs):
        pair()  # type: ignore[operator]


def _collected(which: str, pairs: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        done = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-m",
                "tests.benchmarks.instructions",
                "--child",
                which,
                str(pairs),
            ],
            env={**os.environ, "PYTHONHASHSEED": "0"},
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind gave no count for {which}: {done.stderr[-500:]}")
    return int(found.group(1))


def per_pair(which: str) -> int:
    """Client instructions of one pair of ``which`` (``kind:strategy``)."""
    return (_collected(which, MANY) - _collected(which, FEW)) // (MANY - FEW)


def main() -> None:
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    counts = {which: per_pair(which) for which, _ in CONTENDERS.values()}
    print("| contender | instructions per pair | vs its floor |")
    print("| --- | ---: | ---: |")
    for label, (which, floor) in CONTENDERS.items():
        ratio = "" if floor is None else f"{counts[which] / counts[floor]:.2f}x"
        print(f"| {label} | {counts[which] / 1000:,.1f}k | {ratio} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]))
    else:
        main()
