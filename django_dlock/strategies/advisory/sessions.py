"""The dedicated sessions of the ``advisory`` strategy: a session, its pool, the watcher.

A session-level advisory lock belongs to a database *session*, not to a
thread or a transaction. Two holders (threads, or asyncio tasks in one
thread) that shared a session would share its locks, and a session handed
to the next borrower by a connection pool would hand over its locks too.
So the ``advisory`` strategy never uses Django's connections:

* Each **holder** (thread or task, identified by its token) that holds at
  least one advisory lock on an alias owns one dedicated psycopg connection
  of this process, in autocommit mode, opened with the alias's connection
  parameters (``connections[alias].get_connection_params()``). All its
  advisory locks on that alias live in that session; no one else uses it.
* When the holder holds nothing more on the alias, the connection goes back
  to a small in-process **pool** of idle sessions (at most :data:`MAX_IDLE`
  per alias, closed after :data:`IDLE_TIMEOUT` seconds idle), so the next
  acquisition costs no connect. A session is only ever pooled when it holds
  no lock; one that is in doubt is closed instead (closing a session frees
  its locks).
* A session is checked **before it takes any lock**: if the cancel key of
  the connection does not carry the server's ``pg_backend_pid()``, a pooler
  (PgBouncer) sits in between. The first such session of a pool then asks
  whether the pooler keeps a server session per client (session mode: fine)
  or lends it between transactions (transaction mode): while a second
  connection holds a transaction open, the session asks for its backend pid
  again; in transaction mode the answer changes (or waits for the other
  transaction). Transaction mode is refused with :class:`SessionSwitched`
  before any lock is taken, and every later session of the pool is refused
  without connecting: a session lock taken there would stay with a server
  session that the pooler lends to others.
* Every hot statement also returns ``pg_backend_pid()``: if it ever differs
  from the pid the session started with, the server session was switched
  under the connection, and :class:`SessionSwitched` is raised.
* A **watcher** thread (running only while sessions hold locks, plus a few
  seconds) polls the sockets of idle holding sessions. A socket that becomes
  readable while no statement runs means the server ended the session
  (``pg_terminate_backend``, a restart, a network cut): the session is
  closed and every lock it held is reported lost at once, through the
  callback the holder's lock registered (``Holder.report_lost``: the
  ``lock_lost`` signal and the ``on_lost`` callback of a ``Lock``).
* A holder that disappears (its thread ends, its task is garbage collected)
  while still holding locks has its session closed, which frees the locks.
* After ``fork`` a child starts with empty pools; inherited connections are
  never used nor closed in the child (closing would end the parent's
  session).

Async holders wait in a thread of a small dedicated executor
(:func:`executor`), so a blocking ``pg_advisory_lock`` never blocks the event
loop nor Django's shared sync thread. A cancelled task cancels its
server-side wait (:meth:`Session.cancel_wait`).

Call :func:`close_all` to close every idle session of this process (at
shutdown, and in test suites before the test database is dropped).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import math
import os
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg
from django.db import connections

from django_dlock.exceptions import DatabaseUnavailable, DLockError, SessionBusy
from django_dlock.strategies.connection import DIRECT_GRACE, Abandoned, deadline_end, watched_raw

if TYPE_CHECKING:
    from django_dlock.identity import Holder


T = TypeVar("T")

#: threads of the executor in which async holders run short advisory statements
#: (a wait runs in a thread of its own: :func:`in_thread`)
WAIT_THREADS = 8

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_mutex = threading.Lock()
_orphans: list[Any] = []


def executor() -> concurrent.futures.ThreadPoolExecutor:
    """The threads in which async holders run short advisory statements."""
    global _executor
    if _executor is None:
        with _executor_mutex:
            if _executor is None:
                _executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=WAIT_THREADS, thread_name_prefix="django-dlock-advisory"
                )
    return _executor


def in_thread(
    loop: asyncio.AbstractEventLoop, func: Callable[..., T], *args: Any
) -> asyncio.Future[T]:
    """Run ``func(*args)`` in a new daemon thread; its result as a future of ``loop``.

    For waits, which can last: a thread per wait never starves the executor,
    and a daemon thread never holds up the interpreter's exit.
    """
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.cancelled():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = func(*args)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="django-dlock-advisory-wait", daemon=True).start()
    return future


def _executor_after_fork() -> None:
    # Never shut down (nor use) the parent's executor in the child.
    global _executor, _executor_mutex
    _orphans.append(_executor)
    _executor = None
    _executor_mutex = threading.Lock()


os.register_at_fork(after_in_child=_executor_after_fork)


logger = logging.getLogger("django_dlock")

#: idle sessions kept per alias and process
MAX_IDLE = 4
#: the ``application_name`` of a new session (PostgreSQL: a session holding or
#: awaiting a lock is named after its holder, and keeps that name until the
#: next holder's)
IDLE_NAME = "django-dlock"
#: seconds after which an idle pooled session is closed
IDLE_TIMEOUT = 60.0

_SETUP = (
    "SELECT pg_backend_pid(), set_config('statement_timeout', '0', false), "
    "set_config('lock_timeout', '0', false), "
    "set_config('idle_in_transaction_session_timeout', '0', false)"
)
_SETUP_14 = _SETUP + ", set_config('idle_session_timeout', '0', false)"


def _settings_identity(alias: str) -> tuple[Any, ...]:
    settings = connections.settings[alias]
    return (
        settings.get("NAME"),
        settings.get("USER"),
        settings.get("HOST"),
        settings.get("PORT"),
    )


def _connect(alias: str) -> psycopg.Connection[Any]:
    """A new session on ``alias``.

    In an acquire with a timeout, a server that does not answer the
    connection by the deadline (plus ``DIRECT_GRACE``; libpq counts whole
    seconds, at least 2) is given up: :class:`Abandoned`.
    """
    params = connections[alias].get_connection_params()
    for name in ("cursor_factory", "context", "prepare_threshold", "server_side_binding"):
        params.pop(name, None)
    params.setdefault("application_name", IDLE_NAME)
    end = deadline_end()
    if end is not None and "connect_timeout" not in params:
        params["connect_timeout"] = max(2, math.ceil(end + DIRECT_GRACE - time.monotonic()))
    # The hot statements are prepared on first use (``prepare=True``).
    try:
        return psycopg.Connection.connect(autocommit=True, **params)
    except psycopg.OperationalError as exc:
        if end is not None and time.monotonic() >= end:
            raise Abandoned(
                f"the database {alias!r} did not answer a new connection by the lock's deadline"
            ) from exc
        raise


class Pool:
    """The sessions of one database alias in this process."""

    def __init__(self, alias: str, identity: tuple[Any, ...]) -> None:
        self.alias = alias
        self.identity = identity
        self.mutex = threading.Lock()
        self.idle: list[Session] = []
        self.by_token: dict[str, Session] = {}
        self.retired = False
        #: why this database cannot carry session locks (a transaction-mode pooler), if it cannot
        self.refused: str | None = None
        #: one pooler probe at a time: two probes at once can read each
        #: other's server sessions as "this one kept its session"
        self.probing = threading.Lock()

    def session_for(self, token: str, holder: Callable[[], Holder | None]) -> Session:
        """The holder's session: its current one, a pooled one, or a new one."""
        stale: list[Session] = []
        with self.mutex:
            session = self.by_token.get(token)
            if session is not None and session.lost is None:
                session.pins += 1
                return session
            if session is not None:
                del self.by_token[token]
            session = None
            now = time.monotonic()
            while self.idle:
                candidate = self.idle.pop()
                if candidate.lost is None and now - candidate.idle_since < IDLE_TIMEOUT:
                    session = candidate
                    break
                stale.append(candidate)
            stale.extend(self._expired(now))
        for old in stale:
            old.fail("idle session expired")
        if session is None:
            session = self._open()
        owner = holder()
        session.token = token
        session.holder_ref = weakref.ref(owner) if owner is not None else None
        with self.mutex:
            session.pins = 1
            self.by_token[token] = session
        if owner is not None:
            _watch_holder(owner, token)
        return session

    def _expired(self, now: float) -> list[Session]:
        expired = [s for s in self.idle if now - s.idle_since >= IDLE_TIMEOUT]
        if expired:
            self.idle = [s for s in self.idle if s not in expired]
        return expired

    def _open(self) -> Session:
        if self.refused is not None:
            raise SessionSwitched(self.refused)
        conn = _connect(self.alias)
        try:
            sql = _SETUP_14 if conn.info.server_version >= 140000 else _SETUP
            row = conn.execute(sql).fetchone()
            assert row is not None
            pid = int(row[0])
            if conn.info.backend_pid != pid and self._lends(conn):
                self.refused = (
                    f"the database {self.alias!r} is reached through a pooler in transaction "
                    "mode (such as PgBouncer), which lends a server session to other clients "
                    "between transactions: a session advisory lock would stay with it. "
                    "Give the advisory strategy a database alias that connects directly (or "
                    "through a session-mode pool), or use the advisory_xact or lease strategy"
                )
                raise SessionSwitched(self.refused)
        except BaseException:
            with contextlib.suppress(Exception):
                conn.close()
            raise
        return Session(self, conn, pid)

    def _lends(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether the pooler lends server sessions: probed one at a time, a few times.

        In session mode every probe says no; in transaction mode a probe can
        miss (another client's statement took the server session it looked
        at), never the other way round: so one "yes" decides.
        """
        with self.probing:
            for _ in range(PROBES):
                if self.refused is not None:
                    return True
                row = conn.execute("SELECT pg_backend_pid()").fetchone()
                if row is None or _lends_server_sessions(self.alias, conn, int(row[0])):
                    return True
        return False

    def find(self, token: str) -> Session | None:
        return self.by_token.get(token)

    def unpin(self, session: Session) -> None:
        """An acquisition on ``session`` has ended (acquired or not)."""
        with self.mutex:
            session.pins -= 1
        self.done(session)

    def done(self, session: Session) -> None:
        """If the holder holds nothing more here, pool the session (or close it)."""
        close = False
        with self.mutex:
            if session.held or session.pins:
                return
            if self.by_token.get(session.token or "") is session:
                del self.by_token[session.token or ""]
            session.token = None
            session.holder_ref = None
            if session.lost is not None:
                return
            if self.retired or len(self.idle) >= MAX_IDLE:
                close = True
            else:
                session.idle_since = time.monotonic()
                self.idle.append(session)
        if close:
            session.fail("not pooled")

    def forget(self, session: Session) -> None:
        with self.mutex:
            if session.token is not None and self.by_token.get(session.token) is session:
                del self.by_token[session.token]
            if session in self.idle:
                self.idle.remove(session)

    def holding(self) -> list[Session]:
        with self.mutex:
            return [s for s in self.by_token.values() if s.held and s.lost is None]

    def close_idle(self) -> int:
        with self.mutex:
            idle, self.idle = self.idle, []
        for session in idle:
            session.fail("closed")
        return len(idle)


#: seconds a pooler probe waits for its session's answer while another client holds a transaction
PROBE_WAIT = 1.0
#: pooler probes before a pooler is taken to keep server sessions (session mode)
PROBES = 3


def _lends_server_sessions(alias: str, conn: psycopg.Connection[Any], pid: int) -> bool:
    """Whether the pooler in front of ``alias`` lends server sessions between transactions.

    ``conn`` is a new connection through the pooler whose server session is
    ``pid``. A second connection opens a transaction (which pins a server
    session to it in any pooling mode), then ``conn`` asks for its pid
    again. Session mode: ``conn`` keeps ``pid`` and answers at once.
    Transaction mode: the second connection got ``pid`` itself, or ``conn``
    is answered by another server session, or it waits because the pool has
    no other (it is answered when the second transaction ends).
    """
    other = _connect(alias)
    try:
        other.execute("BEGIN")
        row = other.execute("SELECT pg_backend_pid()").fetchone()
        if row is not None and int(row[0]) == pid:
            return True
        answer: list[int] = []

        def ask() -> None:
            found = conn.execute("SELECT pg_backend_pid()").fetchone()
            if found is not None:
                answer.append(int(found[0]))

        asking = threading.Thread(target=ask, name="django-dlock-pooler-probe", daemon=True)
        asking.start()
        asking.join(PROBE_WAIT)
        waited = asking.is_alive()
        other.execute("ROLLBACK")
        asking.join(30)
        return waited or not answer or answer[0] != pid
    finally:
        with contextlib.suppress(Exception):
            other.close()


# -- per process state ---------------------------------------------------------


_pools: dict[str, Pool] = {}
_pools_mutex = threading.Lock()
_dead_tokens: collections.deque[str] = collections.deque()
_watched_holders: set[str] = set()


def pool(alias: str, kind: type[Pool] = Pool) -> Pool:
    """The session pool of ``alias`` in this process.

    A pool whose connection settings changed (the test runner switching to
    the test database, say) is retired: its idle sessions are closed and
    its busy ones are closed when they are given back. ``kind`` is the pool
    class (a subclass opens sessions of another database, such as MySQL).
    """
    identity = _settings_identity(alias)
    found = _pools.get(alias)
    if found is not None and found.identity == identity and type(found) is kind:
        return found
    with _pools_mutex:
        found = _pools.get(alias)
        if found is None or found.identity != identity or type(found) is not kind:
            if found is not None:
                found.retired = True
                found.close_idle()
            found = _pools[alias] = kind(alias, identity)
    return found


def session_for(
    alias: str, token: str, holder: Callable[[], Holder | None], kind: type[Pool] = Pool
) -> Session:
    """The dedicated session of the holder with ``token`` on ``alias``."""
    if _dead_tokens:
        bury_dead_holders()
    return pool(alias, kind).session_for(token, holder)


def find(alias: str, token: str) -> Session | None:
    """The holder's current session on ``alias``, if it has one."""
    found = _pools.get(alias)
    return None if found is None else found.find(token)


def close_all() -> int:
    """Close every idle session of this process; return how many were closed.

    Sessions that hold locks are left alone (closing them would free their
    locks behind their holders' backs).
    """
    with _pools_mutex:
        pools = list(_pools.values())
    return sum(p.close_idle() for p in pools)


def holding_sessions() -> list[Session]:
    """Every live session of this process that holds at least one lock."""
    with _pools_mutex:
        pools = list(_pools.values())
    return [s for p in pools for s in p.holding()]


# -- holders that end without releasing ------------------------------------------


def _watch_holder(holder: Holder, token: str) -> None:
    # Once per holder: when it is garbage collected, its sessions are closed
    # (which frees whatever it still holds). The callback runs inside the
    # garbage collector, possibly in the middle of our own code, so it only
    # queues the token.
    if token in _watched_holders:
        return
    _watched_holders.add(token)
    weakref.finalize(holder, _dead_tokens.append, token)


def bury_dead_holders() -> None:
    while _dead_tokens:
        try:
            token = _dead_tokens.popleft()
        except IndexError:
            return
        _watched_holders.discard(token)
        with _pools_mutex:
            pools = list(_pools.values())
        for each in pools:
            session = each.find(token)
            if session is None:
                continue
            if session.held:
                logger.warning(
                    "django-dlock: a thread or task ended while holding advisory lock(s) %s "
                    "on %r; its session was closed, which released them",
                    ", ".join(sorted(session.held)),
                    each.alias,
                )
                session.held = {}
                session.fail("the holder ended without releasing")
            else:
                each.done(session)


def dead_holders() -> bool:
    """Whether holders ended while holding sessions that are not closed yet."""
    return bool(_dead_tokens)


# -- fork --------------------------------------------------------------------------


def _pools_after_fork() -> None:
    # The child must never use (nor close: that would end the parent's
    # sessions) the connections it inherited. Keep them referenced forever.
    global _pools, _pools_mutex, _dead_tokens
    _orphans.append(_pools)
    _pools = {}
    _pools_mutex = threading.Lock()
    _dead_tokens = collections.deque()
    _watched_holders.clear()


os.register_at_fork(after_in_child=_pools_after_fork)


#: seconds between two looks of the watcher at the holding sessions
WATCH_INTERVAL = 0.2
#: seconds the watcher lingers without holding sessions before it stops
WATCH_LINGER = 10.0

_watcher: threading.Thread | None = None
_watcher_mutex = threading.Lock()


def ensure_watcher() -> None:
    """Start the watcher thread if it is not running (cheap when it is)."""
    global _watcher
    if _watcher is not None:
        return
    with _watcher_mutex:
        if _watcher is None:
            _watcher = threading.Thread(target=_watch, name="django-dlock-watch", daemon=True)
            _watcher.start()


def _watch() -> None:
    global _watcher
    quiet_since = time.monotonic()
    while True:
        try:
            if dead_holders():
                bury_dead_holders()
            sessions = holding_sessions()
            if not sessions:
                if time.monotonic() - quiet_since > WATCH_LINGER:
                    with _watcher_mutex:
                        if not holding_sessions() and not dead_holders():
                            _watcher = None
                            return
                time.sleep(WATCH_INTERVAL)
                continue
            quiet_since = time.monotonic()
            by_fd: dict[int, Session] = {}
            for session in sessions:
                with contextlib.suppress(Exception):
                    by_fd[session.conn.fileno()] = session
            if not by_fd:
                time.sleep(WATCH_INTERVAL)
                continue
            readable = _readable(list(by_fd), WATCH_INTERVAL)
            for fd in readable:
                session = by_fd[fd]
                if session.looks_dead():
                    session.report_lost()
            if readable:
                time.sleep(0.01)  # a busy session's socket stays readable until it reads
        except Exception:  # never die: log and go on
            logger.exception("django-dlock: the advisory session watcher failed")
            time.sleep(WATCH_INTERVAL)


def _watcher_after_fork() -> None:
    global _watcher, _watcher_mutex
    _watcher = None
    _watcher_mutex = threading.Lock()


os.register_at_fork(after_in_child=_watcher_after_fork)


_CONNECTION_OK = 0  # psycopg.pq.ConnStatus.OK
_COMMAND_OK, _TUPLES_OK = 1, 2  # psycopg.pq.ExecStatus


@dataclass(frozen=True, eq=False)
class Statement:
    """A short statement run with :meth:`Session.run`: ``$n`` placeholders, typed.

    Statements are module constants, found by identity in a session's table
    of prepared statements (no hashing of the SQL text per call).
    """

    sql: str
    #: type oid of each parameter (20 = bigint, 23 = integer, 25 = text)
    types: tuple[int, ...]


def _readable(fds: list[int], timeout: float) -> list[int]:
    """The file descriptors among ``fds`` with something to read."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
        return [fd for fd, _ in poller.poll(timeout * 1000)]
    readable, _, _ = select.select(fds, [], [], timeout)
    return list(readable)


class SessionLost(DatabaseUnavailable):
    """The database session ended (the connection dropped or was terminated).

    Raised by an acquisition whose session ended under it: the session
    holds nothing any more, so the lock is not held.
    """


class SessionSwitched(DLockError):
    """The server session changed between two statements (transaction pooling)."""


class WaitCancelled(Exception):
    """The async task that wanted to wait was cancelled before the wait began."""


class Cancellable(Protocol):
    cancelled: bool


#: how often a statement waiting for its session looks whether a two-phase place took it
PLACE_LOOK_SECONDS = 0.05


class _Using:
    """``with session.using:`` takes the session's ``mutex`` to run a statement.

    While it waits for the mutex, a two-phase place of another thread that
    took the session meanwhile (its statement can keep the mutex until the
    lock is granted) is :class:`SessionBusy` at once, as it would have been
    had the place been there before.
    """

    __slots__ = ("session",)

    def __init__(self, session: Session) -> None:
        self.session = session

    def __enter__(self) -> None:
        mutex = self.session.mutex
        if mutex.acquire(blocking=False):
            return
        while not mutex.acquire(timeout=PLACE_LOOK_SECONDS):
            self.session._refuse_while_placed()

    def __exit__(self, *exc: object) -> None:
        self.session.mutex.release()


class Session:
    """One dedicated connection, owned by at most one holder at a time."""

    def __init__(self, pool: Pool, conn: psycopg.Connection[Any], backend_pid: int) -> None:
        self.pool = pool
        self.conn = conn
        self.backend_pid = backend_pid
        self.backend_pid_text = str(backend_pid).encode()
        #: statement -> name of its prepared statement on this session
        self.prepared: dict[Statement, bytes] = {}
        #: serialises every use of ``conn`` (holder, renewer, watcher, sync thread)
        self.mutex = threading.Lock()
        #: the mutex, for a statement of the holder (see :class:`_Using`)
        self.using = _Using(self)
        #: key name -> shared? for every lock this session holds
        self.held: dict[str, bool] = {}
        self.token: str | None = None
        #: the ``application_name`` the session's statements last set
        #: (PostgreSQL; ``None``: only the one it connected with)
        self.named: bytes | None = None
        self.holder_ref: weakref.ReferenceType[Holder] | None = None
        self.family = "advisory"
        #: why the session ended (``None`` while it lives)
        self.lost: str | None = None
        self.idle_since = time.monotonic()
        #: acquisitions in progress on this session (it is not pooled meanwhile)
        self.pins = 0
        self._wait_mutex = threading.Lock()
        self._waiting = False
        #: the key whose two-phase place waits on this session, and the thread
        #: that waits for it (every other thread gets SessionBusy)
        self.place: tuple[str, int] | None = None

    @property
    def alias(self) -> str:
        return self.pool.alias

    # -- statements -------------------------------------------------------

    def run(
        self, stmt: Statement, params: Sequence[bytes], *, check_pid: bool = True
    ) -> tuple[bytes | None, ...]:
        """Run one short prepared statement; return its first row (text values).

        In an acquire with a timeout, a server that has not answered
        :data:`~django_dlock.strategies.connection.DIRECT_GRACE` after the
        deadline is taken for frozen: the session is ended (which frees
        whatever it held, reported lost) and
        :class:`~django_dlock.strategies.connection.Abandoned` is raised.

        The statement goes straight to libpq (``PQexecPrepared``, which
        releases the GIL): a few microseconds instead of a cursor's tens.
        It is prepared on this session the first time. With ``check_pid`` its
        last column must be ``pg_backend_pid()`` and equal this session's pid.

        Raises:
            SessionLost: the connection is gone (the session has ended); the
                locks it held are reported lost.
            SessionSwitched: a pooler switched the server session.
            SessionBusy: a two-phase place waits on the session.
            psycopg.Error: the statement failed (the session lives on).
        """
        if deadline_end() is None:
            return self._run(stmt, params, check_pid)
        return self._watched(lambda: self._run(stmt, params, check_pid))

    def _watched(self, run: Callable[[], T]) -> T:
        """``run()``, given up (the session ended) if the server stopped answering."""
        try:
            return watched_raw(self.conn, run, DIRECT_GRACE, cancel=False)
        except Abandoned:
            self.fail(
                "the database server stopped answering: a lock statement was given up "
                "at the lock's deadline"
            )
            raise

    def _run(
        self, stmt: Statement, params: Sequence[bytes], check_pid: bool
    ) -> tuple[bytes | None, ...]:
        self._refuse_while_placed()
        with self.using:
            if self.lost is not None:
                raise SessionLost(self.lost)
            pgconn = self.conn.pgconn
            name = self.prepared.get(stmt)
            if name is None:
                name = b"django_dlock_%d" % len(self.prepared)
                result = pgconn.prepare(name, stmt.sql.encode(), stmt.types)
                if result.status != _COMMAND_OK:
                    error = self._error(result)
                else:
                    self.prepared[stmt] = name
                    error = None
            else:
                error = None
            if error is None:
                result = pgconn.exec_prepared(name, params)
                if result.status == _TUPLES_OK:
                    value = result.get_value
                    row = tuple([value(0, i) for i in range(result.nfields)])
                else:
                    error = self._error(result)
        if error is not None:
            if self.lost is not None:
                self.report_lost()
                raise SessionLost(self.lost) from error
            if isinstance(error, psycopg.errors.InvalidSqlStatementName):
                row = (None, b"-1")  # a pooler gave us a session without our statements
            else:
                raise error
        if check_pid and row[-1] != self.backend_pid_text:
            self._switched(row[-1])
        return row

    def _error(self, result: Any) -> psycopg.Error:
        """The error of a failed result; ends the session if the connection broke."""
        error = psycopg.errors.error_from_result(result, encoding=self.conn.info.encoding)
        if self.conn.pgconn.status != _CONNECTION_OK:
            self._end(f"the database session ended: {error}".strip())
        return error

    def _switched(self, pid: bytes | None) -> None:
        reason = (
            f"the server session changed under the connection (backend pid "
            f"{self.backend_pid}, then {(pid or b'?').decode()}): it goes through a "
            "pooler in transaction mode (such as PgBouncer), which cannot carry "
            "session advisory locks"
        )
        self.fail(reason)
        raise SessionSwitched(
            reason + ". Give the advisory strategy a database alias that connects "
            "directly (or through a session-mode pool), or use the advisory_xact or "
            "lease strategy."
        )

    def wait(
        self, sql: str, params: list[Any], waiter: Cancellable | None = None
    ) -> tuple[Any, ...]:
        """Run a statement that may wait (through psycopg: interruptible).

        Its last column must be ``pg_backend_pid()``. :meth:`cancel_wait`
        interrupts it from another thread.

        Raises:
            WaitCancelled: ``waiter`` was cancelled before the wait began.
            SessionLost, SessionSwitched, SessionBusy, psycopg.Error, Abandoned: as
                :meth:`run`.
        """
        if deadline_end() is None:
            return self._wait(sql, params, waiter)
        return self._watched(lambda: self._wait(sql, params, waiter))

    def _wait(self, sql: str, params: list[Any], waiter: Cancellable | None) -> tuple[Any, ...]:
        self._refuse_while_placed()
        with self._wait_mutex:
            if waiter is not None and waiter.cancelled:
                raise WaitCancelled()
            self._waiting = True
        try:
            failure: BaseException | None = None
            with self.using:
                if self.lost is not None:
                    raise SessionLost(self.lost)
                if waiter is not None and waiter.cancelled:
                    # cancelled while this waited for the session: the server
                    # was sent a cancel before the statement, which it ignores
                    raise WaitCancelled()
                try:
                    row = self.conn.execute(sql, params).fetchone()
                except psycopg.Error as exc:
                    if self.conn.pgconn.status == _CONNECTION_OK and not self.conn.closed:
                        raise
                    self._end(f"the database session ended: {exc}".strip())
                    failure = exc
        finally:
            with self._wait_mutex:
                self._waiting = False
        if failure is not None:
            self.report_lost()
            raise SessionLost(self.lost or "the database session ended") from failure
        assert row is not None
        if row[-1] != self.backend_pid:
            self._switched(str(row[-1]).encode())
        return tuple(row)

    def _refuse_while_placed(self) -> None:
        place = self.place
        if place is not None and place[1] != threading.get_ident():
            raise SessionBusy(
                f"the advisory session of this holder on {self.alias!r} is waiting in the "
                f"server for {place[0]!r} (a place taken by enqueue()): call wait() on that "
                "lock first, or release() to give the place up; or take this lock with "
                "another strategy (lease)"
            )

    def cancel_wait(self) -> None:
        """Cancel the statement running in :meth:`wait`, if one is running."""
        with self._wait_mutex:
            if not self._waiting:
                return
            try:
                cancel = getattr(self.conn, "cancel_safe", None)
                if cancel is not None:
                    cancel()
                else:  # psycopg < 3.2
                    self.conn.cancel()
            except Exception as exc:  # the wait ends on its own (deadline, release)
                logger.warning("django-dlock: could not cancel an advisory wait: %s", exc)

    # -- end of the session -------------------------------------------------

    def _end(self, reason: str) -> None:
        """Close the connection (with ``mutex`` held); the server frees its locks."""
        if self.lost is None:
            self.lost = reason
        with contextlib.suppress(Exception):
            self.conn.close()

    def fail(self, reason: str) -> None:
        """End the session and report its locks lost."""
        with self.mutex:
            self._end(reason)
        self.report_lost()

    def report_lost(self) -> None:
        """Mark the holdings of every lock this session held as lost (once)."""
        self.pool.forget(self)
        holder = self.holder_ref() if self.holder_ref is not None else None
        names, self.held = list(self.held), {}
        if holder is None:
            return
        reason = self.lost or "the database session ended"
        for name in names:
            try:
                # the front object's callback: lock_lost signal, on_lost callback
                holder.report_lost((self.alias, self.family, name), reason)
            except Exception:  # a signal receiver raised: the others still hear
                logger.exception("django-dlock: reporting the loss of %s failed", name)

    def looks_dead(self) -> bool:
        """For the watcher: consume what the idle socket has; true if the session ended."""
        if not self.mutex.acquire(blocking=False):
            return False  # a statement is running: it will see any failure itself
        try:
            if self.lost is not None or self.conn.closed:
                return False
            for _ in range(3):
                try:
                    self.conn.pgconn.consume_input()
                    fd = self.conn.fileno()
                except Exception as exc:
                    self._end(f"the database session ended: {exc}".strip())
                    return True
                if self.conn.pgconn.status != _CONNECTION_OK:
                    self._end("the database session ended")
                    return True
                if not _readable([fd], 0):
                    return False  # a notice or a parameter report: harmless
            return False
        finally:
            self.mutex.release()
