"""The quorum lease: the ``lease`` strategy held on a majority of databases.

:class:`QuorumLease` implements the strategy protocol over several
database aliases (see :mod:`django_dlock.strategies.quorum` for the
algorithm): an acquire is a round of the lease's acquire statement on every
database, then a round that raises the majority to one fencing number; the
lock is held while a majority holds it within its validity
(``ttl - elapsed - drift``). :func:`quorum_strategy` gives the one instance
per set of databases.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock._unasync import blocking, run_to_end
from django_dlock.conf import RetryInterval
from django_dlock.exceptions import QuorumUnavailable, StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline, interval
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import execute
from django_dlock.strategies.lease import lease
from django_dlock.strategies.quorum.aliases import majority, same_server
from django_dlock.strategies.quorum.rounds import (
    Round,
    coordinator,
    give_back,
    give_back_when_done,
    run_round,
    servers,
)
from django_dlock.strategies.quorum.statements import (
    LiveRow,
    fence_raise_sql,
    live_row,
    owned_sql,
    release_after_on,
)

__all__ = [
    "DRIFT_FACTOR",
    "DRIFT_FLOOR",
    "ROUND_FLOOR",
    "QuorumLease",
    "drift",
    "quorum_strategy",
]

logger = logging.getLogger("django_dlock")

#: Redlock's clock drift allowance: this fraction of the ttl, plus DRIFT_FLOOR
DRIFT_FACTOR = 0.01
DRIFT_FLOOR = 0.002
#: the least time one round waits for answers, also for a single try
ROUND_FLOOR = 1.0


def drift(ttl: float) -> float:
    """Redlock's allowance for clocks that run at different rates."""
    return ttl * DRIFT_FACTOR + DRIFT_FLOOR


_strategies: dict[tuple[str, ...], QuorumLease] = {}


def quorum_strategy(name: str, aliases: tuple[str, ...]) -> QuorumLease:
    """The quorum of the ``name`` strategy over ``aliases`` (only ``lease`` can).

    Raises:
        StrategyNotSupported: ``name`` is not ``"lease"``.
    """
    if name != "lease":
        raise StrategyNotSupported(
            f"the {name} strategy cannot span several databases: using=[...] holds a "
            "lease on a majority of them, so it needs strategy='lease' (advisory and "
            "row locks live and die with one server session)"
        )
    found = _strategies.get(aliases)
    if found is None:
        found = _strategies[aliases] = QuorumLease(aliases)
    return found


@dataclasses.dataclass
class _Held:
    """One quorum holding: its stored token, the databases that hold it, until when."""

    token: str
    aliases: frozenset[str]
    valid_until: float
    #: the acquire of each database (some may still run when the lock is granted)
    first: dict[str, concurrent.futures.Future[Any]]
    #: the databases' last answer to a renewal or an ownership check
    last: Round | None = None


