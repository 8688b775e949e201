"""What the ``dlock_*`` commands share: verbosity and the message for an unknown name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError


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
        return super().execute(*args, **options)

    def say(self, text: str, style: Callable[[str], str] | None = None) -> None:
        """Write one line of output unless ``-v 0`` asked for none."""
        if self.verbosity >= 1:
            self.stdout.write(text, style)
