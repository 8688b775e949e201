"""``python -m tests.benchmarks``: run every benchmark, print and save the report.

Options: ``--quick`` (fewer, shorter rounds: a smoke run), ``--rounds``,
``--seconds`` (per round), ``--only SECTION`` (repeatable: uncontended,
handoff, scale, failover), ``--no-write`` (print only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument(
        "--only", action="append", choices=["uncontended", "handoff", "scale", "failover"]
    )
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds, args.kills = 2, 0.3, 2
    only = set(args.only or ["uncontended", "handoff", "scale", "failover"])

    from .common import ensure_databases, setup_django

    setup_django()
    ensure_databases()
    from . import report

    sections: dict[str, list[str]] = {}
    unc, hand, acq, cleanups = {}, [], {}, []
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
    if "scale" in only:
        from . import scale

        print("scale: 1,000,000 expired rows ...", file=sys.stderr)
        rows = 100_000 if args.quick else scale.ROWS
        acq = scale.acquisition(args.rounds, args.seconds, rows)
        cleanups = scale.cleanup(rows)
        sections["3. Scale: 1,000,000 expired lease rows"] = report.scale_table(acq, cleanups)
    if "failover" in only:
        from . import failover

        print("leader failover ...", file=sys.stderr)
        sections["4. Leader failover (manage.py runworker)"] = report.failover_table(
            failover.run(args.kills)
        )

    sections = {
        "Targets": report.targets(unc, hand, acq, cleanups),
        **sections,
    }
    text = report.markdown(sections, report.meta())
    print(text)
    if not args.no_write and only == {"uncontended", "handoff", "scale", "failover"}:
        (ROOT / "docs" / "benchmarks.md").write_text(text)
        report.chart(unc, hand, ROOT / "docs" / "img" / "benchmarks.png")
        print("wrote docs/benchmarks.md and docs/img/benchmarks.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