class QuorumLease:
    """The ``lease`` strategy on a majority of ``aliases``.

    The algorithm is described in :mod:`django_dlock.strategies.quorum`.
    Implements the strategy protocol of :mod:`django_dlock.strategies.base`.
    """

    name = "lease"
    transaction_scoped = False
    leased = True
    shares = False

    def __init__(self, aliases: tuple[str, ...]) -> None:
        self.aliases = aliases
        self.need = majority(len(aliases))
        #: holdings of the same key on another set of databases are other locks
        self.family = "lease-quorum:" + ",".join(aliases)
        self._held: dict[tuple[str, str], _Held] = {}
        self._mutex = threading.Lock()

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        for alias in self.aliases:
            lease.check_supported(connections[alias])

    def ended(self, req: Request) -> bool:
        return False  # a lease ends by release, expiry or takeover, never on its own

    # -- acquire ------------------------------------------------------------

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        rounds = self._rounds(req, deadline, policy, blocking(self.attempt), blocking(time.sleep))
        return run_to_end(rounds)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        return await self._rounds(req, deadline, policy, self._aattempt, asyncio.sleep)

    async def _rounds(
        self,
        req: Request,
        deadline: Deadline,
        policy: RetryInterval,
        attempt: Callable[[Request, Deadline], Awaitable[Grant | Round]],
        sleep: Callable[[float], Awaitable[None]],
    ) -> Grant | None:
        """Rounds until a majority grants or the deadline passes (the sync
        :meth:`acquire` runs it with blocking steps).

        A round that took some databases but not a majority was a split vote
        with other contenders: the next round waits, besides the retry
        policy's pause, a random part of as long as the round took (doubled
        after each split, up to 8 times), as Redlock advises, so that
        contenders who keep splitting the votes drift apart instead of
        meeting again at every round.

        No round starts once the deadline has passed, and one that starts
        just before it ends with it: whether the databases were reachable is
        judged by the last round that was decided, or had at least
        :data:`ROUND_FLOOR` to hear from them.
        """
        tries = splits = 0
        judged: Round | None = None
        while True:
            started = time.monotonic()
            outcome = await attempt(req, deadline)
            if isinstance(outcome, Grant):
                return outcome
            if not outcome.timed_out or time.monotonic() - started >= ROUND_FLOOR:
                judged = outcome
            if deadline.expired():
                return self._gave_up(req, judged or outcome)
            pause = interval(policy, tries)
            if outcome.accepted:
                spread = (time.monotonic() - started) * min(2**splits, 8)
                pause += random.uniform(0.0, spread)
                splits += 1
            await sleep(min(pause, deadline.remaining()))
            if deadline.expired():
                return self._gave_up(req, judged or outcome)
            tries += 1

    async def _aattempt(self, req: Request, deadline: Deadline) -> Grant | Round:
        """One round in a worker thread; a grant that comes too late is given back."""
        future = coordinator().submit(self.attempt, req, deadline)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda done: self._give_back_late(req, done))
            raise

    def _give_back_late(self, req: Request, done: concurrent.futures.Future[Any]) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        if isinstance(done.result(), Grant):
            try:
                self.release(req)
            except Exception:
                logger.exception("django-dlock: could not give back %s", req.key.name)

    def _gave_up(self, req: Request, last: Round) -> Grant | None:
        down = len(last.failed) + (len(last.silent) if last.timed_out else 0)
        answered = len(self.aliases) - down
        if answered < self.need:
            raise QuorumUnavailable(
                f"could not acquire {req.key.name!r}: only {answered} of "
                f"{len(self.aliases)} databases answered, {self.need} are needed "
                f"({last.why()})"
            )
        return None

    def attempt(self, req: Request, deadline: Deadline) -> Grant | Round:
        """One round: a grant, or what the databases said."""
        started = time.monotonic()
        validity_end = started + req.ttl - drift(req.ttl)
        # (the floor counts from the start of the acquire, not of this round:
        # a later round never runs past the caller's timeout)
        end = min(validity_end, max(deadline.end, deadline.start + ROUND_FLOOR))
        token = f"{req.token}#{secrets.token_hex(4)}"
        mine = dataclasses.replace(req, token=token)

        def acquire_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda connection: lease.acquire_on(connection, mine, None)

        first = run_round(
            self.aliases, req.ttl, end, acquire_on, lambda fence: fence is not None, self.need
        )
        self._refuse_twins(first, mine)
        raised: set[str] = set()
        fence = 0
        if len(first.accepted) >= self.need:
            fence = max(int(f) for f in first.accepted.values())
            raised = {alias for alias, f in first.accepted.items() if f == fence}
            lower = [alias for alias in first.accepted if alias not in raised]
            if lower and len(raised) < self.need:
                raised |= self._raise_fences(lower, mine, fence, end)
        if len(raised) >= self.need and time.monotonic() < validity_end:
            with self._mutex:
                self._held[(req.token, req.key.name)] = _Held(
                    token, frozenset(raised), validity_end, first.futures
                )
            return Grant(fence, started)
        # Given back before the next round: left to the background, a lease
        # could still be there when the caller's next round asks, and refuse
        # it (each round has its own token). Waited for only until the
        # round's end (the caller's deadline, or the floor of a single try):
        # a database that stalls is released in the background.
        release = functools.partial(lease.release_on, req=mine)
        wait = max(0.0, end - time.monotonic())
        give_back(first.futures, mine.ttl, ROUND_FLOOR, release, wait=wait)
        return first

    def _refuse_twins(self, first: Round, mine: Request) -> None:
        """Raise if two of the databases turned out to be one (before any grant).

        Each worker learns what its database is when it connects (see
        :func:`~django_dlock.strategies.quorum.aliases.server_identity`):
        ``127.0.0.1`` and ``localhost`` are one server, and would cast two
        votes of a majority.

        Raises:
            ImproperlyConfigured: two aliases reach the same database.
        """
        known = {alias: servers[alias] for alias in self.aliases if alias in servers}
        twins = same_server(known)
        if not twins:
            return
        give_back(first.futures, mine.ttl, ROUND_FLOOR, lambda c: lease.release_on(c, mine))
        one, other = twins[0]
        raise ImproperlyConfigured(
            f"the quorum {list(self.aliases)!r} counts one database twice: {one!r} and "
            f"{other!r} reach the same database on the same server; a quorum needs "
            "independent databases (system check dlock.E062)"
        )

    def _raise_fences(self, aliases: list[str], mine: Request, fence: int, end: float) -> set[str]:
        """Raise the row of each database in ``aliases`` to ``fence``; where it worked.

        Waits for the answers until ``end``: the same end as the round's
        first step (the caller's deadline, at least :data:`ROUND_FLOOR`,
        never past the validity), so a slow or silent database cannot keep
        the caller past its timeout.
        """

        def raise_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            def run(connection: BaseDatabaseWrapper) -> int:
                sql = fence_raise_sql(connection)
                return int(execute(connection, sql, [fence, mine.key.name, mine.token])[1])

            return run

        done = run_round(aliases, mine.ttl, end, raise_on, lambda rows: rows > 0, 1, wait_all=True)
        return set(done.accepted)

    def try_acquire(self, req: Request) -> int | None:
        grant = self.acquire(req, Deadline(0), 0.0)
        return None if grant is None else grant.fence

    # -- release, extend, inspect ------------------------------------------------

    def _holding(self, req: Request) -> _Held | None:
        with self._mutex:
            return self._held.get((req.token, req.key.name))

    def _counts(self, held: _Held, answer: Round) -> bool:
        """Whether a majority still holds it: answers, plus silent databases of ours
        whose lease surely still runs."""
        count = len(answer.accepted)
        if time.monotonic() < held.valid_until:
            count += len(held.aliases & set(answer.unreachable()))
        return count >= self.need

    def release(self, req: Request) -> bool:
        with self._mutex:
            held = self._held.pop((req.token, req.key.name), None)
        if held is None:
            return False
        mine = dataclasses.replace(req, token=held.token)
        end = time.monotonic() + ROUND_FLOOR

        def release_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            min_hold = mine.hold_at_least
            if min_hold:  # TaskLock's min_hold
                return lambda connection: release_after_on(connection, mine, min_hold)
            return lambda connection: lease.release_on(connection, mine)

        # A database whose acquire is still running is released when it ends.
        late = [alias for alias, future in held.first.items() if not future.done()]
        for alias in late:
            release_late = functools.partial(lease.release_on, req=mine)
            give_back_when_done(alias, held.first[alias], mine.ttl, ROUND_FLOOR, release_late)
        answering = [alias for alias in self.aliases if alias not in late]
        # Done when a majority has released: the others finish in the background.
        answer = run_round(answering, req.ttl, end, release_on, bool, self.need)
        return self._counts(held, answer)

    def extend(self, req: Request, ttl: float) -> bool:
        return self.extend_within(req, ttl, None)

    def extend_within(self, req: Request, ttl: float, within: float | None) -> bool:
        """:meth:`extend`, waiting at most ``within`` seconds for the databases' answers."""
        held = self._holding(req)
        if held is None:
            return False
        mine = dataclasses.replace(req, token=held.token)
        started = time.monotonic()
        validity_end = started + ttl - drift(ttl)
        end = min(validity_end, started + max(ROUND_FLOOR, held.valid_until - started))
        if within is not None:
            end = min(end, started + max(ROUND_FLOOR, within))

        def extend_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda connection: lease.extend_on(connection, mine, ttl)

        answer = run_round(self.aliases, ttl, end, extend_on, bool, self.need, wait_all=True)
        held.last = answer
        if len(answer.accepted) >= self.need and time.monotonic() < validity_end:
            with self._mutex:
                held.aliases = frozenset(answer.accepted)
                held.valid_until = validity_end
            return True
        if self._counts(held, answer):
            raise QuorumUnavailable(
                f"could not renew {req.key.name!r} on a majority of databases ({answer.why()})"
            )
        return False

    def owned(self, req: Request) -> bool:
        held = self._holding(req)
        if held is None:
            return False
        held.last = self._ask(req.key, held.token, req.ttl)
        return self._counts(held, held.last)

    def locked(self, alias: str, key: Key) -> bool:
        answer = self._ask(key, None, ROUND_FLOOR)
        if len(answer.accepted) + len(answer.refused) < self.need:
            raise QuorumUnavailable(
                f"could not ask whether {key.name!r} is held: a majority of databases did "
                f"not answer ({answer.why()})"
            )
        return len(answer.accepted) >= self.need

    def _ask(self, key: Key, token: str | None, ttl: float) -> Round:
        params = [key.name] if token is None else [key.name, token]

        def ask_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda c: execute(c, owned_sql(c, token is not None), params)[0] is not None

        end = time.monotonic() + ROUND_FLOOR
        ttl = max(ttl, ROUND_FLOOR)
        return run_round(self.aliases, ttl, end, ask_on, bool, self.need, wait_all=True)

    def loss_reason(self, req: Request) -> str:
        """Why the holding is lost, from the databases' last answer about it.

        Databases that answered "not yours" took it away; databases that did
        not answer may still have the lease (it runs out there on its own).
        """
        held = self._holding(req)
        last = None if held is None else held.last
        if last is None or len(last.refused) >= self.need:
            return "a majority of its databases no longer has its lease"
        return (
            f"a majority of its databases could not be reached ({last.why()}); "
            "its lease there runs out on its own"
        )

    # -- leader elections: what a standby reads ------------------------------------

    def live_rows(self, key: Key) -> tuple[dict[str, LiveRow | None], int]:
        """Each answering database's live lease of ``key`` (``None``: free there),
        and how many databases did not answer.

        Raises:
            QuorumUnavailable: a majority of the databases did not answer.
        """

        def read_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda connection: live_row(connection, key)

        end = time.monotonic() + ROUND_FLOOR
        answer = run_round(
            self.aliases, ROUND_FLOOR, end, read_on, lambda _: True, self.need, wait_all=True
        )
        if len(answer.accepted) < self.need:
            raise QuorumUnavailable(
                f"could not read {key.name!r}: a majority of databases did not answer "
                f"({answer.why()})"
            )
        return answer.accepted, len(self.aliases) - len(answer.accepted)
