"""Wake-ups for lease waiters on PostgreSQL (``LISTEN django_dlock``).

One listener per process and database alias: a daemon thread with its own
psycopg connection in autocommit mode that has run ``LISTEN django_dlock``.
A release sends ``pg_notify('django_dlock', name)`` in the same statement
that ends the lease when a waiter is queued for it, so the head of the queue
wakes as soon as the release commits, without polling; :func:`wake` sends
it for a name whose listeners are not in the queue (an election's
candidates).

A waiter registers before it looks at the lock, so a release that happens
between the look and the wait still wakes it. If the listener's connection
fails, every waiter is woken (they re-check the lock) and the listener
reconnects; waiters never depend on it alone, they also wake when the lease
they wait for would expire.

A listener must be able to *hear*. Behind a pooler in transaction mode
(PgBouncer) the ``LISTEN`` stays on a server session that the pooler lends
to other clients, and notifications never reach the listener. So after each
``LISTEN`` the listener sends itself a ping (``pg_notify`` from a second,
short connection) and is healthy only once it hears it (a listener that
cannot hear stays so until it reconnects: the ping is not repeated, so many
processes do not flood each other). While it is not healthy, waiters look again
at the retry policy's interval instead of parking. ``DLOCK_DIRECT_DATABASES``
names an alias that reaches the same database without the pooler; the
listener then connects through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from django_dlock._threads import start_db_thread

logger = logging.getLogger("django_dlock")

CHANNEL = "django_dlock"
#: payload prefix of a listener's ping to itself (never a lock name: those are namespaced)
PING_PREFIX = "django-dlock-ping:"
#: seconds a listener waits to hear its own ping
PING_TIMEOUT = 1.0


class Waiter:
    """Something to wake: a thread's event or an asyncio event in a loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.thread_event = threading.Event()
        self.async_event = asyncio.Event() if loop is not None else None

    def wake(self) -> None:
        if self.loop is not None and self.async_event is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self.loop.call_soon_threadsafe(self.async_event.set)
        else:
            self.thread_event.set()

    def clear(self) -> None:
        self.thread_event.clear()
        if self.async_event is not None:
            self.async_event.clear()


