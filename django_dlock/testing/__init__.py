"""Helpers for testing your own code against django-dlock's locks.

Assertions, another holder, and the faults that make a held lock lost, so
that your tests can reach the ``on_lost`` and ``guard()`` paths of your
code::

    from django_dlock import testing as dlock_testing

    with dlock_testing.held_elsewhere("nightly-report"):   # another holder
        assert nightly_report() is None                    # your code skipped
    dlock_testing.assert_not_locked("nightly-report")

    lk = dlock.lock("import", ttl=60)
    with lk:
        dlock_testing.expire(lk)       # the lease runs out now (database clock)
        ...                            # your code finds the loss

A *target* is a lock object (``lock()``, ``semaphore()``, ``TaskLock``, ...)
or a key, which means ``dlock.lock(key)``. Every helper works on the
database the lock uses (``using``, else the router's), on the real
database: nothing is mocked. For pytest, ``django_dlock.testing.fixtures``
closes the library's connections after each test (see the Testing page).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

from django.db import connections

from django_dlock.exceptions import DLockError
from django_dlock.locks import Lock
from django_dlock.strategies.connection import close_private_connections

__all__ = [
    "assert_locked",
    "assert_not_locked",
    "end_session",
    "expire",
    "force_release",
    "held_elsewhere",
    "reset",
]

Target = Any  # a Lock object (of any kind) or a key of ``dlock.lock()``


def _lock(target: Target, using: str | None) -> Lock:
    if isinstance(target, Lock):
        return target
    return Lock(target, using=using)


def _rows(lk: Lock) -> list[tuple[str, str, Any]]:
    """The lease rows of ``lk``'s keys (a semaphore's: its permits): name,
    owner, live on the database clock."""
    from django_dlock.models import Lock as LockRow
    from django_dlock.operations import annotate_state

    found = []
    for key in lk.keys:
        permit = re.compile(re.escape(key.name) + r"#\d+")
        rows = LockRow.objects.using(lk.alias).filter(name__startswith=key.name)
        for row in annotate_state(rows):
            if row.name == key.name or permit.fullmatch(row.name):
                found.append((row.name, row.owner, bool(row.db_held)))  # type: ignore[attr-defined]
    return found


def assert_locked(target: Target, *, using: str | None = None) -> None:
    """Fail unless ``target`` is locked now (a semaphore: all its permits held).

    Raises:
        AssertionError: it is not, with what the database shows.
    """
    lk = _lock(target, using)
    if not lk.locked():
        held = [f"{name} ({owner})" for name, owner, live in _rows(lk) if live]
        shows = f"; held: {', '.join(held)}" if held else ""
        raise AssertionError(f"{lk.name} is not locked in {lk.alias!r}{shows}")


def assert_not_locked(target: Target, *, using: str | None = None) -> None:
    """Fail if ``target`` is locked now, naming its holders where the database shows them.

    Raises:
        AssertionError: it is locked.
    """
    lk = _lock(target, using)
    if lk.locked():
        held = [f"{name} by {owner or 'an unnamed holder'}" for name, owner, live in _rows(lk)]
        shows = f": {', '.join(held)}" if held else ""
        raise AssertionError(f"{lk.name} is locked in {lk.alias!r}{shows}")


@contextlib.contextmanager
def held_elsewhere(
    target: Target, *, using: str | None = None, timeout: float = 10
) -> Iterator[Lock]:
    """Hold ``target`` from another thread (another holder) for the block.

    Locks are re-entrant per thread, so a test that wants to see what its
    code does while *someone else* holds a lock needs another holder: this
    one acquires in a thread of its own, and releases (and closes the
    thread's connections) when the block ends.

    Raises:
        AssertionError: the other holder could not acquire within ``timeout``.
    """
    lk = _lock(target, using)
    acquired, done = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def hold() -> None:
        try:
            if lk.acquire(timeout=timeout):
                acquired.set()
                done.wait()
                with contextlib.suppress(DLockError):
                    lk.release()
        except BaseException as exc:  # reported to the test below
            failed.append(exc)
        finally:
            close_private_connections()
            connections.close_all()

    thread = threading.Thread(target=hold, name="django-dlock-held-elsewhere", daemon=True)
    thread.start()
    try:
        if not acquired.wait(timeout + 5):
            done.set()
            thread.join(timeout)
            why = f": {failed[0]!r}" if failed else ""
            raise AssertionError(f"another holder could not acquire {lk.name}{why}")
        yield lk
    finally:
        done.set()
        thread.join(timeout + 5)


def expire(target: Target, *, using: str | None = None) -> int:
    """End the leases of ``target`` now, on the database clock, as if their
    holders had stopped renewing (a semaphore: every permit). The holder's
    next ``owned()``, ``extend()``, ``release()`` or ``guard()`` finds the
    lock lost ("its lease expired"). Returns how many leases ended.

    Raises:
        DLockError: ``target`` is not a lease lock (``end_session`` ends an
            advisory lock; ``row`` and ``advisory_xact`` end with their
            transaction).
    """
    from django_dlock import dbclock
    from django_dlock.models import Lock as LockRow

    lk = _lock(target, using)
    if not lk._options().strategy.leased:
        raise DLockError(
            f"expire() ends leases; {lk.name} is a {lk.strategy_name} lock "
            "(end an advisory lock's session with end_session())"
        )
    names = [name for name, _, live in _rows(lk) if live]
    connection = connections[lk.alias]
    now, live = dbclock.now_sql(connection), dbclock.live_row_sql(connection)
    table = LockRow._meta.db_table
    ended = 0
    with connection.cursor() as cur:
        for name in names:
            cur.execute(
                f"UPDATE {table} SET expire_at = {now} WHERE name = %s AND {live}",
                [name],
            )
            ended += cur.rowcount
    return ended


def force_release(target: Target, *, using: str | None = None) -> int:
    """Force-release ``target``'s leases as an operator would (the admin action,
    ``dlock_release``): the ``lock_force_released`` signal is sent with
    ``source="test"``, waiters are woken, and the holder's next statement
    finds the lock lost. Returns how many leases were released."""
    from django_dlock import operations

    lk = _lock(target, using)
    names = [name for name, _, live in _rows(lk) if live]
    if not names:
        return 0
    return len(operations.force_release(lk.alias, names=names, source="test"))


def end_session(target: Target, *, using: str | None = None) -> None:
    """End the database session that holds the calling thread's (or task's)
    ``advisory`` lock ``target``, as a fail-over or an operator's
    ``pg_terminate_backend`` / ``KILL`` would: the server frees the lock at
    once, and the holder finds it lost (its session watcher reports it).

    Raises:
        DLockError: the caller holds no advisory session for ``target``.
    """
    from django_dlock.strategies.advisory import sessions

    lk = _lock(target, using)
    session = sessions.find(lk.alias, lk.token)
    if session is None:
        raise DLockError(f"the caller holds no advisory session for {lk.name} in {lk.alias!r}")
    connection = connections[lk.alias]
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute("SELECT pg_terminate_backend(%s)", [session.backend_pid])
        else:
            cur.execute("KILL %s", [session.backend_pid])


def reset(using: str | None = None) -> None:
    """Delete every lease row and waiter ticket of ``using`` (the router's
    database by default), and close the library's connections: for the
    tear-down of a test whose locks committed outside its transaction (a
    Django ``TestCase``)."""
    import django_dlock
    from django_dlock.conf import lock_alias
    from django_dlock.models import Lock as LockRow
    from django_dlock.models import Waiter

    alias = using or lock_alias()
    django_dlock.close_connections()
    Waiter.objects.using(alias).all().delete()
    LockRow.objects.using(alias).all().delete()
