"""The dedicated sessions of the ``advisory`` strategy, under their former name.

They live in :mod:`django_dlock.strategies.advisory` now
(:mod:`~django_dlock.strategies.advisory.session`,
:mod:`~django_dlock.strategies.advisory.pool`,
:mod:`~django_dlock.strategies.advisory.watcher`,
:mod:`~django_dlock.strategies.advisory.executor`); this module keeps the
documented names importable: :func:`close_all` (call it before a test
database is dropped), :data:`MAX_IDLE`, :data:`WAIT_THREADS`, ...
"""

from __future__ import annotations

from django_dlock.strategies.advisory.executor import WAIT_THREADS, executor, in_thread
from django_dlock.strategies.advisory.pool import (
    IDLE_TIMEOUT,
    MAX_IDLE,
    Pool,
    close_all,
    find,
    holding_sessions,
    pool,
    session_for,
)
from django_dlock.strategies.advisory.session import (
    Cancellable,
    Session,
    SessionLost,
    SessionSwitched,
    Statement,
    WaitCancelled,
)
from django_dlock.strategies.advisory.watcher import WATCH_INTERVAL, WATCH_LINGER, ensure_watcher

__all__ = [
    "IDLE_TIMEOUT",
    "MAX_IDLE",
    "WAIT_THREADS",
    "WATCH_INTERVAL",
    "WATCH_LINGER",
    "Cancellable",
    "Pool",
    "Session",
    "SessionLost",
    "SessionSwitched",
    "Statement",
    "WaitCancelled",
    "close_all",
    "ensure_watcher",
    "executor",
    "find",
    "holding_sessions",
    "in_thread",
    "pool",
    "session_for",
]