class Listener:
    """The LISTEN connection of one database alias in this process."""

    def __init__(self, alias: str, connect: Callable[[], Any]) -> None:
        self.alias = alias
        self._connect = connect
        self._mutex = threading.Lock()
        self._waiters: dict[str, set[Waiter]] = {}
        self._ready = threading.Event()
        self._checked = threading.Event()
        self._stopped = threading.Event()
        #: listening and heard its own ping: a release wakes the waiters
        self.healthy = False
        self._deaf_reported = False
        # Its LISTEN connections are psycopg connections of its own, closed
        # by its loop; the thread opens no Django connection, and would
        # close any it opened when it ends.
        self._thread = start_db_thread(self._run, f"django-dlock-listen-{alias}")

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def wait_checked(self, timeout: float) -> bool:
        """Wait until the listener knows whether it hears (its first ping came back or not)."""
        return self._checked.wait(timeout)

    def register(self, name: str, waiter: Waiter) -> None:
        with self._mutex:
            self._waiters.setdefault(name, set()).add(waiter)

    def unregister(self, name: str, waiter: Waiter) -> None:
        with self._mutex:
            waiters = self._waiters.get(name)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[name]

    def _wake(self, name: str | None) -> None:
        with self._mutex:
            if name is None:
                targets = [w for ws in self._waiters.values() for w in ws]
            else:
                targets = list(self._waiters.get(name, ()))
        for waiter in targets:
            waiter.wake()

    def stop(self, wait: bool = True) -> None:
        self._stopped.set()
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                conn = self._connect()
            except Exception as exc:  # database down: wake waiters, retry later
                logger.warning("django-dlock: cannot LISTEN on %r: %s", self.alias, exc)
                self.healthy = False
                self._ready.set()
                self._wake(None)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            try:
                conn.execute(f"LISTEN {CHANNEL}")
                self._ready.set()
                # Anything released while we were not listening is caught
                # by the waiters' own re-checks after this wake-up.
                self._wake(None)
                # Until the ping is heard (not healthy), waiters poll.
                self._check_hearing(conn)
                while not self._stopped.is_set():
                    for notify in conn.notifies(timeout=1.0):
                        self._wake(notify.payload)
            except Exception as exc:
                logger.warning("django-dlock: LISTEN connection on %r lost: %s", self.alias, exc)
            finally:
                self.healthy = False
                self._wake(None)
                with contextlib.suppress(Exception):
                    conn.close()

    def _check_hearing(self, conn: Any) -> None:
        heard = self._ping(conn)
        if not heard and not self._deaf_reported:
            self._deaf_reported = True
            logger.warning(
                "django-dlock: the LISTEN connection of %r does not hear notifications "
                "(a pooler in transaction mode?); lease waiters poll at the retry interval. "
                "Set DLOCK_DIRECT_DATABASES to listen through a direct connection.",
                self.alias,
            )
        if heard:
            self._deaf_reported = False
        self.healthy = heard
        self._checked.set()

    def _ping(self, conn: Any) -> bool:
        """Send ourselves a notification from another connection; whether it arrives."""
        payload = PING_PREFIX + secrets.token_hex(8)
        try:
            sender = self._connect()
            try:
                sender.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])
            finally:
                sender.close()
        except Exception as exc:
            logger.warning("django-dlock: cannot ping the listener of %r: %s", self.alias, exc)
            return False
        deadline = time.monotonic() + PING_TIMEOUT
        while not self._stopped.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for notify in conn.notifies(timeout=left):
                if notify.payload == payload:
                    return True
                self._wake(notify.payload)
        return False


_listeners: dict[str, Listener] = {}
_listeners_mutex = threading.Lock()
_orphans: list[Any] = []


def _connect_like(alias: str) -> Callable[[], Any]:
    def connect() -> Any:
        import psycopg

        from django_dlock.strategies.connection import direct_alias

        wrapper = connections[direct_alias(alias)]
        params = wrapper.get_connection_params()
        params.pop("cursor_factory", None)
        params.pop("context", None)
        params.pop("prepare_threshold", None)
        params.pop("server_side_binding", None)
        return psycopg.Connection.connect(autocommit=True, **params)

    return connect


def wake(alias: str, name: str) -> None:
    """Wake whoever listens for ``name`` on ``alias`` (PostgreSQL; elsewhere nothing).

    For a name whose release does not announce itself: a lease's release
    wakes only the head of its key's waiter queue, while the candidates of
    an election listen for its lease ``leader:<name>`` by name. Best effort:
    a candidate that misses it looks again at its retry period.
    """
    from django_dlock.strategies.connection import fetch_one, lock_connection

    connection = lock_connection(alias)
    if connection.vendor != "postgresql":
        return
    try:
        fetch_one(connection, "SELECT pg_notify(%s, %s)", [CHANNEL, name])
    except Exception:  # the release stands; the candidates will look anyway
        logger.debug("django-dlock: could not wake the listeners of %s", name, exc_info=True)


def listener(alias: str) -> Listener:
    """The running listener of ``alias`` in this process (started on first use)."""
    with _listeners_mutex:
        found = _listeners.get(alias)
        if found is None:
            found = _listeners[alias] = Listener(alias, _connect_like(alias))
    return found


def stop_all() -> None:
    """Stop every listener of this process (used by tests and at shutdown)."""
    with _listeners_mutex:
        found = list(_listeners.values())
        _listeners.clear()
    for each in found:
        each.stop()


def _after_fork_in_child() -> None:
    # The listener threads do not exist in the child. Keep the inherited
    # objects alive (never closed: closing would end the parent's session).
    global _listeners_mutex
    _orphans.append(dict(_listeners))
    _listeners.clear()
    _listeners_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
