"""Leadership on a quorum: the election's lease held on a majority of databases.

``LeaderElection(name, using=["a", "b", "c"])`` campaigns with the quorum
lease (:class:`~django_dlock.strategies.quorum.QuorumLease`): a candidate
leads while a majority of the databases holds its lease, like a Redlock
(https://redis.io/docs/latest/develop/use/patterns/distributed-locks/)
holder. Its term is the quorum lease's fencing number, which stays strictly
increasing even when successive leaders hold different majorities (the
quorum lease raises every database of a new majority to its number).

Timing is the single-database election's: a renewal that does not reach a
majority before ``renew_deadline`` ends the term, and ``renew_deadline <
lease`` means the leader stops before its lease can run out on the
databases, so before a standby can take it. One database down costs
nothing: the majority that remains renews.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from typing import Any

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from django_dlock.keys import Key
from django_dlock.leader.leadership import LeaderRecord
from django_dlock.strategies.base import Request, Strategy
from django_dlock.strategies.quorum import LiveRow, QuorumLease, quorum_strategy

__all__ = ["QuorumBackend"]


class QuorumBackend:
    """The election's backend on a quorum of databases (the lease strategy)."""

    #: a quorum's lease rows live on several databases: no transaction keeps them
    guards: Strategy | None = None

    def __init__(self, aliases: tuple[str, ...], retry: float) -> None:
        self.quorum: QuorumLease = quorum_strategy("lease", aliases)
        #: a renewal round waits this long at most for slow databases
        self.retry = retry

    def acquire(self, req: Request, wait: float) -> int | None:
        return self.quorum.try_acquire(req)

    def renew(self, req: Request) -> bool:
        return self.quorum.extend_within(req, req.ttl, self.retry)

    def release(self, req: Request) -> bool:
        return self.quorum.release(req)

    def observe(self, req: Request, lease: float) -> tuple[LeaderRecord | None, float]:
        rows, _ = self.quorum.live_rows(req.key)
        return self._record(rows, lease), self._free_in(rows)

    def record(self, key: Key, lease: float) -> LeaderRecord | None:
        rows, _ = self.quorum.live_rows(key)
        return self._record(rows, lease)

    def _record(self, rows: dict[str, LiveRow | None], lease: float) -> LeaderRecord | None:
        """The owner whose lease is live on a majority, with its term.

        The term is the fence a majority of its rows carry (the number the
        quorum granted, see :class:`QuorumLease`): a database that answered
        a round late may carry another number, which is not the term.
        """
        by_owner: dict[str, list[LiveRow]] = {}
        for row in rows.values():
            if row is not None:
                by_owner.setdefault(row.owner, []).append(row)
        for owner, held in by_owner.items():
            if len(held) >= self.quorum.need:
                counts = Counter(row.fence for row in held)
                granted = [fence for fence, n in counts.items() if n >= self.quorum.need]
                term = max(granted) if granted else max(counts)
                top = next(row for row in held if row.fence == term)
                expires = max(_aware(row.expires) for row in held)
                return LeaderRecord(
                    identity=owner,
                    term=term,
                    since=_aware(top.since) if top.since is not None else None,
                    renewed=expires - dt.timedelta(seconds=lease),
                    expires=expires,
                )
        return None

    def _free_in(self, rows: dict[str, LiveRow | None]) -> float:
        """Seconds until a majority of the answering databases is free (<= 0: now)."""
        lefts = sorted(-1.0 if row is None else row.left for row in rows.values())
        return lefts[self.quorum.need - 1]

    def close(self) -> None:
        return None


def _aware(value: Any) -> dt.datetime:
    """A time read with raw SQL as an aware datetime (SQLite gives text, MySQL naive UTC)."""
    if isinstance(value, str):
        value = parse_datetime(value)
    if not isinstance(value, dt.datetime):
        raise TypeError(f"not a time: {value!r}")
    return timezone.make_aware(value, dt.timezone.utc) if timezone.is_naive(value) else value
