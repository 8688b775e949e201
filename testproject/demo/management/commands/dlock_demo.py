"""``manage.py dlock_demo``: two worker processes contend for one lock.

Runs on whatever ``DATABASE_URL`` points at (SQLite by default, no server).
Each worker loops: wait for the lock ``report``, "work" while holding it,
release. The output shows who waits, who holds, the fencing numbers and the
hand-offs; the summary checks that no two workers ever held it at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

import django_dlock as dlock


class Command(BaseCommand):
    help = "Show two worker processes contending for one lock and handing it over."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--workers", type=int, default=2, help="worker processes (2)")
        parser.add_argument("--rounds", type=int, default=3, help="acquisitions per worker (3)")
        parser.add_argument("--work", type=float, default=0.3, help="seconds of work inside (0.3)")
        parser.add_argument("--worker", help=argparse_suppress())

    def handle(self, *args: Any, **options: Any) -> None:
        if options["workers"] < 1 or options["rounds"] < 1 or options["work"] < 0:
            raise CommandError("--workers and --rounds must be >= 1 and --work >= 0")
        if options["worker"]:
            self._work(options["worker"], options["rounds"], options["work"])
        else:
            self._run(options["workers"], options["rounds"], options["work"])

    # -- one worker process ----------------------------------------------------

    def _work(self, name: str, rounds: int, work: float) -> None:
        lk = dlock.lock("report", ttl=30, timeout=60, retry_interval=0.02)
        for _ in range(rounds):
            self._say(f"worker {name}: waiting for the lock")
            started = time.monotonic()
            with lk:
                waited = time.monotonic() - started
                self._say(f"worker {name}: ACQUIRED (fence {lk.fence}) after waiting {waited:.2f}s")
                enter = time.monotonic_ns()
                time.sleep(work)
                leave = time.monotonic_ns()
                self._say(f"worker {name}: released      [held {enter} {leave} {lk.fence}]")
            time.sleep(0.01)

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    # -- the parent: migrate, start workers, summarise ----------------------------

    def _run(self, workers: int, rounds: int, work: float) -> None:
        db = settings.DATABASES["default"]
        self.stdout.write(f"database: {db['ENGINE'].rsplit('.', 1)[-1]} {db['NAME']}")
        call_command("migrate", verbosity=0)
        names = [chr(ord("A") + i) for i in range(workers)]
        manage = Path(settings.BASE_DIR) / "manage.py"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(manage),
                    "dlock_demo",
                    "--worker",
                    name,
                    "--rounds",
                    str(rounds),
                    "--work",
                    str(work),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for name in names
        ]
        lines: list[str] = []
        mutex = threading.Lock()

        def pump(proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with mutex:
                    lines.append(line.rstrip("\n"))
                    self.stdout.write(line.rstrip("\n").split("      [held")[0])

        pumps = [threading.Thread(target=pump, args=(p,)) for p in procs]
        for t in pumps:
            t.start()
        codes = [p.wait() for p in procs]
        for t in pumps:
            t.join()
        if any(codes):
            raise CommandError(f"a worker failed (exit codes {codes})")
        self._summary(lines, workers * rounds)

    def _summary(self, lines: list[str], expected: int) -> None:
        # (start, end, fence) of every holding, in the order they happened
        # (CLOCK_MONOTONIC is one clock for all processes of this machine).
        spans = sorted(
            tuple(int(part) for part in line.split("[held ")[1].rstrip("]").split())
            for line in lines
            if "[held" in line
        )
        fences = [fence for _, _, fence in spans]
        pairs = list(zip(spans, spans[1:], strict=False))
        overlaps = sum(1 for before, after in pairs if after[0] < before[1])
        ordered = all(before[2] < after[2] for before, after in pairs)
        self.stdout.write("")
        self.stdout.write(
            f"{len(fences)} acquisitions (expected {expected}); "
            f"fences {min(fences)}..{max(fences)} strictly increasing: {ordered}; "
            f"overlapping holds: {overlaps}"
        )
        if len(fences) != expected or overlaps or not ordered:
            raise CommandError("mutual exclusion was violated")
        if max(fences) - min(fences) + 1 != len(fences):
            self.stdout.write(
                f"(fences {min(fences)}..{max(fences)} for {len(fences)} acquisitions: the "
                "numbers have gaps because every acquire attempt draws one, granted or not; on "
                "PostgreSQL they come from one sequence for every lock of the database. "
                "Fencing needs them to increase, not to be consecutive.)"
            )
        self.stdout.write(self.style.SUCCESS("OK: one holder at a time, every hand-off clean."))


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS
