"""``manage.py dlock_selfcheck``: check locking on this deployment (see
:mod:`django_dlock.selfcheck`)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from django_dlock.conf import conf
from django_dlock.management.base import DlockCommand
from django_dlock.management.commands.dlock_list import resolve_alias, table
from django_dlock.selfcheck import selfcheck
from django_dlock.validation import strategy_error


class Command(DlockCommand):
    help = (
        "Check that locking works on this deployment: one lock here, wake-ups, mutual "
        "exclusion and fencing order across N processes, hand-off. Exits 1 on a failure."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--using", default=None, help="database alias")
        parser.add_argument(
            "--strategy", default=None, help="strategy to check (DLOCK_DEFAULT_STRATEGY)"
        )
        parser.add_argument("--processes", type=int, default=4, help="processes (default 4)")
        parser.add_argument(
            "--seconds", type=float, default=3.0, help="seconds each process runs (default 3)"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = resolve_alias(options["using"])
        strategy = options["strategy"] or conf.DEFAULT_STRATEGY
        problem = strategy_error(strategy)
        if problem is not None:
            raise CommandError(problem)
        processes, seconds = options["processes"], options["seconds"]
        if not 1 <= processes <= 64:
            raise CommandError(f"--processes must be from 1 to 64, got {processes}")
        if not 0 < seconds <= 600:
            raise CommandError(f"--seconds must be more than 0 and at most 600, got {seconds}")
        self.say(
            f"Checking the {strategy} strategy on {using!r} with {processes} processes "
            f"for {seconds:g} s ..."
        )
        verdicts = selfcheck(using, strategy, processes, seconds)
        rows = [[v.check, v.result, v.detail] for v in verdicts]
        for line in table(["CHECK", "RESULT", "DETAIL"], rows):
            self.say(line)
        failed = [v.check for v in verdicts if v.result == "FAIL"]
        if failed:
            raise CommandError(f"dlock_selfcheck failed: {', '.join(failed)}")
        self.say("dlock_selfcheck passed")
