"""The watcher: a thread that reports the locks of ended advisory sessions lost.

It runs only while sessions hold locks (plus :data:`WATCH_LINGER` seconds)
and polls the sockets of idle holding sessions. A socket that becomes
readable while no statement runs means the server ended the session
(``pg_terminate_backend``, a restart, a network cut): the session is closed
and every lock it held is reported lost at once (``lock_lost`` signal,
``on_lost`` callback). It also closes the sessions of holders that ended
without releasing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from django_dlock.strategies.advisory.pool import bury_dead_holders, dead_holders, holding_sessions
from django_dlock.strategies.advisory.session import Session, _readable

logger = logging.getLogger("django_dlock")

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


def _after_fork_in_child() -> None:
    global _watcher, _watcher_mutex
    _watcher = None
    _watcher_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
