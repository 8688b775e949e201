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

When the session of the guarded transaction ends, the guard says what
became of the writes, never with a bare driver error (chained as the
cause): :class:`~django_dlock.LockLost` when they were rolled back
(:class:`~django_dlock.DatabaseUnavailable` when the database could not be
asked afterwards whether the lock is still held), nothing when their COMMIT
was answered (the session ended after it), and
:class:`~django_dlock.CommitOutcomeUnknown` when the connection broke with
the COMMIT in flight. A session found gone when the guard's own transaction
begins is replaced, once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import select
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import DatabaseError, Error, OperationalError, connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import holdings
from django_dlock.exceptions import (
    CommitOutcomeUnknown,
    DatabaseUnavailable,
    GuardNotSupported,
    LockLost,
)
from django_dlock.holdings import Holding
from django_dlock.strategies.base import Guards, Request, guards
from django_dlock.strategies.connection import numbered, unreachable

__all__ = ["guarded", "pinned", "same_database"]

logger = logging.getLogger("django.db.backends.base")  # (where Django logs on_commit errors)


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
        try:
            with transaction.atomic(using=using):
                yield
        except DatabaseError as exc:
            if not _session_ended(connections[using], exc):
                raise
            for holding in held:
                holding.mark_lost("its transaction ended with its session")
            raise LockLost(
                "the guarded writes under "
                f"{names} were rolled back: {_why_ended(connections[using], exc)}, "
                "and the lock held by their transaction ended with it"
            ) from exc
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
    own = not connection.in_atomic_block  # (else a savepoint of the caller's transaction)
    #: the block's writes are being committed (an error now may leave them
    #: committed or not)
    committing = False
    #: on_commit callbacks of a transaction committed on a connection that
    #: broke right after: run here, as Django would have
    hooks: list[Any] | None = None
    try:
        with _begun(connection, using, reqs[0].ttl, merged, own):
            yield
            if connection.needs_rollback:
                return  # the block asked for a rollback: nothing will commit
            committing = own
            if merged and _pinned_at_commit(connection, strategy, reqs[0]):
                if _broken(connection):  # committed, and then the session ended
                    hooks = _forget_committed(connection)
            else:
                committing = False
                for req in reqs:
                    if not strategy.pin(connection, req):
                        raise LockLost(
                            f"the guarded writes under {names} were rolled back: "
                            f"{req.key.name!r} was lost ({lost(req)})"
                        )
                committing = own
    except _Lost as exc:
        req = exc.args[0]
        raise LockLost(
            f"the guarded writes under {names} were rolled back: "
            f"{req.key.name!r} was lost ({lost(req)})"
        ) from None
    except _Unknown as exc:
        raise _unknown(names) from exc.__cause__
    except DatabaseError as exc:
        if committing and _unanswered(connection, exc):
            raise _unknown(names) from exc
        if not _session_ended(connection, exc):
            raise
        # The server ended the session (it stayed silent inside the guarded
        # transaction for as long as the lease lasts, see _bounded; an
        # administrator; a restart) or the connection broke before the
        # COMMIT went out: the transaction rolled back.
        connection.close()
        why = _why_ended(connection, exc, reqs[0].ttl)
        try:
            ended()
        except DatabaseUnavailable as unavailable:
            raise DatabaseUnavailable(
                f"the guarded writes under {names} were rolled back: {why}; whether "
                f"the lock is still held could not be asked ({unavailable})"
            ) from exc
        raise LockLost(f"the guarded writes under {names} were rolled back: {why}") from exc
    if hooks:
        _run_hooks(hooks)


@contextlib.contextmanager
def _begun(
    connection: BaseDatabaseWrapper, using: str, ttl: float, merged: bool, own: bool
) -> Iterator[None]:
    """The guarded transaction (a savepoint inside the caller's), bounded by
    :func:`_bounded`.

    A transaction of the guard's own (``own``) whose first statement finds
    the session gone (ended by the server while the connection sat idle)
    begins once more on a new connection: nothing was sent in it yet.
    """
    for attempt in (1, 2):
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(transaction.atomic(using=using))
            stack.enter_context(_bounded(connection, ttl, merged))
        except DatabaseError as exc:
            retry = own and attempt == 1 and _session_ended(connection, exc)
            try:
                stack.__exit__(type(exc), exc, exc.__traceback__)  # (Django rolls back)
            except DatabaseError:
                if not retry:
                    raise
            if not retry:
                raise
            connection.close()
            continue
        break
    with stack:
        yield


