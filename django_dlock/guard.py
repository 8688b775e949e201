"""``Lock.guard()``: writes that commit only while the lock is held.

A holder can be paused (a long GC, a frozen VM, SIGSTOP) past its lease and
resume after another holder took the lock over. Whatever it then writes
races the new holder's writes: the classic hole of lease locks (Martin
Kleppmann, "How to do distributed locking",
https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).
Our locks live in the same database as the data they protect, so the
writes and the check can be one transaction:

* a ``lease`` lock is checked at the end of the guarded block, in the
  block's own transaction: the lease row must still carry the holder's
  token and be unexpired on the database clock, and it is locked there
  (``FOR SHARE`` on PostgreSQL, ``LOCK IN SHARE MODE`` on MySQL/MariaDB, a
  write on SQLite) until the transaction ends, so nobody can take the lease
  over before the writes commit. A lease found lost rolls the block back
  and raises :class:`~django_dlock.LockLost`;
* ``row`` and ``advisory_xact`` locks already live in the caller's
  transaction: the guarded block is a savepoint in it, and everything
  commits together, while the lock is held;
* ``advisory`` session locks and quorum locks live elsewhere than the
  transaction (their own session, several databases): they refuse a guard
  (:class:`~django_dlock.GuardNotSupported`); fencing is their tool.

A holder frozen inside its guarded transaction must not keep the key
forever: on PostgreSQL the transaction gets an
``idle_in_transaction_session_timeout`` of the lease's length, on
MySQL/MariaDB the session a ``wait_timeout`` of it (rounded up to a
second), so the server ends a session that stays silent that long inside
the block, and its transaction rolls back. SQLite has no server to do it:
a process frozen inside a guarded transaction keeps every writer of that
database file waiting until it resumes or dies.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import select
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import DatabaseError, Error, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import holdings
from django_dlock.exceptions import GuardNotSupported, LockLost
from django_dlock.holdings import Holding
from django_dlock.strategies.base import Guards, Request, guards
from django_dlock.strategies.connection import numbered

__all__ = ["guarded", "pinned", "same_database"]


@contextlib.contextmanager
def guarded(held: Sequence[Holding], using: str | None) -> Iterator[None]:
    """A transaction on ``using`` (default: the lock's database) that commits
    only while every holding in ``held`` (the holder's, one per key) is held."""
    first = held[0]
    strategy, alias = first.strategy, first.request.alias
    names = _names(held)
    using = same_database(names, alias, using)
    for holding in held:
        if holding.lost or strategy.ended(holding.request):
            raise holding.error() if holding.lost else _ended(holding)
    if strategy.transaction_scoped:
        # The lock is held by this very transaction: it ends with it.
        with transaction.atomic(using=using):
            yield
        return
    if not guards(strategy):
        raise GuardNotSupported(
            f"{names} uses the {strategy.name} strategy, whose lock is not kept "
            "by a database transaction (an advisory session lock lives on a session of "
            "its own, a quorum lock on several databases): nothing can make a write "
            "commit only while it is held. Pass the lock's fence to the writes and "
            "reject stale ones (see Fencing in the django-dlock docs), or use the "
            "lease strategy"
        )
    by_request = {id(holding.request): holding for holding in held}

    def lost(req: Request) -> str:
        holding = by_request[id(req)]
        reason = "it was no longer held when the guarded writes were to commit"
        holding.mark_lost(holding.loss_reason(reason))
        return holding.lost_reason

    def ended() -> None:
        for holding in held:  # the lease may still be ours: only the database knows
            holdings.confirm(holding)

    with pinned(strategy, [holding.request for holding in held], names, lost, ended):
        yield


@contextlib.contextmanager
def pinned(
    strategy: Guards,
    reqs: Sequence[Request],
    names: str,
    lost: Callable[[Request], str],
    ended: Callable[[], None],
) -> Iterator[None]:
    """A transaction on the database of ``reqs`` that commits only while
    ``strategy`` finds every one still the caller's, checked before it commits.

    ``lost(req)`` records that ``req``'s holding is lost and says why;
    ``ended()`` is called when the server ended the transaction's session.
    """
    using = reqs[0].alias
    connection = connections[using]
    # PostgreSQL on psycopg 3, a transaction of the guard's own: the bound
    # goes with BEGIN and the check with COMMIT, no round trip of their own
    merged = len(reqs) == 1 and _merges(connection)
    try:
        with transaction.atomic(using=using), _bounded(connection, reqs[0].ttl, merged):
            yield
            if connection.needs_rollback:
                return  # the block asked for a rollback: nothing will commit
            if merged and _pinned_at_commit(connection, strategy, reqs[0]):
                return
            for req in reqs:
                if not strategy.pin(connection, req):
                    raise LockLost(
                        f"the guarded writes under {names} were rolled back: "
                        f"{req.key.name!r} was lost ({lost(req)})"
                    )
    except _Lost as exc:
        req = exc.args[0]
        raise LockLost(
            f"the guarded writes under {names} were rolled back: "
            f"{req.key.name!r} was lost ({lost(req)})"
        ) from None
    except DatabaseError as exc:
        if not _session_ended(connection, exc):
            raise
        # The server ended the session: it stayed silent inside the guarded
        # transaction for as long as the lease lasts (see _bounded), or it was
        # terminated; the transaction rolled back.
        connection.close()
        ended()
        raise LockLost(
            f"the guarded writes under {names} were rolled back: "
            f"{_why_ended(connection, exc, reqs[0].ttl)}"
        ) from exc


def same_database(names: str, alias: str, using: str | None) -> str:
    if using is None or using == alias:
        return alias
    raise GuardNotSupported(
        f"{names} is held on the database {alias!r}: a guard checks it in the "
        f"transaction of its writes, so they must go to {alias!r}, not {using!r}. For "
        "data on another database, pass the lock's fence along and check it there "
        "(see Safe writes and Fencing in the django-dlock docs)"
    )


def _session_ended(connection: BaseDatabaseWrapper, exc: BaseException) -> bool:
    """Whether ``exc`` says the server ended the session (its idle timeout)."""
    if connection.vendor == "postgresql":
        from django_dlock.strategies._pg import sqlstate

        # idle in transaction too long, or the session terminated
        return sqlstate(exc) in ("25P03", "57P01")
    if connection.vendor == "mysql":
        code = getattr(exc.__cause__, "args", (None,))[0]
        # gone away, lost the connection, disconnected for inactivity (MySQL 8)
        return code in (2006, 2013, 4031)
    return False


def _why_ended(connection: BaseDatabaseWrapper, exc: BaseException, ttl: float) -> str:
    """How the server ended the session of a guarded transaction, in words."""
    idle = (
        "the server ended the session of their transaction, which stayed silent inside "
        f"it for longer than the lease ({ttl:g} s)"
    )
    if connection.vendor == "postgresql":
        from django_dlock.strategies._pg import sqlstate

        if sqlstate(exc) == "25P03":
            return idle
        return (
            "the session of their transaction was ended by the server (terminated by an "
            "administrator, e.g. pg_terminate_backend, or the server shut down)"
        )
    code = getattr(exc.__cause__, "args", (None,))[0]
    if code == 4031:
        return idle
    return (
        "the session of their transaction was ended: it was killed (KILL), the connection "
        "to the server was lost, or it stayed silent for longer than the lease "
        f"({ttl:g} s) and the server closed it"
    )


@contextlib.contextmanager
def _bounded(connection: BaseDatabaseWrapper, seconds: float, merged: bool) -> Iterator[None]:
    """End the session if it stays idle ``seconds`` inside the transaction.

    ``merged`` (see :func:`_merges`): the bound is sent with the BEGIN of the
    transaction, in one round trip.
    """
    vendor = connection.vendor
    if vendor == "postgresql":
        ms = max(1, math.ceil(seconds * 1000))
        bound = f"SET LOCAL idle_in_transaction_session_timeout = {ms}"
        if merged:
            _begin_with(connection, bound)
        else:
            with connection.cursor() as cur:
                cur.execute(bound)
        yield
        return
    if vendor != "mysql":
        yield
        return
    with connection.cursor() as cur:
        cur.execute(
            "SET @dlock_wait_timeout = @@SESSION.wait_timeout, "
            f"SESSION wait_timeout = {max(1, math.ceil(seconds))}"
        )
    try:
        yield
    finally:
        if connection.connection is not None:
            # a session the server ended is closed by Django at the failed
            # statement; any other failure here is the session's, not the guard's
            with contextlib.suppress(Error), connection.cursor() as cur:
                cur.execute("SET SESSION wait_timeout = @dlock_wait_timeout")


# -- PostgreSQL: the guard's statements ride on BEGIN and COMMIT ---------------------------


class _Lost(Exception):
    """The merged check found the holding lost (carries its request)."""


def _merges(connection: BaseDatabaseWrapper) -> bool:
    """Whether the guard may send its bound with BEGIN and its check with
    COMMIT: PostgreSQL on psycopg 3 with a libpq that has pipeline mode
    (14 and later), and the guard opens the transaction (it is not inside
    another ``atomic`` block, whose commit is not the guard's)."""
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return False
    from django_dlock.strategies.connection import psycopg3

    if not psycopg3():
        return False
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def _begin_with(connection: BaseDatabaseWrapper, statement: str) -> None:
    """Open the transaction Django's ``atomic`` just asked for, and run
    ``statement`` in it, in one round trip (psycopg would send BEGIN alone)."""
    import psycopg
    from psycopg import pq

    raw = connection.connection
    if raw.pgconn.transaction_status != pq.TransactionStatus.IDLE:
        with connection.cursor() as cur:  # already open: nothing to merge
            cur.execute(statement)
        return
    begin = ["BEGIN"]  # what psycopg would send, from its public settings
    if raw.isolation_level is not None:
        begin.append("ISOLATION LEVEL " + raw.isolation_level.name.replace("_", " "))
    if raw.read_only is not None:
        begin.append("READ ONLY" if raw.read_only else "READ WRITE")
    if raw.deferrable is not None:
        begin.append("DEFERRABLE" if raw.deferrable else "NOT DEFERRABLE")
    sql = f"{' '.join(begin)}; {statement}".encode()
    with connection.wrap_database_errors, raw.lock:
        result = raw.pgconn.exec_(sql)
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise psycopg.errors.error_from_result(result, encoding=raw.info.encoding)


#: a step of the check's pipeline: ("query", sql, params), ("prepare", name, sql)
#: or ("execute", name, params)
_Step = tuple[str, bytes, Any]

#: the names of the check statements prepared on each psycopg connection
_PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


def _pipeline(pgconn: Any, steps: Sequence[_Step]) -> list[Any]:
    """Send ``steps`` in libpq's pipeline mode, then a sync point: one round
    trip. The result of each step (``None`` where none came: the connection
    broke)."""
    from psycopg import pq

    pgconn.enter_pipeline_mode()
    try:
        for kind, first, second in steps:
            if kind == "query":
                pgconn.send_query_params(first, second)
            elif kind == "prepare":
                pgconn.send_prepare(first, second)
            else:
                pgconn.send_query_prepared(first, second)
        pgconn.pipeline_sync()
        results: list[Any] = []
        for _ in steps:
            found = None
            while (result := _next_result(pgconn)) is not None:
                found = result
            results.append(found)
            if pgconn.status == pq.ConnStatus.BAD:
                return results + [None] * (len(steps) - len(results))
        _next_result(pgconn)  # the sync point
        return results
    finally:
        with contextlib.suppress(Exception):  # (a closed connection has no mode)
            pgconn.exit_pipeline_mode()


def _next_result(pgconn: Any) -> Any:
    """libpq's next result, waited for with the GIL released (libpq's own
    blocking wait keeps it: another thread of the process, perhaps the one
    whose lock the check waits for, could not run meanwhile)."""
    import psycopg
    from psycopg import pq

    while pgconn.is_busy() and pgconn.status != pq.ConnStatus.BAD:
        select.select([pgconn.socket], [], [])
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            break  # the connection broke: the results say what came before
    return pgconn.get_result()


@functools.lru_cache(maxsize=64)
def _check_statement(query: str) -> tuple[bytes, bytes]:
    """The check of :func:`_pinned_at_commit` for a pin ``query`` (``%s``
    parameters, numbered for libpq), and the name it is prepared under."""
    encoded = numbered(f"SELECT 1 / coalesce(({query}), 0)").sql
    return encoded, b"dlock_check_" + hashlib.sha1(encoded).hexdigest()[:16].encode()


def _pinned_at_commit(connection: BaseDatabaseWrapper, strategy: Guards, req: Request) -> bool:
    """Check ``req``'s holding and COMMIT in one round trip; ``False`` when
    the transaction cannot be committed here (Django will roll it back, or
    raise why), so the caller checks the usual way.

    The check and COMMIT go out together in libpq's pipeline mode; the check
    divides by what the pin finds, so nothing (the lease is lost) is a
    division by zero, which aborts the transaction: the server skips the
    COMMIT. It runs both without waiting for the client, so a holder frozen
    at this point never keeps the lease row locked.

    Where the lock statements are prepared (a direct connection, see
    :func:`~django_dlock.strategies.connection.execute`) the check is too,
    once per session, inside a savepoint: psycopg deallocates a connection's
    prepared statements after a rollback, and a check whose statement has
    gone rolls back to the savepoint and prepares it again (one more round
    trip) instead of aborting the transaction it guards.
    """
    from psycopg import pq

    from django_dlock.strategies.connection import may_prepare

    raw = connection.connection
    pgconn = raw.pgconn
    if pgconn.transaction_status != pq.TransactionStatus.INTRANS:
        return False  # a failed statement: Django rolls back, the usual check says why
    query, params = strategy.pin_query(connection, req)
    sql, name = _check_statement(query)
    values: list[bytes | None] = [str(value).encode() for value in params]
    commit: _Step = ("query", b"COMMIT", None)
    with connection.wrap_database_errors, raw.lock:
        if not may_prepare(connection):
            _commit_results(raw, req, _pipeline(pgconn, [("query", sql, values), commit]))
            return True
        prepared = _PREPARED.setdefault(raw, set())
        run: _Step = ("execute", name, values)
        steps: list[_Step] = [("query", b"SAVEPOINT dlock_check", None)]
        if name not in prepared:
            steps.append(("prepare", name, sql))
        steps += [run, ("query", b"RELEASE SAVEPOINT dlock_check", None), commit]
        results = _pipeline(pgconn, steps)
        first_error = next((code for r in results if (code := _sqlstate_of(r))), None)
        if first_error in ("26000", "42P05"):
            # gone (26000) or already there (42P05), not as this connection
            # remembered: back to the savepoint, and the check as it is now
            retry: list[_Step] = [("query", b"ROLLBACK TO SAVEPOINT dlock_check", None)]
            if first_error == "26000":
                retry.append(("prepare", name, sql))
            results = _pipeline(pgconn, [*retry, run, commit])
            prepared.add(name)
        elif name not in prepared and _ok(results[1]):
            prepared.add(name)  # (it stays on the session whatever the transaction does)
        _commit_results(raw, req, results)
    return True


def _ok(result: Any) -> bool:
    from psycopg import pq

    return result is not None and result.status in (
        pq.ExecStatus.COMMAND_OK,
        pq.ExecStatus.TUPLES_OK,
    )


def _sqlstate_of(result: Any) -> str | None:
    from psycopg import pq

    if result is None or result.status != pq.ExecStatus.FATAL_ERROR:
        return None
    code = result.error_field(pq.DiagnosticField.SQLSTATE)
    return None if code is None else code.decode()


def _commit_results(raw: Any, req: Request, results: list[Any]) -> None:
    """Raise what the check's pipeline says went wrong (the first error)."""
    import psycopg
    from psycopg import pq

    for result in results:
        if result is None:
            raise psycopg.OperationalError("the connection was lost at commit")
        if result.status == pq.ExecStatus.FATAL_ERROR:
            failed = psycopg.errors.error_from_result(result, encoding=raw.info.encoding)
            if _sqlstate_of(result) == "22012":  # no row: not ours any more
                raise _Lost(req) from failed
            raise failed


def _ended(holding: Holding) -> LockLost:
    holding.mark_lost("its transaction ended")
    return holding.error()


def _names(held: Sequence[Holding]) -> str:
    return repr(", ".join(holding.name for holding in held))
