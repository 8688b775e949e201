"""What an election asks of the database, per strategy (``lease``, ``advisory``)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any, Protocol

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from django_dlock import notify
from django_dlock.keys import Key
from django_dlock.leader.leadership import LeaderRecord
from django_dlock.retry import Deadline
from django_dlock.strategies.base import Request, Strategy
from django_dlock.strategies.connection import _usable, statement_deadline

logger = logging.getLogger("django_dlock")

__all__ = ["ADVISORY_TOKEN"]

# -- database access, per strategy ------------------------------------------------


class _Backend(Protocol):
    """What the election asks of the database. Runs in the election's I/O thread."""

    #: the strategy that can check and keep a term's lease row inside a
    #: transaction (``Leadership.guard()``), or ``None``
    guards: Strategy | None

    def acquire(self, req: Request, wait: float) -> int | None:
        """Become the leader: the term if acquired, else ``None``.

        A backend that can wait for the leadership efficiently waits up to
        ``wait`` seconds; others try once.
        """

    def renew(self, req: Request) -> bool:
        """Renew the leadership; ``False`` if it is no longer ours."""

    def release(self, req: Request) -> bool:
        """Give the leadership up."""

    def observe(self, req: Request, lease: float) -> tuple[LeaderRecord | None, float]:
        """The current leader and the seconds until its lease ends (<= 0: free)."""

    def close(self) -> None:
        """End of the I/O thread: drop what it holds."""


def _read_record(alias: str, key: Key, lease: float) -> LeaderRecord | None:
    from django_dlock.models import Lock as LockRow

    found = (
        LockRow.objects.using(alias)
        .held()
        .filter(name=key.name)
        .exclude(token="")
        .values_list("owner", "fence", "acquired_at", "expire_at")
        .first()
    )
    if found is None:
        return None
    owner, fence, since, expires = found
    renewed = expires - dt.timedelta(seconds=lease)
    return LeaderRecord(
        identity=owner, term=int(fence), since=since, renewed=renewed, expires=expires
    )


def read_record(alias: str, key: Key, lease: float) -> LeaderRecord | None:
    """:func:`_read_record` on the thread's connection, reconnecting once if it had dropped.

    After a fail-over (or a restart) the thread's connection still points at
    the old server: the first query fails, Django does not close it, and
    the next query would fail again. Lock methods reconnect the same way.
    """
    try:
        return _read_record(alias, key, lease)
    except (OperationalError, InterfaceError):
        connection = connections[alias]
        if connection.in_atomic_block or _usable(connection):
            raise
        connection.close()
    return _read_record(alias, key, lease)


class _LeaseBackend:
    """Leadership is the lease row ``leader:<name>``.

    ``bound``: the longest an attempt to take the lease may wait for the
    database. Behind a pooler (PgBouncer in transaction mode) a statement
    can wait for a free server connection far longer (``query_wait_timeout``);
    the attempt is then given up at ``bound`` like a lock's acquire at its
    timeout, and the candidate tries again at its next turn.
    """

    def __init__(self, bound: float) -> None:
        from django_dlock.strategies.lease import lease

        self.lease = lease
        self.guards: Strategy | None = lease
        self.bound = bound

    def acquire(self, req: Request, wait: float) -> int | None:
        with statement_deadline(Deadline(self.bound), req.alias):
            return self.lease.try_acquire(req)

    def renew(self, req: Request) -> bool:
        return self.lease.extend(req, req.ttl)

    def release(self, req: Request) -> bool:
        released = self.lease.release(req)
        if released:
            notify.wake(req.alias, req.key.name)  # the candidates listen by name
        return released

    def observe(self, req: Request, lease: float) -> tuple[LeaderRecord | None, float]:
        left = self.lease.seconds_left(req.alias, req.key)
        return _read_record(req.alias, req.key, lease), left

    def close(self) -> None:
        return None


#: tokens of advisory candidates start with this: their lease rows can be
#: taken over by whoever holds the election's advisory lock
ADVISORY_TOKEN = "adv:"


