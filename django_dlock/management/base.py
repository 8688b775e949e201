"""What the ``dlock_*`` commands share: verbosity, the message for an unknown name,
and "run migrate" for a database without django-dlock's tables."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from django_dlock.conf import lock_alias
from django_dlock.exceptions import NotMigrated
from django_dlock.strategies.connection import not_migrated, tables_missing


def no_such_lock(name: str, using: str) -> CommandError:
    """The one error for a name that names no lock (dlock_show, dlock_release)."""
    return CommandError(f"no lock named {name!r} in {using!r}")


class DlockCommand(BaseCommand):
    """A command whose output on stdout follows ``--verbosity``.

    ``-v 0`` prints nothing but errors (they go to stderr, with exit status
    1); ``-v 1`` (the default) and up print :meth:`say`'s lines.
    """

    verbosity = 1

    def execute(self, *args: Any, **options: Any) -> str | None:
        self.verbosity = int(options.get("verbosity", 1))
        try:
            return super().execute(*args, **options)
        except NotMigrated as exc:
            raise CommandError(str(exc)) from None
        except DatabaseError as exc:  # the ORM's statements: the same message
            if not tables_missing(exc):
                raise
            alias = options.get("using") or lock_alias()
            raise CommandError(str(not_migrated(str(alias)))) from None

    def say(self, text: str, style: Callable[[str], str] | None = None) -> None:
        """Write one line of output unless ``-v 0`` asked for none."""
        if self.verbosity >= 1:
            self.stdout.write(text, style)
