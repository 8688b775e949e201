"""``manage.py dlock_list``: the locks held now (lease rows, advisory locks).

On MySQL/MariaDB the advisory strategy's ``GET_LOCK`` locks are listed where
the server shows them (``performance_schema.metadata_locks``, or MariaDB's
``METADATA_LOCK_INFO`` plugin); otherwise the command says that it cannot.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from django_dlock import operations as override
from django_dlock.management.base import DlockCommand
from django_dlock.strategies import queue
from django_dlock.validation import alias_error


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Rows as aligned text columns."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    return lines


def seconds_text(lease: override.Lease) -> str:
    if lease.state == "held":
        return f"{lease.seconds_left:.1f} s left"
    return f"ended {abs(lease.seconds_left):.1f} s ago"


def waiter_counts(using: str, names: list[str]) -> dict[str, int]:
    """How many live waiters queue for each of ``names`` (lease strategy)."""
    counts: dict[str, int] = {}
    for name, _ticket, _owner, _since, live in queue.waiters(using, names):
        if live:
            counts[name] = counts.get(name, 0) + 1
    return counts


def resolve_alias(using: str | None) -> str:
    alias = using or override.default_alias()
    problem = alias_error(alias)
    if problem is not None:
        raise CommandError(problem)
    return alias


class Command(DlockCommand):
    help = (
        "List the locks held now: lease rows (state on the database clock) and "
        "advisory locks (PostgreSQL: held or awaited; MySQL/MariaDB: where the server "
        "shows them)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--using", default=None, help="database alias")
        parser.add_argument(
            "--all", action="store_true", help="also list expired and released lease rows"
        )
        parser.add_argument(
            "--limit", type=int, default=1000, help="at most this many lease rows (default 1000)"
        )
        parser.add_argument(
            "--waiting",
            action="store_true",
            help="who waits on whom: each key that has waiters, its holders and its queue "
            "(lease locks and semaphores; PostgreSQL advisory locks with pg_blocking_pids)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = resolve_alias(options["using"])
        limit = options["limit"]
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise CommandError(f"--limit must be a whole number >= 1, got {limit!r}")
        if options["waiting"]:
            self._waiting(using)
            return
        leases = override.leases(using, held_only=not options["all"], limit=limit)
        what = "Lease rows" if options["all"] else "Held leases"
        self.say(f"{what} in {using!r}: {len(leases)}")
        if leases:
            queued = waiter_counts(using, [lease.name for lease in leases])
            rows = [
                [
                    lease.name,
                    f"{lease.state} (long)" if lease.held_long else lease.state,
                    lease.owner,
                    str(lease.fence),
                    lease.token_prefix,
                    seconds_text(lease),
                    str(queued.get(lease.name, 0)),
                ]
                for lease in leases
            ]
            headers = ["NAME", "STATE", "OWNER", "FENCE", "TOKEN", "EXPIRES", "WAITERS"]
            for line in table(headers, rows):
                self.say(line)
        if override.is_postgresql(using):
            advisory = override.advisory_locks(using)
            self.say(f"Advisory locks in {using!r}: {len(advisory)}")
            if advisory:
                # the lock name behind each key, where it can be known (the admin's
                # advisory page shows the same): a key is a hash of its name
                names = override.advisory_names(using, {lk.key for lk in advisory})
                rows = [
                    [
                        lk.key_text,
                        names.get(lk.key, "-"),
                        lk.kind,
                        lk.state,
                        lk.mode,
                        str(lk.pid),
                        lk.application,
                        "" if lk.waiting_since is None else lk.waiting_since.isoformat(),
                    ]
                    for lk in advisory
                ]
                headers = [
                    "KEY",
                    "NAME",
                    "KIND",
                    "STATE",
                    "MODE",
                    "PID",
                    "APPLICATION",
                    "WAITING SINCE",
                ]
                for line in table(headers, rows):
                    self.say(line)
                if any(lk.key not in names for lk in advisory):
                    self.say(
                        "NAME -: a key is a hash of its lock's name, and this one's name is "
                        "in no lease or waiter row (dlock_show NAME finds a name's key)"
                    )
        if override.is_mysql(using):
            self._user_locks(using)

    def _waiting(self, using: str) -> None:
        """The blocking tree: every key with live waiters, who holds it, and its
        queue in order; then PostgreSQL's advisory locks that are awaited."""
        leases, advisory = override.blocking_tree(using)
        self.say(f"Keys with waiters in {using!r}: {len(leases)}")
        for awaited in leases:
            if awaited.semaphore:
                self.say(f"{awaited.name}: {len(awaited.holders)} permits held")
            else:
                state = "held" if awaited.holders else "free (handed to the head of the queue)"
                self.say(f"{awaited.name}: {state}")
            for lease in awaited.holders:
                left = seconds_text(lease)
                self.say(f"  holder  {lease.owner or '-'}  fence {lease.fence}  {left}")
            for waiter in awaited.waiters:
                cycle = "  IN A DEADLOCK (see below)" if waiter.in_deadlock else ""
                self.say(
                    f"  {waiter.position}. ticket {waiter.ticket}  {waiter.owner or '-'}  "
                    f"waiting since {waiter.since.isoformat()}{cycle}"
                )
        if any(w.in_deadlock for awaited in leases for w in awaited.waiters):
            self._deadlocks(using)
        if advisory is None:
            return
        self.say(f"Advisory keys with waiters in {using!r}: {len(advisory)}")
        for key in advisory:
            self.say(f"{key.key_text}{f' ({key.label})' if key.label else ''}:")
            for lk in key.holders:
                self.say(f"  holder  pid {lk.pid} ({lk.application or 'no name'}) {lk.mode}")
            for lk, blockers in key.waiters:
                waits_for = ", ".join(str(pid) for pid in blockers) or "-"
                self.say(
                    f"  waiting pid {lk.pid} ({lk.application or 'no name'}) {lk.mode}, "
                    f"blocked by pid {waits_for}"
                )

    def _deadlocks(self, using: str) -> None:
        """Each deadlock: who holds what and waits for what, around the cycle."""
        found = override.deadlocks(using)
        self.say(f"Deadlocks in {using!r}: {len(found)}")
        for number, cycle in enumerate(found, start=1):
            self.say(f"Deadlock {number}:")
            size = len(cycle.keys)
            for i, holder in enumerate(cycle.holders):
                self.say(
                    f"  {holder or '-'}  holds {cycle.keys[i]}, waits for "
                    f"{cycle.keys[(i + 1) % size]}"
                )
            self.say(f"  ticket {cycle.victim}, the youngest waiter, gives up with LockDeadlock")

    def _user_locks(self, using: str) -> None:
        found = override.user_locks(using)
        if found.source is None:
            self.say(f"Advisory locks in {using!r}: cannot list them: {found.problem}")
            return
        self.say(
            f"Advisory locks (GET_LOCK) on the server of {using!r}, from {found.source}: "
            f"{len(found.locks)}"
        )
        if found.locks:
            rows = [
                [lk.name, lk.state, str(lk.connection_id), lk.user, lk.host] for lk in found.locks
            ]
            for line in table(["NAME", "STATE", "CONNECTION", "USER", "HOST"], rows):
                self.say(line)