class _AdvisoryBackend:
    """Leadership is the election's session-level advisory lock (PostgreSQL).

    The lock is the source of truth: it ends with the leader's session, so
    a killed leader is replaced at once, and standbys wait for it in
    PostgreSQL's lock queue (no polling). The lease row ``leader:<name>``
    records the leader and its term for :meth:`LeaderElection.leader` and
    the admin; whoever holds the advisory lock takes the row over.
    """

    def __init__(self, on_lost: Callable[[str], None], bound: float) -> None:
        from django_dlock.strategies import implementation
        from django_dlock.strategies.lease import lease

        self.advisory = implementation("advisory", "postgresql")
        self.lease = lease
        # whoever holds the advisory lock holds the lease row too (taken over)
        self.guards: Strategy | None = lease
        self.on_lost = on_lost
        self.warned = False
        #: the longest the take-over of the lease row may wait (see _LeaseBackend)
        self.bound = bound

    def acquire(self, req: Request, wait: float) -> int | None:
        from django_dlock.identity import current_holder
        from django_dlock.retry import Deadline

        if self.advisory.acquire(req, Deadline(wait), 0.05) is None:
            return None
        try:
            with statement_deadline(Deadline(self.bound), req.alias):
                term = self.lease.take_over(req, ADVISORY_TOKEN)
        except BaseException:
            self.advisory.release(req)
            raise
        if term is None:
            self.advisory.release(req)
            logger.error(
                "django-dlock: %s: the lease row is held by a candidate of the lease "
                "strategy; every candidate of one election must use the same strategy",
                req.key.name,
            )
            return None
        # the advisory session watcher reports the end of the session here
        current_holder().losses[(req.alias, self.advisory.family, req.key.name)] = self.on_lost
        return term

    def renew(self, req: Request) -> bool:
        return self.advisory.owned(req) and self.lease.extend(req, req.ttl)

    def release(self, req: Request) -> bool:
        from django_dlock.identity import current_holder

        current_holder().losses.pop((req.alias, self.advisory.family, req.key.name), None)
        # The lock first: a standby woken by the row's NOTIFY must find it free.
        unlocked = self.advisory.release(req)
        released = self.lease.release(req)
        if released:
            notify.wake(req.alias, req.key.name)  # the candidates listen by name
        return unlocked and released

    def observe(self, req: Request, lease: float) -> tuple[LeaderRecord | None, float]:
        record = _read_record(req.alias, req.key, lease)
        if record is None:  # no unexpired lease: is the lock's holder frozen?
            self._end_frozen_holder(req, lease)
        return record, 0.0

    def _end_frozen_holder(self, req: Request, lease: float) -> None:
        """End the session of a holder that neither renews nor lets go.

        A frozen leader (SIGSTOP, a stuck VM) keeps its session, so it keeps
        the advisory lock, but it stops renewing: its lease row expires and
        its session stays idle. When both are true on the database clock
        (the row has expired and the holder's session has run nothing for
        ``lease`` seconds), the standby ends that session with
        ``pg_terminate_backend``; the lock is then free. A new leader that
        has just taken the lock is never mistaken for it: its session has
        just run the lock statement.
        """
        from django_dlock.keys import pg_locks_ids
        from django_dlock.strategies._pg import PG_LOCKS_MATCH
        from django_dlock.strategies.connection import fetch_one, lock_connection

        if self.lease.seconds_left(req.alias, req.key) > 0:
            return
        connection = lock_connection(req.alias)
        found = fetch_one(
            connection,
            "SELECT pid, EXTRACT(EPOCH FROM clock_timestamp() - state_change) "
            "FROM pg_stat_activity WHERE pid = (SELECT pid FROM pg_locks WHERE "
            + PG_LOCKS_MATCH
            + " LIMIT 1)",
            list(pg_locks_ids(req.key)),
        )
        if found is not None and found[1] is None:
            self._warn_once(
                "django-dlock: %s: the lease has expired but the advisory lock is held by a "
                "session whose activity this candidate cannot see (backend %s): connect as "
                "the same role, or grant pg_read_all_stats and pg_signal_backend, so that a "
                "frozen leader can be replaced",
                req.key.name,
                found[0],
            )
            return
        if found is None or float(found[1]) <= lease:
            return  # nobody holds it, or a holder that ran a statement within the lease
        pid, idle = int(found[0]), float(found[1])
        try:
            fetch_one(connection, "SELECT pg_terminate_backend(%s)", [pid])
        except DatabaseError as exc:
            self._warn_once(
                "django-dlock: %s: the leader's session (backend %d) has been idle for "
                "%.1f s and its lease has expired, but this candidate may not end it "
                "(pg_terminate_backend needs the same role or pg_signal_backend): %s",
                req.key.name,
                pid,
                idle,
                exc,
            )
            return
        logger.warning(
            "django-dlock: %s: ended the session of a frozen leader (backend %d, idle for "
            "%.1f s, lease expired)",
            req.key.name,
            pid,
            idle,
        )

    def _warn_once(self, message: str, *args: Any) -> None:
        if not self.warned:
            self.warned = True
            logger.error(message, *args)

    def close(self) -> None:
        return None
