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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.core.checks import CheckMessage
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.conf import RetryInterval
from django_dlock.exceptions import QuorumUnavailable, StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline, interval
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import execute
from django_dlock.strategies.lease import TABLE, lease

__all__ = ["LiveRow", "QuorumLease", "quorum_aliases", "quorum_strategy"]

logger = logging.getLogger("django_dlock")

#: Redlock's clock drift allowance: this fraction of the ttl, plus DRIFT_FLOOR
DRIFT_FACTOR = 0.01
DRIFT_FLOOR = 0.002
#: the least time one round waits for answers, also for a single try
ROUND_FLOOR = 1.0
#: the shortest connect timeout (libpq counts whole seconds and treats 1 as 2)
MIN_CONNECT_TIMEOUT = 2
#: worker threads per database (each has its own connection to it)
WORKERS_PER_ALIAS = 4


def majority(count: int) -> int:
    """How many databases out of ``count`` make a majority."""
    return count // 2 + 1


def drift(ttl: float) -> float:
    """Redlock's allowance for clocks that run at different rates."""
    return ttl * DRIFT_FACTOR + DRIFT_FLOOR


# -- validation (before any SQL) ----------------------------------------------


def _server(alias: str) -> tuple[str, str, str, str]:
    settings = connections.settings[alias]
    return (
        str(settings.get("ENGINE", "")),
        str(settings.get("HOST") or "localhost"),
        str(settings.get("PORT") or ""),
        str(settings.get("NAME") or ""),
    )


def same_database(aliases: Sequence[str]) -> list[tuple[str, str]]:
    """Pairs of aliases that name the same database (engine, host, port, name)."""
    seen: dict[tuple[str, str, str, str], str] = {}
    pairs = []
    for alias in aliases:
        server = _server(alias)
        if server in seen:
            pairs.append((seen[server], alias))
        else:
            seen[server] = alias
    return pairs


def quorum_aliases(using: object) -> tuple[str, ...]:
    """The database aliases of ``using=[...]``, checked.

    Raises:
        ValueError: the list is empty, names an alias twice or an unknown
            alias, or two aliases are the same database (a majority of copies
            of one database is no majority).
    """
    if isinstance(using, (str, bytes)) or not isinstance(using, (list, tuple)):
        raise ValueError(f"using must be a database alias or a list of aliases, got {using!r}")
    aliases = tuple(using)
    if not aliases:
        raise ValueError("using=[] names no database: give one alias, or a list of several")
    for alias in aliases:
        if not isinstance(alias, str):
            raise ValueError(f"using lists database aliases (strings), got {alias!r}")
        if alias not in connections:
            raise ValueError(f"unknown database alias {alias!r} in using={list(aliases)!r}")
    duplicates = sorted({alias for alias in aliases if aliases.count(alias) > 1})
    if duplicates:
        raise ValueError(
            f"using={list(aliases)!r} names {', '.join(map(repr, duplicates))} more than "
            "once: each database of a quorum counts once"
        )
    twins = same_database(aliases)
    if twins:
        first, second = twins[0]
        raise ValueError(
            f"using={list(aliases)!r}: {first!r} and {second!r} are the same database "
            "(same ENGINE, HOST, PORT and NAME); a quorum needs independent databases"
        )
    declared.add(aliases)
    return aliases


#: every quorum a lock was created with (the system checks look at them)
declared: set[tuple[str, ...]] = set()


def quorum_problems(databases: Sequence[str]) -> list[CheckMessage]:
    """System check messages for the quorums in use (see ``checks.check_quorums``).

    The quorums are those of ``DLOCK_QUORUMS`` (a list of alias lists) and
    those of every lock created so far with ``using=[...]``. With
    ``databases`` (``check --database``), each of their databases must have
    the lock table.
    """
    from django.conf import settings
    from django.core.checks import Error, Warning

    found: list[CheckMessage] = []
    quorums = [tuple(q) for q in getattr(settings, "DLOCK_QUORUMS", ())] + sorted(declared)
    for aliases in dict.fromkeys(quorums):
        try:
            quorum_aliases(list(aliases))
        except ValueError as exc:
            found.append(
                Error(
                    f"The quorum {list(aliases)!r} is invalid: {exc}.",
                    hint="List distinct aliases of independent databases (each on its own "
                    "server, or at least its own database).",
                    id="dlock.E060",
                )
            )
            continue
        if len(aliases) % 2 == 0:
            found.append(
                Warning(
                    f"The quorum {list(aliases)!r} has an even number of databases: "
                    f"{majority(len(aliases))} of {len(aliases)} are needed, so it survives "
                    f"no more failures than {len(aliases) - 1} databases would.",
                    hint="Use an odd number of databases (3 or 5).",
                    id="dlock.W060",
                )
            )
        for alias in aliases:
            if alias in databases and not _has_lock_table(alias):
                found.append(
                    Error(
                        f"The database {alias!r} of the quorum {list(aliases)!r} has no "
                        "django-dlock lock table.",
                        hint=f"Run `manage.py migrate django_dlock --database {alias}`.",
                        id="dlock.E061",
                    )
                )
    return found


