"""``python -m tests.benchmarks``: run every benchmark, print and save the report.

Options: ``--quick`` (fewer, shorter rounds: a smoke run), ``--rounds``,
``--seconds`` (per round), ``--only SECTION`` (repeatable: uncontended,
handoff, queue, scale, failover, scaling, memory, quorum, guard, semaphore),
``--no-write``
(print only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL = (
    "uncontended",
    "handoff",
    "queue",
    "scale",
    "failover",
    "scaling",
    "memory",
    "quorum",
    "guard",
    "semaphore",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--only", action="append", choices=list(ALL))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.kills = 2, 0.3, 2
    only = set(args.only or ALL)

    from .common import ensure_databases, setup_django

    if "quorum" in only:
        from . import quorum

        quorum.add_aliases()  # before Django reads the settings
    setup_django()
    ensure_databases()
    from . import report

    sections: dict[str, list[str]] = {}
    unc, hand, acq, cleanups, points = {}, [], {}, [], []
    if "uncontended" in only:
        from . import uncontended

        print("uncontended pairs ...", file=sys.stderr)
        unc = uncontended.run(args.rounds, args.seconds)
        sections["1. Uncontended acquire + release (one connection)"] = report.uncontended_table(
            unc
        )
    if "handoff" in only:
        from . import handoff

        print("hand-off under contention ...", file=sys.stderr)
        hand = handoff.run(seconds=2.0 if args.quick else 5.0)
        sections["2. Hand-off under contention (4 processes, one key)"] = report.handoff_table(hand)
    queued = None
    if "queue" in only:
        from . import queue_release

        print("release with 1,000 queued waiters ...", file=sys.stderr)
        queued = queue_release.run(600 if args.quick else 3_000)
        sections["3. Release with 1,000 waiters queued (lease)"] = queue_release.table(queued)
    if "scale" in only:
        from . import scale

        print("scale: 1,000,000 expired rows ...", file=sys.stderr)
        rows = 100_000 if args.quick else scale.ROWS
        acq = scale.acquisition(args.rounds, args.seconds, rows)
        cleanups = scale.cleanup(rows)
        sections["4. Scale: 1,000,000 expired lease rows"] = report.scale_table(acq, cleanups)
    if "failover" in only:
        from . import failover

        print("leader failover ...", file=sys.stderr)
        sections["5. Leader failover (manage.py dlock_runworker)"] = [
            *report.failover_table(failover.run(args.kills)),
            "",
            "When the database itself fails over (a private primary and its streaming",
            "standby, the primary SIGKILLed and the standby promoted at once, one client",
            "trying to acquire a free lease through the same address all along), the",
            "time from the kill:",
            "",
            failover.primary_killed_table(args.kills),
            "",
            "An HA manager adds its own time to notice the failure before it promotes",
            "(Patroni: up to its `ttl`). What holders see meanwhile:",
            "[high availability and fail-over](ha.md).",
        ]

    if "scaling" in only:
        from . import scaling

        print("scaling: N = 1 .. 16 processes ...", file=sys.stderr)
        counts = (1, 2, 4) if args.quick else scaling.COUNTS
        points = scaling.run(rounds=1 if args.quick else 5, seconds=args.seconds, counts=counts)
        sections["6. Scaling: N processes, distinct keys and one hot key"] = [
            "![scaling chart](img/scaling.png)",
            "",
            *report.scaling_table(points),
        ]
    if "memory" in only:
        from . import memory

        print("memory and sessions ...", file=sys.stderr)
        sections["7. Memory and sessions of one process"] = report.memory_table(memory.run())

    if "quorum" in only:
        from . import quorum

        print("quorum on three databases ...", file=sys.stderr)
        quorum.ensure()
        sections["8. Quorum lease on three databases (one down)"] = [
            '`dlock.lock(key, using=["q1", "q2", "q3"])` on three databases of',
            "the same server, against a lease on one of them; then with the third",
            "refusing connections (see [quorum locks](quorum.md)).",
            "",
            *quorum.table(quorum.run(args.rounds, args.seconds)),
        ]

    if "guard" in only:
        from . import guarded_writes

        print("guarded writes ...", file=sys.stderr)
        sections["9. Guarded writes (lk.guard() against transaction.atomic)"] = [
            *guarded_writes.INTRO,
            "",
            *guarded_writes.run_apart(args.rounds, args.seconds),
        ]

    if "semaphore" in only:
        from . import semaphores

        print("semaphores ...", file=sys.stderr)
        sections["10. Semaphores and read locks (against a lock)"] = [
            *semaphores.INTRO,
            "",
            *semaphores.run_apart(args.rounds, args.seconds),
        ]

    sections = {
        "Targets": report.targets(unc, hand, acq, cleanups, points, queued),
        **sections,
    }
    text = report.markdown(sections, report.meta())
    print(text)
    if not args.no_write and only == set(ALL):
        page = ROOT / "docs" / "benchmarks.md"
        kept = report.kept_sections(page.read_text(), text) if page.exists() else ""
        page.write_text(text.rstrip("\n") + "\n\n" + kept if kept else text)
        report.chart(unc, hand, ROOT / "docs" / "img" / "benchmarks.png")
        report.scaling_chart(points, ROOT / "docs" / "img" / "scaling.png")
        print("wrote docs/benchmarks.md and docs/img/benchmarks.png", file=sys.stderr)
        # every other page's quoted numbers follow the new page (tests/benchmarks/quotes.py)
        from . import quotes

        for updated in quotes.refresh(ROOT):
            print(f"updated the numbers {updated.relative_to(ROOT)} quotes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