def _broken(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection``'s psycopg connection is no longer usable (the
    session ended, or it was left in pipeline mode)."""
    from psycopg import pq

    pgconn = connection.connection.pgconn
    return bool(pgconn.status != pq.ConnStatus.OK or pgconn.pipeline_status)


def _forget_committed(connection: BaseDatabaseWrapper) -> list[Any]:
    """Close ``connection``, whose transaction has committed and whose
    session then broke, so that Django's ``atomic`` does not commit again
    (which would fail); its ``on_commit`` callbacks, which closing drops,
    for :func:`_run_hooks`."""
    hooks = list(connection.run_on_commit)
    connection.close()  # (inside the atomic block: Django ends it without a COMMIT)
    return hooks


def _run_hooks(hooks: list[Any]) -> None:
    """Run the ``on_commit`` callbacks of a committed transaction, as Django does."""
    for _sids, func, robust in hooks:
        if not robust:
            func()
            continue
        try:
            func()
        except Exception as exc:
            logger.exception(
                "Error calling %s in on_commit() (%s).", getattr(func, "__qualname__", func), exc
            )


def _unknown(names: str) -> CommitOutcomeUnknown:
    return CommitOutcomeUnknown(
        f"the connection broke while the COMMIT of the guarded writes under {names} was "
        "in flight, and no answer came: they may have committed or not. Look at the data "
        "before writing them again"
    )


def _unanswered(connection: BaseDatabaseWrapper, exc: BaseException) -> bool:
    """Whether ``exc``, raised by a COMMIT, says that no answer came from the
    server (the connection broke): the COMMIT may have run. An error the
    server sent (it ended the session, refused the commit) means it did not."""
    if connection.vendor == "postgresql":
        from django_dlock.strategies._pg import sqlstate

        return sqlstate(exc) is None and unreachable(connection, exc)
    if connection.vendor == "mysql":
        code = getattr(exc.__cause__, "args", (None,))[0]
        return code == 2013  # lost the connection during the query
    return False


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
    """Whether ``exc`` says the session is gone: the server ended it (its
    idle timeout, an administrator, a shutdown) or the connection broke."""
    if connection.vendor == "postgresql":
        from django_dlock.strategies._pg import sqlstate

        # idle in transaction too long, the session terminated, a shutdown
        state = sqlstate(exc)
        if state in _SESSION_ENDED:
            return True
        if state is None and _operational(exc) and not _answers(connection):
            # raised by the driver, not the server ("connection socket
            # closed"), before the connection was marked closed
            return True
    elif connection.vendor == "mysql":
        code = getattr(exc.__cause__, "args", (None,))[0]
        # gone away, lost the connection, killed, disconnected for inactivity (MySQL 8)
        if code in (1927, 2006, 2013, 4031):
            return True
    return unreachable(connection, exc)


def _operational(exc: BaseException) -> bool:
    """An ``OperationalError``, Django's or the driver's own."""
    return isinstance(exc, OperationalError) or type(exc).__name__ == "OperationalError"


def _answers(connection: BaseDatabaseWrapper) -> bool:
    """Whether ``connection``'s PostgreSQL session still answers a statement
    (an error from the server, such as an aborted transaction's, is an
    answer). Not asked of a connection in pipeline mode."""
    raw = connection.connection
    if raw is None or raw.closed:
        return False
    pgconn = getattr(raw, "pgconn", None)
    if pgconn is not None and pgconn.pipeline_status:
        return True
    try:
        with raw.cursor() as cur:
            cur.execute("SELECT 1")
    except Exception as probe:
        return bool(getattr(probe, "sqlstate", None) or getattr(probe, "pgcode", None))
    return True


def _why_ended(
    connection: BaseDatabaseWrapper, exc: BaseException, ttl: float | None = None
) -> str:
    """How the session of a guarded transaction ended, in words."""
    lease = "" if ttl is None else f" ({ttl:g} s)"
    idle = (
        "the server ended the session of their transaction, which stayed silent inside "
        f"it for longer than the lease{lease}"
    )
    if connection.vendor == "postgresql":
        from django_dlock.strategies._pg import sqlstate

        state = sqlstate(exc)
        if state == "25P03":
            return idle
        if state in _SESSION_ENDED:
            return (
                "the session of their transaction was ended by the server (terminated by an "
                "administrator, e.g. pg_terminate_backend, or the server shut down)"
            )
    elif connection.vendor == "mysql":
        code = getattr(exc.__cause__, "args", (None,))[0]
        if code == 4031:
            return idle
        if code in (1927, 2006, 2013):
            return (
                "the session of their transaction was ended: it was killed (KILL), the "
                "connection to the server was lost, or it stayed silent for longer than the "
                f"lease{lease} and the server closed it"
            )
    detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return f"the session of their transaction ended ({detail})"


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


class _Unknown(Exception):
    """The merged COMMIT may have run, but no answer came (its cause: why)."""


#: SQLSTATEs of a session the server ended: idle in transaction too long,
#: terminated by an administrator, a shutdown
_SESSION_ENDED = ("25P03", "57P01", "57P02", "57P03")


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
            if raw.pgconn.status != pq.ConnStatus.OK:  # (as psycopg's cursor says it)
                message = result.error_message or b"the connection broke"
                raise psycopg.OperationalError(message.decode(errors="replace").strip())
            raise psycopg.errors.error_from_result(result, encoding=raw.info.encoding)


#: a step of the check's pipeline: ("query", sql, params), ("prepare", name, sql)
#: or ("execute", name, params)
_Step = tuple[str, bytes, Any]

#: the names of the check statements prepared on each psycopg connection
_PREPARED: weakref.WeakKeyDictionary[Any, set[bytes]] = weakref.WeakKeyDictionary()


def _pipeline(pgconn: Any, steps: Sequence[_Step]) -> list[Any]:
    """Send ``steps`` in libpq's pipeline mode, then a sync point: one round
    trip. The result of each step (``None`` where none came: the connection
    broke). The connection leaves pipeline mode, unless it broke (then
    :func:`_broken` says so)."""
    import psycopg
    from psycopg import pq

    pgconn.enter_pipeline_mode()
    try:
        try:
            for kind, first, second in steps:
                if kind == "query":
                    pgconn.send_query_params(first, second)
                elif kind == "prepare":
                    pgconn.send_prepare(first, second)
                else:
                    pgconn.send_query_prepared(first, second)
            _sending(pgconn)
            pgconn.pipeline_sync()
        except psycopg.OperationalError:
            pass  # the connection broke: the results that came say how far the server got
        results: list[Any] = []
        for _ in steps:
            found = None
            while (result := _next_result(pgconn)) is not None:
                found = result
            results.append(found)
            if pgconn.status == pq.ConnStatus.BAD:
                return results + [None] * (len(steps) - len(results))
        # the sync point; the server may have ended the session instead of
        # reaching it (after the last step ran): read up to there, whatever came
        for _ in range(8):
            result = _next_result(pgconn)
            if pgconn.status == pq.ConnStatus.BAD or (
                result is not None and result.status == pq.ExecStatus.PIPELINE_SYNC
            ):
                break
        return results
    finally:
        with contextlib.suppress(Exception):  # (a broken connection may stay in it)
            pgconn.exit_pipeline_mode()


def _sending(pgconn: Any) -> None:
    """Called when the steps of a pipeline are queued, before its sync point
    is sent: nothing to do (a test pushes the steps out and ends the session
    here, as a server can between the last step and the sync point)."""


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
    """Raise what the check's pipeline (its last step the COMMIT) says went
    wrong: the first error, :class:`_Lost` if the lease was not the
    caller's, :class:`_Unknown` if the COMMIT may have run but its answer
    never came."""
    import psycopg
    from psycopg import pq

    last = len(results) - 1
    for step, result in enumerate(results):
        code = _sqlstate_of(result)
        if result is None or (result.status == pq.ExecStatus.FATAL_ERROR and code is None):
            # no answer from the server (the connection broke): it may have
            # run everything, the COMMIT too
            raise _Unknown(req) from psycopg.OperationalError(
                "the connection broke before the COMMIT of the guarded writes was answered"
            )
        if result.status == pq.ExecStatus.FATAL_ERROR:
            failed = psycopg.errors.error_from_result(result, encoding=raw.info.encoding)
            if code == "22012":  # no row: not ours any more
                raise _Lost(req) from failed
            if step == last and code in _SESSION_ENDED:
                # the session ended while the COMMIT ran: before or after it took effect
                raise _Unknown(req) from failed
            raise failed


def _ended(holding: Holding) -> LockLost:
    holding.mark_lost("its transaction ended")
    return holding.error()


def _names(held: Sequence[Holding]) -> str:
    return repr(", ".join(holding.name for holding in held))