def _has_lock_table(alias: str) -> bool:
    from django.db import DatabaseError

    try:
        with connections[alias].cursor() as cur:
            return TABLE in connections[alias].introspection.table_names(cur)
    except DatabaseError:
        return True  # unreachable: Django's own checks say so


_strategies: dict[tuple[tuple[str, ...], float | None], QuorumLease] = {}


def quorum_strategy(
    name: str, aliases: tuple[str, ...], min_hold: float | None = None
) -> QuorumLease:
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
    found = _strategies.get((aliases, min_hold))
    if found is None:
        found = _strategies[(aliases, min_hold)] = QuorumLease(aliases, min_hold)
    return found


# -- one worker pool and private connections per database -------------------------

_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pools_mutex = threading.Lock()
_local = threading.local()


def _pool(alias: str) -> concurrent.futures.ThreadPoolExecutor:
    found = _pools.get(alias)
    if found is None:
        with _pools_mutex:
            found = _pools.get(alias)
            if found is None:
                found = _pools[alias] = concurrent.futures.ThreadPoolExecutor(
                    WORKERS_PER_ALIAS, thread_name_prefix=f"django-dlock-quorum-{alias}"
                )
    return found


#: every worker connection, for :func:`close_all`
_opened: list[BaseDatabaseWrapper] = []


def close_all() -> None:
    """Stop the worker threads and close their connections (tests, shutdown).

    Workers and connections are made again on the next use.
    """
    with _pools_mutex:
        pools = list(_pools.values()) + list(_coordinators)
        _pools.clear()
        _coordinators.clear()
    for pool in pools:
        pool.shutdown(wait=True)
    with _pools_mutex:
        opened = list(_opened)
        _opened.clear()
    for connection in opened:
        raw = connection.connection
        if raw is not None:
            try:
                raw.close()
            except Exception:
                logger.debug("django-dlock: closing a quorum connection failed", exc_info=True)
            connection.connection = None


def _forget_pools_after_fork() -> None:
    global _pools_mutex
    _pools.clear()
    _coordinators.clear()
    _opened.clear()
    _pools_mutex = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


def _connection(alias: str, budget: float) -> BaseDatabaseWrapper:
    """This worker thread's own connection to ``alias``, outside Django's pool.

    A connection that is not open yet gets a connect timeout from ``budget``
    (the seconds the round may still take).
    """
    cache: dict[str, BaseDatabaseWrapper] | None = getattr(_local, "connections", None)
    if cache is None:
        cache = _local.connections = {}
    connection = cache.get(alias)
    if connection is None:
        connection = cache[alias] = connections[alias].copy(alias)
        connection.settings_dict.setdefault("OPTIONS", {}).pop("pool", None)
        with _pools_mutex:
            _opened.append(connection)
    if connection.connection is None and connection.vendor in ("postgresql", "mysql"):
        seconds = max(MIN_CONNECT_TIMEOUT, math.ceil(budget))
        connection.settings_dict["OPTIONS"]["connect_timeout"] = seconds
        connection.dlock_statement_ms = None  # type: ignore[attr-defined]
    return connection


def _bound_statements(connection: BaseDatabaseWrapper, ttl: float) -> None:
    """No statement of this connection runs (or waits for a row lock) longer than ``ttl``."""
    if connection.vendor != "postgresql":
        return
    millis = max(1, math.ceil(ttl * 1000))
    if getattr(connection, "dlock_statement_ms", None) == millis:
        return
    execute(
        connection,
        "SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
        [f"{millis}ms", f"{millis}ms"],
    )
    connection.dlock_statement_ms = millis  # type: ignore[attr-defined]


