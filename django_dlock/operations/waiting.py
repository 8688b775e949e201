"""Who waits on whom: the blocking tree shown by ``dlock_list --waiting`` and the admin.

For each lease key (a lock, or a semaphore's permits) with live waiters: who
holds it (the lease, each reader of a read-write lock, each permit) and its
queue in order; the deadlocks among them (cycles of waiters that each wait
for a key another holds). On PostgreSQL, for each awaited advisory
key: its holders and each waiter with the backends that block it
(``pg_blocking_pids``).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from django_dlock.operations.lease_rows import Lease, find_lease, find_permits, find_readers
from django_dlock.operations.pg_advisory import (
    AdvisoryLock,
    advisory_locks,
    advisory_names,
    blocking_pids,
    is_postgresql,
)
from django_dlock.strategies import queue
from django_dlock.strategies.lease.deadlock import Cycle, cycles, read_graph

__all__ = ["AwaitedAdvisory", "AwaitedLease", "Waiting", "blocking_tree", "deadlocks"]


@dataclass(frozen=True)
class Waiting:
    """One waiter in a lease queue."""

    position: int
    ticket: int
    owner: str
    since: dt.datetime
    #: waits on a deadlock's cycle (see :func:`deadlocks`)
    in_deadlock: bool = False


@dataclass(frozen=True)
class AwaitedLease:
    """A lease key (a lock, or a semaphore) with live waiters."""

    name: str
    #: the live holders: the lease, a read-write lock's readers, or a
    #: semaphore's held permits
    holders: list[Lease]
    waiters: list[Waiting]

    @property
    def semaphore(self) -> bool:
        return self.name.startswith("semaphore:")


@dataclass(frozen=True)
class AwaitedAdvisory:
    """A PostgreSQL advisory key that somebody waits for."""

    key_text: str
    #: the lock name behind the key, where it can be known
    label: str
    holders: list[AdvisoryLock]
    #: each waiter, and the backend pids that block it
    waiters: list[tuple[AdvisoryLock, list[int]]] = field(default_factory=list)


def blocking_tree(alias: str) -> tuple[list[AwaitedLease], list[AwaitedAdvisory] | None]:
    """The lease keys with live waiters, by name, and (PostgreSQL; else ``None``)
    the awaited advisory keys."""
    queues: dict[str, list[tuple[int, str, dt.datetime]]] = {}
    for name, ticket, owner, since, live in queue.waiters(alias, None):
        if live:
            queues.setdefault(name, []).append((ticket, owner, since))
    leases = []
    cycled = {n for cycle in deadlocks(alias) for n in cycle.tickets} if queues else set()
    for name, found in sorted(queues.items()):
        if name.startswith("semaphore:"):
            holders = [p for p in find_permits(alias, name) if p.state == "held"]
        else:
            lease = find_lease(alias, name)
            holders = [] if lease is None or lease.state != "held" else [lease]
            if holders:  # a read-write lock held by readers: each reader
                holders = [reader for _, reader in find_readers(alias, name)] or holders
        waiters = [
            Waiting(position, ticket, owner, since, ticket in cycled)
            for position, (ticket, owner, since) in enumerate(found, start=1)
        ]
        leases.append(AwaitedLease(name, holders, waiters))
    return leases, (_advisory(alias) if is_postgresql(alias) else None)


def deadlocks(alias: str) -> list[Cycle]:
    """The deadlocks among the lease waiters of ``alias`` now: one cycle each,
    as its youngest waiter is (or is about to be) told (see
    :mod:`django_dlock.strategies.lease.deadlock`)."""
    return cycles(read_graph(alias))


def _advisory(alias: str) -> list[AwaitedAdvisory]:
    locks = advisory_locks(alias)
    awaited = sorted({lk.key for lk in locks if not lk.granted})
    if not awaited:
        return []
    names = advisory_names(alias, awaited)
    blockers = blocking_pids(alias, [lk.pid for lk in locks if not lk.granted])
    found = []
    for key in awaited:
        here = [lk for lk in locks if lk.key == key]
        found.append(
            AwaitedAdvisory(
                key_text=here[0].key_text,
                label=names.get(key, ""),
                holders=[lk for lk in here if lk.granted],
                waiters=[(lk, blockers.get(lk.pid, [])) for lk in here if not lk.granted],
            )
        )
    return found
