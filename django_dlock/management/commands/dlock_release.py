"""``manage.py dlock_release NAME --yes``: force-release a lease by name."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dlock import operations as override
from django_dlock.management.commands.dlock_list import resolve_alias


class Command(BaseCommand):
    help = (
        "Force-release a lease by name (manual override). The holder is not stopped: its "
        "next renew or release raises LockLost. Needs --yes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help='lock name ("lock:invoice:42" or "invoice:42")')
        parser.add_argument("--using", default=None, help="database alias")
        parser.add_argument("--yes", action="store_true", help="really force-release it")

    def handle(self, *args: Any, **options: Any) -> None:
        using = resolve_alias(options["using"])
        name = options["name"]
        lease = override.find_lease(using, name)
        if lease is None:
            raise CommandError(f"no lease named {name!r} in {using!r}")
        if lease.state == "released":
            self.stdout.write(f"{lease.name} is already released; nothing to do.")
            return
        if not options["yes"]:
            raise CommandError(
                f"refusing to force-release {lease.name!r} ({lease.state}, held by "
                f"{lease.owner or 'unknown'}, fence {lease.fence}) without --yes"
            )
        released = override.force_release(using, pks=[lease.pk], source="command")
        if not released:
            self.stdout.write(f"{lease.name} was released meanwhile; nothing to do.")
            return
        item = released[0]
        self.stdout.write(
            self.style.SUCCESS(
                f"Force-released {item.name} (was held by {item.owner or 'unknown'}, "
                f"fence {item.fence}). Its holder sees LockLost on its next renew or release."
            )
        )