def _on(alias: str, ttl: float, budget: float, op: Callable[[BaseDatabaseWrapper], Any]) -> Any:
    """Run ``op`` on this worker's connection to ``alias`` (closed if it broke)."""
    connection = _connection(alias, budget)
    try:
        connection.ensure_connection()
        _bound_statements(connection, ttl)
        return op(connection)
    except Exception:
        try:
            usable = connection.connection is not None and bool(connection.is_usable())
        except Exception:
            usable = False
        if not usable:
            try:
                connection.close()
            except Exception:
                connection.connection = None
        raise


@dataclasses.dataclass
class _Round:
    """What each database answered in one round (``None``: no answer in time)."""

    futures: dict[str, concurrent.futures.Future[Any]]
    accepted: dict[str, Any] = dataclasses.field(default_factory=dict)
    refused: set[str] = dataclasses.field(default_factory=set)
    failed: dict[str, BaseException] = dataclasses.field(default_factory=dict)
    #: the round's time ran out (the silent databases count as down)
    timed_out: bool = False

    @property
    def silent(self) -> set[str]:
        return set(self.futures) - set(self.accepted) - self.refused - set(self.failed)

    def unreachable(self) -> list[str]:
        return sorted(set(self.failed) | self.silent)

    def why(self) -> str:
        parts = [
            f"{alias}: {str(exc).strip() or type(exc).__name__}"
            for alias, exc in sorted(self.failed.items())
        ]
        parts += [f"{alias}: no answer in time" for alias in sorted(self.silent)]
        return "; ".join(parts)


