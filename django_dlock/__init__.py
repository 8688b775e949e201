"""Database-backed distributed locks for Django.

>>> import django_dlock as dlock
>>> with dlock.lock("invoice:42", timeout=5, ttl=30):
...     ...
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

from django_dlock import _logging  # noqa: F401  (escapes control characters in log lines)
from django_dlock.exceptions import (
    CommitOutcomeUnknown,
    DatabaseUnavailable,
    DLockError,
    GuardNotSupported,
    InvalidLockKey,
    KeyTemplateError,
    LockDeadlock,
    LockLost,
    LockNotOwned,
    LockReentrantError,
    LockTimeout,
    MissingKeyArgument,
    NotMigrated,
    QuorumUnavailable,
    SemaphoreNotSupported,
    SessionBusy,
    StaleFence,
    StrategyNotSupported,
    SyncInAsyncContext,
    TransactionRequired,
)

__version__ = "0.1.0"

__all__ = [
    "CommitOutcomeUnknown",
    "DLockError",
    "DatabaseUnavailable",
    "GuardNotSupported",
    "InvalidLockKey",
    "KeyTemplateError",
    "LeaderElection",
    "Lock",
    "LockDeadlock",
    "LockLost",
    "LockNotOwned",
    "LockReentrantError",
    "LockTimeout",
    "MissingKeyArgument",
    "NotMigrated",
    "QuorumUnavailable",
    "Semaphore",
    "SemaphoreNotSupported",
    "SessionBusy",
    "StaleFence",
    "StrategyNotSupported",
    "SyncInAsyncContext",
    "TaskLock",
    "TransactionRequired",
    "__version__",
    "close_connections",
    "lock",
    "lock_and_atomic",
    "semaphore",
]

if TYPE_CHECKING:
    from django_dlock.atomic import lock_and_atomic
    from django_dlock.leader import LeaderElection
    from django_dlock.locks import Lock, lock
    from django_dlock.semaphores import Semaphore, semaphore
    from django_dlock.tasklock import TaskLock


def close_connections() -> None:
    """Close the connections django-dlock opened in this process.

    The ``LISTEN`` connections that wake lease waiters, the idle sessions of
    the ``advisory`` strategy, the quorum's worker connections, and the
    calling thread's private lock connection (what lock statements made
    inside ``transaction.atomic`` run on). Call it before a test database is
    dropped: PostgreSQL refuses to drop a database that still has sessions.
    Locks held on a session that is closed are released by the server.
    """
    from django_dlock import notify
    from django_dlock.strategies.connection import close_private_connections

    notify.stop_all()
    # only what was loaded can have opened anything (and advisory needs a driver)
    pool = sys.modules.get("django_dlock.strategies.advisory.sessions")
    if pool is not None:
        pool.close_all()
    workers = sys.modules.get("django_dlock.strategies.quorum.rounds")
    if workers is not None:
        workers.close_all()
    close_private_connections()


def __getattr__(name: str) -> Any:
    # The lock machinery imports Django's database layer; load it lazily so
    # that ``import django_dlock`` works before ``django.setup()`` (settings,
    # INSTALLED_APPS, the AppConfig).
    # The system checks, dlock.E000 among them, are registered by the app's
    # ready(); a project that uses django-dlock without "django_dlock" in
    # INSTALLED_APPS has them registered here, so that E000 says so.
    if not name.startswith("__"):
        import_module("django_dlock.checks")

    if name in ("Lock", "lock"):
        from django_dlock import locks

        found = getattr(locks, name)
        globals()[name] = found  # found directly from now on (``dlock.lock`` per call)
        return found
    if name in ("Semaphore", "semaphore"):
        from django_dlock import semaphores

        return getattr(semaphores, name)
    if name == "TaskLock":
        from django_dlock.tasklock import TaskLock

        return TaskLock
    if name == "LeaderElection":
        from django_dlock.leader import LeaderElection

        return LeaderElection
    if name == "lock_and_atomic":
        from django_dlock.atomic import lock_and_atomic

        return lock_and_atomic
    raise AttributeError(f"module 'django_dlock' has no attribute {name!r}")
