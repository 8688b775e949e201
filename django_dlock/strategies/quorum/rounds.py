"""One quorum round: the same operation on every database at once, and what they answered.

:func:`run_round` hands an operation to each database's workers and waits
until a majority has decided (accepted, or refused and failed so that no
majority can accept any more), or until the round's time is up. The
:class:`Round` it returns says which databases accepted (with their
answers), refused, failed (with the error) or stayed silent.

:func:`give_back` undoes what a round took: the leases already taken at
once, those still on their way when their answer arrives.

The quorum's worker threads: a pool per database, each worker with its own connection.

A quorum round sends one statement to every database at once, so each
database alias has a small thread pool (:data:`WORKERS_PER_ALIAS` threads),
and each worker thread a private connection to its database, outside
Django's connection pool. A database that does not answer keeps its
workers busy: at most :data:`MAX_WAITING` more statements wait for them
(the others are refused at once, so the database does not vote in those
rounds), and a statement whose round is over before a worker is free is
dropped, not sent late. A new connection gets a connect timeout from the
time the round may still take, and on PostgreSQL every statement a
``statement_timeout`` and ``lock_timeout`` of the lease's length, so a hung
server frees its worker. A connection that broke is closed and opened again
on its next use.

Async callers run whole rounds on the :func:`coordinator` threads (a round
blocks on its workers). :func:`close_all` stops every thread and closes
every connection; a forked child starts with none.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.exceptions import DatabaseUnavailable
from django_dlock.strategies.connection import execute
from django_dlock.strategies.quorum.aliases import server_identity

__all__ = [
    "MAX_WAITING",
    "MIN_CONNECT_TIMEOUT",
    "MIN_WAIT",
    "Round",
    "WORKERS_PER_ALIAS",
    "close_all",
    "coordinator",
    "give_back",
    "give_back_when_done",
    "run_round",
    "servers",
    "submit",
]


logger = logging.getLogger("django_dlock")

#: the shortest connect timeout (libpq counts whole seconds and treats 1 as 2)
MIN_CONNECT_TIMEOUT = 2
#: worker threads per database (each has its own connection to it)
WORKERS_PER_ALIAS = 4
#: statements that may wait for a database's busy workers; more are refused
MAX_WAITING = WORKERS_PER_ALIAS
#: the least time a statement may wait for a worker before it is dropped
MIN_WAIT = 0.5

_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_coordinators: list[concurrent.futures.ThreadPoolExecutor] = []
_pools_mutex = threading.Lock()
_local = threading.local()
#: every worker connection, for :func:`close_all`
_opened: list[BaseDatabaseWrapper] = []
#: per database, the statements submitted that no worker has started yet
_waiting: dict[str, int] = {}
#: per database alias, what its server said it is when a worker connected
servers: dict[str, tuple[str, ...]] = {}


def submit(
    alias: str, ttl: float, budget: float, op: Callable[[BaseDatabaseWrapper], Any]
) -> concurrent.futures.Future[Any]:
    """Run ``op`` on a worker's connection to ``alias``; its future.

    ``ttl`` bounds each statement (PostgreSQL), ``budget`` a new connection's
    connect timeout (the seconds the round may still take). The future
    fails with :class:`~django_dlock.DatabaseUnavailable` at once when
    :data:`MAX_WAITING` statements already wait for ``alias``'s workers, and
    when no worker was free before ``budget`` (at least :data:`MIN_WAIT`)
    ran out: ``op`` is then not sent.
    """
    with _pools_mutex:
        waiting = _waiting.get(alias, 0)
        if waiting < MAX_WAITING:
            _waiting[alias] = waiting + 1
    if waiting >= MAX_WAITING:
        refused: concurrent.futures.Future[Any] = concurrent.futures.Future()
        refused.set_exception(
            DatabaseUnavailable(
                f"{alias}: not sent, {waiting} earlier statements still wait for an answer"
            )
        )
        return refused
    stale_at = time.monotonic() + max(budget, MIN_WAIT)
    try:
        return _pool(alias).submit(_started, alias, stale_at, ttl, budget, op)
    except RuntimeError:
        # The interpreter is exiting (or close_all() stopped the pool): its
        # workers take no new statement. Run it here, to the end: a lease
        # given back as its late acquire answers is then released before the
        # process exits, instead of being left to run out.
        return _run_here(alias, stale_at, ttl, budget, op)


def _run_here(
    alias: str,
    stale_at: float,
    ttl: float,
    budget: float,
    op: Callable[[BaseDatabaseWrapper], Any],
) -> concurrent.futures.Future[Any]:
    """``op`` run in the calling thread (on its own connection to ``alias``); its future."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    try:
        future.set_result(_started(alias, stale_at, ttl, budget, op))
    except Exception as exc:
        future.set_exception(exc)
    return future