def _run_round(
    aliases: Sequence[str],
    ttl: float,
    end: float,
    op: Callable[[str], Callable[[BaseDatabaseWrapper], Any]],
    accepts: Callable[[Any], bool],
    need: int,
    wait_all: bool = False,
) -> _Round:
    """Send ``op`` to every database at once; return when a majority has decided or at ``end``."""
    budget = max(0.0, end - time.monotonic())
    futures = {alias: _pool(alias).submit(_on, alias, ttl, budget, op(alias)) for alias in aliases}
    result = _Round(futures)
    pending = set(futures.values())
    by_future = {future: alias for alias, future in futures.items()}
    while pending:
        done, pending = concurrent.futures.wait(
            pending,
            timeout=max(0.0, end - time.monotonic()),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        for future in done:
            alias = by_future[future]
            exc = future.exception()
            if exc is not None:
                result.failed[alias] = exc
            elif accepts(future.result()):
                result.accepted[alias] = future.result()
            else:
                result.refused.add(alias)
        decided = len(result.accepted) >= need or (
            len(result.refused) + len(result.failed) > len(aliases) - need
        )
        if decided and not wait_all:
            break
        if not done:  # the round's time is up
            result.timed_out = True
            break
    return result


def _fence_raise_sql(connection: BaseDatabaseWrapper) -> str:
    now = dbclock.now_sql(connection)
    biggest = "MAX" if connection.vendor == "sqlite" else "GREATEST"
    return (
        f"UPDATE {TABLE} SET fence = {biggest}(fence, %s) "
        f"WHERE name = %s AND token = %s AND expire_at > {now}"
    )


def _owned_sql(connection: BaseDatabaseWrapper, mine: bool) -> str:
    now = dbclock.now_sql(connection)
    token = " AND token = %s" if mine else ""
    return f"SELECT 1 FROM {TABLE} WHERE name = %s{token} AND expire_at > {now}"


@dataclasses.dataclass
class _Held:
    """One quorum holding: its stored token, the databases that hold it, until when."""

    token: str
    aliases: frozenset[str]
    valid_until: float
    #: the acquire of each database (some may still run when the lock is granted)
    first: dict[str, concurrent.futures.Future[Any]]


class QuorumLease:
    """The ``lease`` strategy on a majority of ``aliases`` (see the module docstring).

    Implements the strategy protocol of :mod:`django_dlock.strategies.base`.
    """

    name = "lease"
    transaction_scoped = False

    def __init__(self, aliases: tuple[str, ...], min_hold: float | None = None) -> None:
        self.aliases = aliases
        self.need = majority(len(aliases))
        self.min_hold = min_hold
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
        attempt = 0
        while True:
            outcome = self.attempt(req, deadline)
            if isinstance(outcome, Grant):
                return outcome
            if deadline.expired():
                return self._gave_up(req, outcome)
            time.sleep(min(interval(policy, attempt), deadline.remaining()))
            attempt += 1

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        attempt = 0
        while True:
            outcome = await self._aattempt(req, deadline)
            if isinstance(outcome, Grant):
                return outcome
            if deadline.expired():
                return self._gave_up(req, outcome)
            await asyncio.sleep(min(interval(policy, attempt), deadline.remaining()))
            attempt += 1

    async def _aattempt(self, req: Request, deadline: Deadline) -> Grant | _Round:
        """One round in a worker thread; a grant that comes too late is given back."""
        future = _coordinator().submit(self.attempt, req, deadline)
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

    def _gave_up(self, req: Request, last: Grant | _Round) -> Grant | None:
        assert isinstance(last, _Round)
        down = len(last.failed) + (len(last.silent) if last.timed_out else 0)
        answered = len(self.aliases) - down
        if answered < self.need:
            raise QuorumUnavailable(
                f"could not acquire {req.key.name!r}: only {answered} of "
                f"{len(self.aliases)} databases answered, {self.need} are needed "
                f"({last.why()})"
            )
        return None

    def attempt(self, req: Request, deadline: Deadline) -> Grant | _Round:
        """One round: a grant, or what the databases said."""
        started = time.monotonic()
        validity_end = started + req.ttl - drift(req.ttl)
        end = min(validity_end, max(deadline.end, started + ROUND_FLOOR))
        token = f"{req.token}#{secrets.token_hex(4)}"
        mine = dataclasses.replace(req, token=token)

        def acquire_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda connection: lease._acquire_on(connection, mine, None)

        first = _run_round(
            self.aliases, req.ttl, end, acquire_on, lambda fence: fence is not None, self.need
        )
        raised: set[str] = set()
        fence = 0
        if len(first.accepted) >= self.need:
            fence = max(int(f) for f in first.accepted.values())
            raised = {alias for alias, f in first.accepted.items() if f == fence}
            lower = [alias for alias in first.accepted if alias not in raised]
            if lower and len(raised) < self.need:
                raised |= self._raise_fences(lower, mine, fence, validity_end)
        if len(raised) >= self.need and time.monotonic() < validity_end:
            with self._mutex:
                self._held[(req.token, req.key.name)] = _Held(
                    token, frozenset(raised), validity_end, first.futures
                )
            return Grant(fence)
        self._release_round(mine, first.futures)
        return first

    def _raise_fences(
        self, aliases: list[str], mine: Request, fence: int, validity_end: float
    ) -> set[str]:
        """Raise the row of each database in ``aliases`` to ``fence``; where it worked."""

        def raise_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            def run(connection: BaseDatabaseWrapper) -> int:
                sql = _fence_raise_sql(connection)
                return int(execute(connection, sql, [fence, mine.key.name, mine.token])[1])

            return run

        done = _run_round(
            aliases, mine.ttl, validity_end, raise_on, lambda rows: rows > 0, 1, wait_all=True
        )
        return set(done.accepted)

    def _release_round(
        self, mine: Request, futures: dict[str, concurrent.futures.Future[Any]]
    ) -> None:
        """Give back a failed round's leases, also those accepted after we stopped waiting."""
        for alias, future in futures.items():
            future.add_done_callback(functools.partial(self._give_back_on, alias, mine))

    def _give_back_on(
        self, alias: str, mine: Request, done: concurrent.futures.Future[Any]
    ) -> None:
        if done.cancelled() or done.exception() is not None or done.result() is None:
            return
        _pool(alias).submit(_on, alias, mine.ttl, ROUND_FLOOR, lambda c: lease._release_on(c, mine))

    def try_acquire(self, req: Request) -> int | None:
        grant = self.acquire(req, Deadline(0), 0.0)
        return None if grant is None else grant.fence

    # -- release, extend, inspect ------------------------------------------------

    def _holding(self, req: Request) -> _Held | None:
        with self._mutex:
            return self._held.get((req.token, req.key.name))

    def _counts(self, held: _Held, answer: _Round) -> bool:
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
            min_hold = self.min_hold
            if min_hold is not None:
                return lambda connection: _release_after_on(connection, mine, min_hold)
            return lambda connection: lease._release_on(connection, mine)

        # A database whose acquire is still running is released when it ends.
        late = [alias for alias, future in held.first.items() if not future.done()]
        for alias in late:
            give_back = functools.partial(self._give_back_on, alias, mine)
            held.first[alias].add_done_callback(give_back)
        answering = [alias for alias in self.aliases if alias not in late]
        # Done when a majority has released: the others finish in the background.
        answer = _run_round(answering, req.ttl, end, release_on, bool, self.need)
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
            return lambda connection: lease._extend_on(connection, mine, ttl)

        answer = _run_round(self.aliases, ttl, end, extend_on, bool, self.need, wait_all=True)
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
        return self._counts(held, self._ask(req.key, held.token, req.ttl))

    def locked(self, alias: str, key: Key) -> bool:
        answer = self._ask(key, None, ROUND_FLOOR)
        if len(answer.accepted) + len(answer.refused) < self.need:
            raise QuorumUnavailable(
                f"could not ask whether {key.name!r} is held: a majority of databases did "
                f"not answer ({answer.why()})"
            )
        return len(answer.accepted) >= self.need

    def _ask(self, key: Key, token: str | None, ttl: float) -> _Round:
        params = [key.name] if token is None else [key.name, token]

        def ask_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            return lambda c: execute(c, _owned_sql(c, token is not None), params)[0] is not None

        end = time.monotonic() + ROUND_FLOOR
        ttl = max(ttl, ROUND_FLOOR)
        return _run_round(self.aliases, ttl, end, ask_on, bool, self.need, wait_all=True)

    def loss_reason(self, req: Request) -> str:
        return "a majority of its databases no longer has its lease"

    # -- leader elections: what a standby reads ------------------------------------

    def live_rows(self, key: Key) -> tuple[dict[str, LiveRow | None], int]:
        """Each answering database's live lease of ``key`` (``None``: free there),
        and how many databases did not answer.

        Raises:
            QuorumUnavailable: a majority of the databases did not answer.
        """

        def read_on(alias: str) -> Callable[[BaseDatabaseWrapper], Any]:
            def run(connection: BaseDatabaseWrapper) -> LiveRow | None:
                left = dbclock.seconds_until_sql(connection, "expire_at")
                sql = (
                    f"SELECT owner, fence, acquired_at, expire_at, {left} FROM {TABLE} "
                    f"WHERE name = %s AND token <> '' AND expire_at > {dbclock.now_sql(connection)}"
                )
                found = execute(connection, sql, [key.name])[0]
                if found is None:
                    return None
                owner, fence, since, expires, seconds = found
                return LiveRow(str(owner), int(fence), since, expires, float(seconds))

            return run

        end = time.monotonic() + ROUND_FLOOR
        answer = _run_round(
            self.aliases, ROUND_FLOOR, end, read_on, lambda _: True, self.need, wait_all=True
        )
        if len(answer.accepted) < self.need:
            raise QuorumUnavailable(
                f"could not read {key.name!r}: a majority of databases did not answer "
                f"({answer.why()})"
            )
        return answer.accepted, len(self.aliases) - len(answer.accepted)


@dataclasses.dataclass(frozen=True)
class LiveRow:
    """One database's live lease of a key, as :meth:`QuorumLease.live_rows` reads it."""

    owner: str
    fence: int
    since: Any
    expires: Any
    #: seconds until it ends, on that database's clock
    left: float


def _release_after_on(connection: BaseDatabaseWrapper, req: Request, min_hold: float) -> bool:
    """TaskLock's release on one database: keep the lease until ``acquired_at + min_hold``."""
    # lease.release_after runs on the thread's lock connection: in a worker
    # thread of ours that is the worker's own Django connection.
    return lease.release_after(dataclasses.replace(req, alias=connection.alias), min_hold)


_coordinators: list[concurrent.futures.ThreadPoolExecutor] = []


def _coordinator() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that run async callers' rounds (the rounds block on their workers)."""
    if not _coordinators:
        with _pools_mutex:
            if not _coordinators:
                _coordinators.append(
                    concurrent.futures.ThreadPoolExecutor(
                        8, thread_name_prefix="django-dlock-quorum-round"
                    )
                )
    return _coordinators[0]
