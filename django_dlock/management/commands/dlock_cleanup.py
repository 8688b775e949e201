"""``manage.py dlock_cleanup``: delete free lease rows in batches."""

from __future__ import annotations

import math
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from django_dlock import cleanup
from django_dlock.management.base import DlockCommand
from django_dlock.operations import default_alias
from django_dlock.strategies.connection import not_migrated, tables_missing
from django_dlock.validation import alias_error


class Command(DlockCommand):
    help = (
        "Delete expired and released lease rows in batches. A live lease is never deleted "
        "(judged on the database clock), and no batch holds a long table lock, so it is safe "
        "to run while locks are taken. A run deletes what was free when it began (rows freed "
        "while it runs are left for the next run), so it finishes under load."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--batch-size",
            type=int,
            default=10_000,
            help="rows deleted per batch (one short statement or transaction each; default 10000)",
        )
        parser.add_argument(
            "--older-than",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="only rows that have been free for at least this long (default 0)",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="count the rows that would be deleted; delete nothing",
        )
        parser.add_argument(
            "--using",
            default=None,
            help="database alias (default: the router's database for the Lock model)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["using"] or default_alias()
        problem = alias_error(using)
        if problem is not None:
            raise CommandError(problem)
        batch_size = options["batch_size"]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise CommandError(f"--batch-size must be a whole number >= 1, got {batch_size!r}")
        older_than = options["older_than"]
        if (
            isinstance(older_than, bool)
            or not isinstance(older_than, (int, float))
            or not math.isfinite(older_than)
            or older_than < 0
        ):
            raise CommandError(f"--older-than must be seconds >= 0, got {older_than!r}")
        older_than = float(older_than)
        verbosity = int(options["verbosity"])
        show_progress = verbosity >= 2 or (verbosity >= 1 and self.stdout.isatty())
        age = f" free for at least {older_than:g} s" if older_than else ""
        try:
            if options["dry_run"]:
                count = cleanup.count_free(using, older_than)
                self.say(
                    f"Dry run: would delete {count} expired or released lease "
                    f"row{'s' if count != 1 else ''}{age} from {using!r}; nothing was deleted."
                )
                return
            started = time.monotonic()
            batches = 0

            def progress(deleted: int, total: int) -> None:
                nonlocal batches
                batches += 1
                if show_progress:
                    self.say(f"batch {batches}: deleted {deleted} rows ({total} so far)")

            total = cleanup.delete_free(
                using, batch_size=batch_size, older_than=older_than, progress=progress
            )
        except DatabaseError as exc:
            if tables_missing(exc):
                raise CommandError(str(not_migrated(using))) from None
            raise CommandError(f"cleanup of {using!r} failed: {exc}") from exc
        elapsed = time.monotonic() - started
        if verbosity >= 1:
            self.say(
                self.style.SUCCESS(
                    f"Deleted {total} expired or released lease row{'s' if total != 1 else ''}"
                    f"{age} from {using!r} in {batches} batch{'es' if batches != 1 else ''} "
                    f"({elapsed:.1f} s). Held leases were kept."
                )
            )