def _started(
    alias: str,
    stale_at: float,
    ttl: float,
    budget: float,
    op: Callable[[BaseDatabaseWrapper], Any],
) -> Any:
    """A worker took a statement: no longer waiting; dropped if its round is over."""
    with _pools_mutex:
        _waiting[alias] -= 1
    if time.monotonic() > stale_at:
        raise DatabaseUnavailable(f"{alias}: not sent, its round was over before a worker was free")
    return _on(alias, ttl, budget, op)


def coordinator() -> concurrent.futures.ThreadPoolExecutor:
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
        _waiting.clear()
        servers.clear()
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
    _waiting.clear()
    servers.clear()
    _pools_mutex = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_after_fork)


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


def _on(alias: str, ttl: float, budget: float, op: Callable[[BaseDatabaseWrapper], Any]) -> Any:
    """Run ``op`` on this worker's connection to ``alias`` (closed if it broke).

    A connection kept from an earlier round may have been ended by the
    server meanwhile (the database restarted or failed over, or
    ``pg_terminate_backend``): when ``op`` fails because that connection
    is dead, it runs once more on a new one, instead of losing the vote,
    or, for a release, leaving the lease to run out. (The lease statements
    are safe to send twice: the same token takes, moves or frees the same
    lease.)
    """
    connection = _connection(alias, budget)
    kept = connection.connection is not None
    try:
        return _run(connection, ttl, op)
    except Exception:
        if not kept or connection.connection is not None:
            raise  # a new connection, or one still usable: the database's own answer
    return _run(_connection(alias, budget), ttl, op)


def _run(
    connection: BaseDatabaseWrapper, ttl: float, op: Callable[[BaseDatabaseWrapper], Any]
) -> Any:
    """``op`` on ``connection``; a connection the failure left unusable is closed."""
    try:
        if connection.connection is None:
            connection.ensure_connection()
            servers[connection.alias] = server_identity(connection)
        _bound_statements(connection, ttl)
        return op(connection)
    except Exception:
        try:
            usable = connection.connection is not None and bool(connection.is_usable())
        except Exception:
            usable = False
        if not usable:
            with contextlib.suppress(Exception):
                connection.close()
            connection.connection = None
        raise


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


logger = logging.getLogger("django_dlock")

#: how a lease is given back on one database's connection
Release = Callable[[BaseDatabaseWrapper], Any]


@dataclasses.dataclass
class Round:
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


def run_round(
    aliases: Sequence[str],
    ttl: float,
    end: float,
    op: Callable[[str], Callable[[BaseDatabaseWrapper], Any]],
    accepts: Callable[[Any], bool],
    need: int,
    wait_all: bool = False,
) -> Round:
    """Send ``op`` to every database at once; return when a majority has decided or at ``end``."""
    budget = max(0.0, end - time.monotonic())
    futures = {alias: submit(alias, ttl, budget, op(alias)) for alias in aliases}
    result = Round(futures)
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


def accepted(future: concurrent.futures.Future[Any]) -> bool:
    """Whether an acquire's answer took the lease (a fencing number came back)."""
    return not future.cancelled() and future.exception() is None and future.result() is not None


def give_back_when_done(
    alias: str, future: concurrent.futures.Future[Any], ttl: float, budget: float, release: Release
) -> None:
    """Give ``alias``'s lease back when its acquire answers, if it took it."""

    def done(answer: concurrent.futures.Future[Any]) -> None:
        if accepted(answer):
            submit(alias, ttl, budget, release)

    future.add_done_callback(done)


def give_back(
    futures: dict[str, concurrent.futures.Future[Any]],
    ttl: float,
    budget: float,
    release: Release,
    wait: float | None = None,
) -> None:
    """Give back what a round without a majority took: the leases already
    taken now, the others on arrival.

    Waits up to ``wait`` seconds (by default ``budget``) for the releases;
    a database that has not answered by then is released in the background
    (its workers go on within ``budget``), so a caller whose time is up is
    not kept by a stalled database.
    """
    taken = []
    for alias, future in futures.items():
        if not future.done():
            give_back_when_done(alias, future, ttl, budget, release)
        elif accepted(future):
            taken.append(alias)
    if not taken:
        return
    started = time.monotonic()
    end = started + (budget if wait is None else min(wait, budget))
    releases = {alias: submit(alias, ttl, budget, release) for alias in taken}
    concurrent.futures.wait(list(releases.values()), timeout=max(0.0, end - started))
    for alias, future in releases.items():
        if not future.done():
            future.add_done_callback(functools.partial(_given_back, alias, ttl))
        else:
            _given_back(alias, ttl, future)


def _given_back(alias: str, ttl: float, future: concurrent.futures.Future[Any]) -> None:
    """Log a lease of a round without a majority that could not be given back."""
    exc = future.exception()
    if exc is not None:
        logger.warning(
            "django-dlock: could not give back a lease of a round without a majority "
            "(%s: %s); it runs out within %g s",
            alias,
            str(exc).strip() or type(exc).__name__,
            ttl,
        )
