"""Quorum locks: one lease on a majority of independent databases.

``dlock.lock(key, using=["a", "b", "c"])`` holds the ``lease`` strategy's row
on a majority of the named databases, the way Redlock
(https://redis.io/docs/latest/develop/use/patterns/distributed-locks/) holds
a key on a majority of independent Redis servers:

1. **Acquire in parallel.** Every database gets the lease's own acquire
   statement at the same time (one worker thread per database and caller).
   As soon as a majority has accepted, the lock is taken; as soon as a
   majority has refused or failed, the round is over.
2. **Validity.** The lock is held only if a majority accepted within the
   validity window: ``validity = ttl - elapsed - drift`` with
   ``drift = 1 % of ttl + 2 ms``. A round that took too long gives
   everything back.
3. **Fencing across majorities** (a second round): the fencing number is
   the largest number any database of the majority issued, and every
   database of the majority is raised to it before the lock is granted. Two
   majorities share at least one database, and that database issues the
   next holder a number above the raised one, so numbers stay strictly
   increasing even when the majorities differ.
4. **Release on all**, best effort: databases that do not answer are not
   waited for; their leases run out on their own.

A down database costs bounded time: a round never waits past the lease's
validity (nor past the caller's deadline, but at least :data:`ROUND_FLOOR`
for a single try); new connections get a connect timeout from the remaining
validity, and on PostgreSQL every statement a ``statement_timeout`` and
``lock_timeout`` of the lease's length, so a hung server frees its worker.
A database that is back is used again at the next round.

Each acquisition stores a token of its own (the holder's token and a short
suffix), so an answer that arrives after a round was given up can only
give back that round's leases, never a later round's.

The modules of this package: :mod:`~django_dlock.strategies.quorum.aliases`
(which databases make a quorum, and its system checks),
:mod:`~django_dlock.strategies.quorum.rounds` (a thread pool per database,
each worker with its own bounded connection),
:mod:`~django_dlock.strategies.quorum.rounds` (one operation on every
database at once), :mod:`~django_dlock.strategies.quorum.statements` (the
SQL a quorum adds to the lease's) and
:mod:`~django_dlock.strategies.quorum.strategy` (:class:`QuorumLease`). Their
public names are importable from this package.
"""

from __future__ import annotations

from django_dlock.strategies.quorum.aliases import (
    declared,
    majority,
    quorum_aliases,
    quorum_problems,
    same_database,
)
from django_dlock.strategies.quorum.rounds import (
    MIN_CONNECT_TIMEOUT,
    WORKERS_PER_ALIAS,
    close_all,
)
from django_dlock.strategies.quorum.statements import LiveRow
from django_dlock.strategies.quorum.strategy import (
    DRIFT_FACTOR,
    DRIFT_FLOOR,
    ROUND_FLOOR,
    QuorumLease,
    drift,
    quorum_strategy,
)

__all__ = [
    "DRIFT_FACTOR",
    "DRIFT_FLOOR",
    "MIN_CONNECT_TIMEOUT",
    "ROUND_FLOOR",
    "WORKERS_PER_ALIAS",
    "LiveRow",
    "QuorumLease",
    "close_all",
    "declared",
    "drift",
    "majority",
    "quorum_aliases",
    "quorum_problems",
    "quorum_strategy",
    "same_database",
]
