"""The pools of dedicated advisory sessions in this process, one per database alias.

A holder's session comes from its alias's :class:`Pool`: its current one, an
idle one, or a new connection, checked before it takes any lock (a pooler in
transaction mode is refused with :class:`SessionSwitched`). A session whose
holder holds nothing more goes back to the pool (at most :data:`MAX_IDLE`
per alias, closed after :data:`IDLE_TIMEOUT` seconds idle). A holder that is
garbage collected while holding locks has its session closed. After
``fork`` a child starts with empty pools; inherited connections are never
used nor closed in the child (closing would end the parent's session).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psycopg
from django.db import connections

from django_dlock.strategies.advisory.session import Session, SessionSwitched
from django_dlock.strategies.connection import DIRECT_GRACE, Abandoned, deadline_end

if TYPE_CHECKING:
    from django_dlock.identity import Holder

logger = logging.getLogger("django_dlock")

#: idle sessions kept per alias and process
MAX_IDLE = 4
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
    params.setdefault("application_name", "django-dlock")
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
_orphans: list[Any] = []
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


def _after_fork_in_child() -> None:
    # The child must never use (nor close: that would end the parent's
    # sessions) the connections it inherited. Keep them referenced forever.
    global _pools, _pools_mutex, _dead_tokens
    _orphans.append(_pools)
    _pools = {}
    _pools_mutex = threading.Lock()
    _dead_tokens = collections.deque()
    _watched_holders.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
