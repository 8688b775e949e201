"""The error hierarchy of django-dlock.

Every error the library raises on purpose derives from :class:`DLockError`,
so ``except dlock.DLockError`` catches all of them. Driver errors that carry
a lock meaning (such as PostgreSQL's SQLSTATE 55P03, ``lock_not_available``)
are translated into these classes, never leaked.
"""

from __future__ import annotations

from django.core.exceptions import SynchronousOnlyOperation

__all__ = [
    "CommitOutcomeUnknown",
    "DLockError",
    "DatabaseUnavailable",
    "GuardNotSupported",
    "InvalidLockKey",
    "KeyTemplateError",
    "LockDeadlock",
    "LockLost",
    "LockNotOwned",
    "LockReentrantError",
    "LockTimeout",
    "MissingKeyArgument",
    "NotMigrated",
    "QuorumUnavailable",
    "SemaphoreNotSupported",
    "SessionBusy",
    "StaleFence",
    "StrategyNotSupported",
    "SyncInAsyncContext",
    "TransactionRequired",
]


class DLockError(Exception):
    """Base class of every django-dlock error."""


class LockTimeout(DLockError, TimeoutError):
    """The lock could not be acquired within the timeout."""


class LockDeadlock(LockTimeout):
    """Waiting for the lock would never end: its waiter is part of a deadlock.

    A lease waiter that has waited longer than ``DLOCK_DEADLOCK_TIMEOUT``
    looks for a cycle of holders that each wait for a key another holds;
    exactly one waiter of such a cycle (the one that began to wait last)
    gets this error, and its wait ends (its own keys are released as its
    ``with`` blocks are left, so the others can go on). An advisory lock
    gets it when PostgreSQL itself detects the deadlock (SQLSTATE 40P01).
    A :class:`LockTimeout`, so existing handlers keep working.

    Attributes:
        keys: the keys of the cycle, each one awaited by the holder of the
            key before it (the first is the one this waiter waits for).
        holders: the holders of the cycle (as the admin shows them: host,
            pid, thread or task); ``holders[i]`` holds ``keys[i]`` and
            waits for ``keys[i + 1]`` (this waiter waits for ``keys[0]``
            and is the last holder).
    """

    def __init__(
        self, message: str, keys: tuple[str, ...] = (), holders: tuple[str, ...] = ()
    ) -> None:
        super().__init__(message)
        self.keys = keys
        self.holders = holders


class QuorumUnavailable(LockTimeout):
    """A quorum lock (``using=[...]``) could not reach a majority of its databases.

    Raised instead of a driver error when too few databases answered before
    the timeout: the lock was neither acquired nor refused by a majority.
    """


class DatabaseUnavailable(DLockError):
    """The lock's database could not be reached, or stopped answering.

    Raised instead of the driver's error (which is chained as
    ``__cause__``) when a lock statement could not run: the server is down,
    restarting or failing over, or the connection broke. What state the lock
    is in depends on the call that raised it; the documentation of each
    strategy says.
    """


class CommitOutcomeUnknown(DatabaseUnavailable):
    """The connection broke while the COMMIT of ``Lock.guard()``'s writes was
    in flight, and no answer came: the writes may have committed, or not.

    Only the data can tell: look at it before writing again (a blind retry
    may apply the writes twice). Raised only when the server may have run
    the COMMIT; a guard whose COMMIT was answered returns normally (even if
    the session ended right after), and one whose transaction surely rolled
    back raises :class:`LockLost` (or :class:`DatabaseUnavailable` when the
    database could not be reached afterwards). The driver's error is its
    ``__cause__``.
    """


class LockNotOwned(DLockError):
    """Release or extend was asked of a lock the caller does not hold.

    Nothing was changed in the database.
    """


class LockLost(LockNotOwned):
    """A lock that was held is no longer held.

    Raised when a lease expired and was taken over by another holder, when
    a background renewal failed, or when the database session that held an
    advisory lock ended. It is a :class:`LockNotOwned`, because the caller
    no longer owns the lock.
    """


class StaleFence(LockLost):
    """A fenced write was refused: a newer holder has written with a newer fence."""


class SessionBusy(DLockError):
    """The caller's ``advisory`` session waits in the server for a place taken
    by ``enqueue()``.

    Until ``wait()`` (or ``release()``, which gives the place up), that
    session can run nothing else: the statement would queue behind the
    waiting one for as long as it waits. Nothing was changed: a lock the
    caller tried to release is still held.
    """


class LockReentrantError(DLockError):
    """The caller already holds the lock and ``reentrant=False`` was given."""


class NotMigrated(DLockError):
    """django-dlock's tables are missing on the lock's database.

    Raised by a lock call, a management command or the worker when
    ``python manage.py migrate`` has not been run for ``django_dlock`` on
    that database (``--database <alias>`` for one that is not ``default``).
    ``manage.py check --database <alias>`` reports it too (``dlock.E070``).
    The driver's error is its ``__cause__``.
    """


class TransactionRequired(DLockError):
    """A transaction-scoped lock (``advisory_xact``, ``row``) was acquired
    outside a transaction.

    Such a lock lasts until the end of the current transaction, so there
    must be one on the lock's database: wrap the code in
    ``with transaction.atomic(using=...):``, or use
    :func:`~django_dlock.lock_and_atomic`, which opens the transaction and
    takes the lock in it. Nothing was sent to the database.
    """


class SyncInAsyncContext(DLockError, SynchronousOnlyOperation):
    """A synchronous lock call (``with``, ``acquire()``, ``release()`` ...)
    was made from async code.

    In a thread that runs an event loop Django refuses synchronous database
    access, and a lock waiting there would block every task of the loop.
    Use the async forms instead: ``async with dlock.lock(...)``,
    ``await lk.aacquire()``, ``await lk.arelease()`` and so on (or run the
    synchronous code with ``asgiref.sync.sync_to_async``). Nothing was sent
    to the database.

    It is also a Django ``SynchronousOnlyOperation``, so handlers of that
    error catch it. Like Django, django-dlock allows the call when the
    ``DJANGO_ALLOW_ASYNC_UNSAFE`` environment variable is set.
    """


class StrategyNotSupported(DLockError):
    """The strategy is unknown, or the database cannot do it."""


class SemaphoreNotSupported(StrategyNotSupported):
    """A semaphore cannot be kept this way: its strategy cannot count permits
    (only ``lease`` can), or it was asked of a quorum of databases."""


class GuardNotSupported(StrategyNotSupported):
    """``Lock.guard()`` cannot make writes commit only while this lock is held.

    Raised for locks not kept by a database transaction (``advisory``
    session locks, quorum locks), and for writes to another database than
    the lock's: pass the lock's fence to those writes instead.
    """


class InvalidLockKey(DLockError, ValueError):
    """The key is empty, too long, of a wrong type or out of range."""


class KeyTemplateError(InvalidLockKey):
    """A key template is malformed, or uses more than plain argument names.

    Raised by :func:`~django_dlock.decorators.with_lock` and the lock
    middleware when the template is given, before any request.
    """


class MissingKeyArgument(KeyTemplateError, LookupError):
    """A key template names an argument that the call does not have.

    Raised instead of filling the gap with an empty value, which would make
    every such call share one lock.
    """
