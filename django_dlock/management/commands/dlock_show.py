"""``manage.py dlock_show NAME``: one lock in detail."""

from __future__ import annotations

import re
from typing import Any

from django.core.management.base import CommandParser

from django_dlock import operations as override
from django_dlock.management.base import DlockCommand, no_such_lock
from django_dlock.management.commands.dlock_list import resolve_alias, seconds_text, table
from django_dlock.strategies import queue

#: every label dlock_show prints, so that their values line up in one column
LABELS = (
    "name",
    "state",
    "owner",
    "fence",
    "token",
    "acquired at",
    "expires at",
    "expires",
    "permits held",
    "permit of",
    "readers",
    "waiters",
    "advisory key",
    "GET_LOCK name",
)
LABEL_WIDTH = max(len(label) for label in LABELS)

#: the name of a semaphore's permit row: ``semaphore:<key>#<n>``
PERMIT_ROW = re.compile(r"(semaphore:.+)#(\d+)", re.S)


class Command(DlockCommand):
    help = (
        'Show one lock by name ("lock:invoice:42", or "invoice:42" for the lock namespace): '
        "its lease row, the waiters queued for it, and who holds its advisory lock "
        "(PostgreSQL: or awaits it; MySQL/MariaDB: IS_USED_LOCK). For a semaphore "
        '("semaphore:exports"): each permit\'s holder, and its waiters; for one permit '
        '("semaphore:exports#0"): its row. For a lock held by readers (shared=True): '
        "each reader."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", help="lock name")
        parser.add_argument("--using", default=None, help="database alias")

    def handle(self, *args: Any, **options: Any) -> None:
        using = resolve_alias(options["using"])
        name = options["name"]
        if name.startswith("semaphore:"):
            self._semaphore(using, name)
            return
        lease = override.find_lease(using, name)
        advisory = []
        key: tuple[int, ...] | None = None
        if override.is_postgresql(using):
            # (a two-part name, lock('order', 42), has a key of two int4: not a hash)
            key = override.advisory_key_of_name(name)
            advisory = [lk for lk in override.advisory_locks(using) if lk.key == key]
        user_lock: tuple[str, int | None] | None = None
        if override.is_mysql(using):
            user_lock = override.user_lock_holder(using, name)
        if lease is None and not advisory and (user_lock is None or user_lock[1] is None):
            raise no_such_lock(name, using)
        if lease is not None:
            self._lease(lease)
            self._readers(using, lease.name)
            self._waiters(using, lease.name)
        if key is not None:
            self._field("advisory key", str(key[0]) if len(key) == 1 else f"({key[0]}, {key[1]})")
            for lk in advisory:
                self.say(f"  {lk.state} {lk.mode} by pid {lk.pid} ({lk.application or 'no name'})")
        if user_lock is not None and user_lock[1] is not None:
            self._field("GET_LOCK name", user_lock[0])
            self.say(f"  held by connection {user_lock[1]}")

    def _semaphore(self, using: str, name: str) -> None:
        """A semaphore: its permit rows (who holds each, until when) and its queue."""
        permits = override.find_permits(using, name)
        held = [lease for lease in permits if lease.state == "held"]
        if not permits and not queue.waiters(using, [name]):
            if not self._permit(using, name):
                raise no_such_lock(name, using)
            return
        self._field("name", name)
        self._field("permits held", str(len(held)))
        rows = [
            [
                lease.name.rpartition("#")[2],
                lease.state,
                lease.owner or "-",
                str(lease.fence),
                seconds_text(lease),
            ]
            for lease in held
        ]
        if rows:
            for line in table(["PERMIT", "STATE", "OWNER", "FENCE", "EXPIRES"], rows):
                self.say(f"  {line}")
        self._waiters(using, name)

    def _permit(self, using: str, name: str) -> bool:
        """One permit's row (``semaphore:<key>#<n>``), with its semaphore's waiters;
        ``False`` if ``name`` names no permit row."""
        match = PERMIT_ROW.fullmatch(name)
        lease = None if match is None else override.find_lease(using, name)
        if match is None or lease is None:
            return False
        self._lease(lease, permit_of=f"{match.group(1)} (permit {match.group(2)})")
        self._waiters(using, match.group(1))
        return True

    def _lease(self, lease: override.Lease, permit_of: str | None = None) -> None:
        """A lease row's fields (a semaphore's permit row: which permit of which)."""
        acquired = lease.acquired_at
        fields = [("name", lease.name)]
        if permit_of is not None:
            fields.append(("permit of", permit_of))
        fields += [
            ("state", lease.state),
            ("owner", lease.owner or "-"),
            ("fence", str(lease.fence)),
            ("token", lease.token_prefix or "-"),
            ("acquired at", "-" if acquired is None else acquired.isoformat()),
            ("expires at", lease.expire_at.isoformat()),
            ("expires", seconds_text(lease)),
        ]
        for label, value in fields:
            self._field(label, value)

    def _readers(self, using: str, name: str) -> None:
        """A read-write lock's live readers (their rows), if any hold it."""
        readers = override.find_readers(using, name)
        if not readers:
            return
        self._field("readers", str(len(readers)))
        rows = [
            [label, lease.owner or "-", str(lease.fence), seconds_text(lease)]
            for label, lease in readers
        ]
        for line in table(["READER", "OWNER", "FENCE", "EXPIRES"], rows):
            self.say(f"  {line}")

    def _field(self, label: str, value: str) -> None:
        """``label  value``, every label padded to the longest one this command prints."""
        self.say(f"{label.ljust(LABEL_WIDTH)}  {value}")

    def _waiters(self, using: str, name: str) -> None:
        """The key's queue (lease strategy): position, ticket, owner, waiting since."""
        found = queue.waiters(using, [name])
        live = [row for row in found if row[4]]
        self._field("waiters", str(len(live)))
        if not found:
            return
        rows = []
        position = 0
        for _name, ticket, owner, since, is_live in found:
            if is_live:
                position += 1
            rows.append(
                [
                    str(position) if is_live else "-",
                    str(ticket),
                    owner or "-",
                    since.isoformat(),
                    "waiting" if is_live else "dead (ticket ran out)",
                ]
            )
        for line in table(["POSITION", "TICKET", "OWNER", "WAITING SINCE", "STATE"], rows):
            self.say(f"  {line}")
