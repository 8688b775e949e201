"""``manage.py dlock_release NAME --yes``: force-release a lease by name."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from django_dlock import operations as override
from django_dlock.management.base import DlockCommand, no_such_lock
from django_dlock.management.commands.dlock_list import resolve_alias


class Command(DlockCommand):
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
            raise no_such_lock(name, using)
        if lease.state == "released":
            self.say(f"{lease.name} is already released; nothing to do.")
            return
        if not options["yes"]:
            holder = lease.owner or "an unknown owner"
            if lease.state == "held":
                whose = f"held by {holder}, fence {lease.fence}"
            else:  # expired: still in the row until someone takes or cleans it
                whose = f"expired, last held by {holder}, fence {lease.fence}"
            raise CommandError(f"refusing to force-release {lease.name!r} ({whose}) without --yes")
        released = override.force_release(using, pks=[lease.pk], source="command")
        if not released:
            self.say(f"{lease.name} was released meanwhile; nothing to do.")
            return
        item = released[0]
        self.say(
            self.style.SUCCESS(
                f"Force-released {item.name} (was held by {item.owner or 'unknown'}, "
                f"fence {item.fence}). Its holder sees LockLost on its next renew or release."
            )
        )
