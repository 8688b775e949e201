"""The cells of the contract suite: every strategy on every database it runs on.

A cell is one (strategy, database) pair and says what a test may expect of it
(does a transaction end the holding, are fences numbers, does the server free
the lock when the holder's process dies) and how to look at the server from
outside (who holds a key, how many wait for it). A contract test asks the cell,
never for a strategy by name, so one test runs unchanged on every cell.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import connections, transaction

import django_dlock as dlock
from django_dlock.keys import make_key
from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.advisory.mysql import lock_name
from django_dlock.strategies.connection import close_private_connections

from ..conftest import DB_IDS
from ..helpers import end_server_session, in_thread, pg_locks, wait_until


@dataclass(frozen=True)
class Cell:
    strategy: str
    alias: str
    #: the holding ends with the transaction it was taken in (and only then)
    transactional: bool = False
    #: every grant carries a fencing number (None otherwise)
    fences: bool = False
    #: the server frees the lock the moment the holder's connection goes
    #: (a killed process, a terminated session); a lease waits for its ttl
    freed_by_the_server: bool = True
    #: the holding lives in a server session of its own (advisory locks)
    session: bool = False
    #: a semaphore of this many permits instead of a lock (one permit: a lock)
    permits: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        kind = self.strategy if self.permits is None else f"semaphore{self.permits}"
        return f"{kind}-{DB_IDS[self.alias]}"

    @property
    def namespace(self) -> str:
        return "lock" if self.permits is None else "semaphore"

    def rows(self, key: Any) -> list[str]:
        """The lease rows of ``key``: its own, or a semaphore's permits."""
        name = make_key(key, self.namespace).name
        if self.permits is None:
            return [name]
        return [f"{name}#{i}" for i in range(self.permits)]

    @property
    def vendor(self) -> str:
        return connections[self.alias].vendor

    def lock(self, key: Any, **options: Any) -> dlock.Lock:
        if self.permits is not None:
            return dlock.semaphore(
                key, permits=self.permits, strategy=self.strategy, using=self.alias, **options
            )
        return dlock.lock(key, strategy=self.strategy, using=self.alias, **options)

    @contextlib.contextmanager
    def hold(self, key: Any, **options: Any) -> Iterator[dlock.Lock]:
        """Hold ``key`` the way this strategy is used: in a transaction where it needs one."""
        with self.transaction(), self.lock(key, **options) as lk:
            yield lk

    def transaction(self) -> contextlib.AbstractContextManager[Any]:
        """A transaction where the strategy needs one, nothing otherwise."""
        if self.transactional:
            return transaction.atomic(using=self.alias)
        return contextlib.nullcontext()

    def try_once(self, key: Any, **options: Any) -> bool:
        """In another thread (another holder): could ``key`` be taken now? Gives it back."""

        def attempt() -> bool:
            with self.transaction():
                lk = self.lock(key, **options)
                got = lk.acquire(timeout=0)
                if got and not self.transactional:
                    lk.release()
                return got

        return bool(in_thread(attempt))

    # -- the server, seen from outside -------------------------------------------

    def holders(self, key: Any) -> list[Any] | None:
        """Who holds ``key`` in the database (a session, a token), or None when unseen."""
        if self.strategy == "lease":
            from django_dlock.models import Lock as LockRow

            held = LockRow.objects.using(self.alias).held().filter(name__in=self.rows(key))
            return list(held.values_list("token", "fence"))
        if self.vendor == "postgresql" and self.strategy in ("advisory", "advisory_xact"):
            return [pid for pid, _ in pg_locks(key, alias=self.alias)]
        if self.vendor == "mysql" and self.strategy == "advisory":
            with connections[self.alias].cursor() as cur:
                cur.execute("SELECT IS_USED_LOCK(%s)", [self.server_name(key)])
                found = cur.fetchone()[0]
            return [] if found is None else [int(found)]
        return None  # a row lock is not listed anywhere we can read portably

    def waiters(self, key: Any) -> int | None:
        """How many wait for ``key`` in the database now, or None when unseen."""
        if self.strategy == "lease":
            from django_dlock.models import Waiter

            queue = make_key(key, self.namespace).name
            return Waiter.objects.using(self.alias).filter(name=queue).count()
        if self.vendor == "postgresql" and self.strategy in ("advisory", "advisory_xact"):
            return len(pg_locks(key, alias=self.alias, granted=False))
        if self.vendor == "mysql" and self.strategy == "advisory":
            with connections[self.alias].cursor() as cur:
                cur.execute(
                    "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
                    "WHERE COMMAND = 'Query' AND INFO LIKE %s AND ID <> CONNECTION_ID()",
                    [f"SELECT GET_LOCK('{self.server_name(key)}'%"],
                )
                return int(cur.fetchone()[0])
        return None

    def holder_of(self, lk: dlock.Lock) -> Any:
        """What :meth:`holders` shows for ``lk``'s holding."""
        if self.strategy == "lease":
            return (lk.token, lk.fence)
        if self.session:
            return self.session_of(lk).backend_pid
        return None

    def wait_for_waiters(self, key: Any, count: int) -> None:
        """Until ``count`` callers wait for ``key`` where the server shows it; else a pause."""
        if self.waiters(key) is None:
            time.sleep(0.5)
        else:
            wait_until(lambda: self.waiters(key) == count)

    def server_name(self, key: Any) -> str:
        """The GET_LOCK name of ``key`` on MySQL/MariaDB."""
        return lock_name(connections[self.alias].settings_dict["NAME"], make_key(key).name)

    # -- sessions (advisory) -------------------------------------------------------

    def session_of(self, lk: dlock.Lock) -> Any:
        found = sessions.find(self.alias, lk.token)
        assert found is not None
        return found

    def end_session(self, backend_pid: int) -> None:
        """What an operator or a fail-over does: the server ends the holder's session."""
        end_server_session(self.alias, backend_pid)

    def release_behind_our_back(self, session: Any) -> None:
        """Someone frees every lock of the holder's session, on that session."""
        with session.mutex:
            if self.vendor == "postgresql":
                session.conn.execute("SELECT pg_advisory_unlock_all()")
            else:
                with session.link.raw.cursor() as cur:
                    cur.execute("SELECT RELEASE_ALL_LOCKS()")

    def switch_session(self, session: Any) -> None:
        """What a transaction-mode pooler does: the next statement lands on another session."""
        session.backend_pid = -1
        if hasattr(session, "backend_pid_text"):
            session.backend_pid_text = b"-1"


async def off_the_loop(func: Any, *args: Any) -> Any:
    """``func(*args)`` in a worker thread that closes its connections when done."""

    def run() -> Any:
        try:
            return func(*args)
        finally:
            connections.close_all()

    return await asyncio.to_thread(run)


CELLS = [
    Cell("lease", "default", fences=True, freed_by_the_server=False),
    Cell("lease", "sqlite", fences=True, freed_by_the_server=False),
    Cell("lease", "mysql", fences=True, freed_by_the_server=False),
    Cell("row", "default", transactional=True, fences=True),
    Cell("row", "mysql", transactional=True),  # a number in the row would roll back
    Cell("advisory", "default", session=True),  # fences are opt-in (DLOCK_ADVISORY_FENCING)
    Cell("advisory", "mysql", session=True),
    Cell("advisory_xact", "default", transactional=True),
    # a semaphore of one permit is a lock: every contract holds for it
    Cell("lease", "default", fences=True, freed_by_the_server=False, permits=1),
    Cell("lease", "sqlite", fences=True, freed_by_the_server=False, permits=1),
    Cell("lease", "mysql", fences=True, freed_by_the_server=False, permits=1),
]
BY_ID = {cell.id: cell for cell in CELLS}


def params(cells: list[Cell]) -> list[Any]:
    """One test per cell; each flushes only its own database."""
    return [
        pytest.param(
            cell,
            id=cell.id,
            marks=pytest.mark.django_db(transaction=True, databases=[cell.alias]),
        )
        for cell in cells
    ]


ALL = params(CELLS)
#: the cells of a lock (a semaphore of one permit aside: tests/test_semaphore.py
#: runs its own process test, 8 processes x 100 on three permits)
LOCKS = params([c for c in CELLS if c.permits is None])
#: the cells whose holder releases explicitly (not at the end of a transaction)
RELEASED = params([c for c in CELLS if not c.transactional])
#: the cells whose lock the server frees when the holder's connection goes
FREED_BY_THE_SERVER = params([c for c in CELLS if c.freed_by_the_server])
#: the cells that keep a session per holder
SESSIONS = params([c for c in CELLS if c.session])


class HeldElsewhere:
    """``key`` held by a thread of its own (another holder) until :meth:`release`."""

    def __init__(self, cell: Cell, key: Any, **options: Any) -> None:
        self.cell = cell
        self._acquired = threading.Event()
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(key, options))
        self._thread.start()
        assert self._acquired.wait(30)

    def _run(self, key: Any, options: dict[str, Any]) -> None:
        try:
            with self.cell.hold(key, **options):
                self._acquired.set()
                self._go.wait(120)
        finally:
            close_private_connections()
            connections.close_all()

    def release(self) -> None:
        self._go.set()
        self._thread.join(60)
        assert not self._thread.is_alive()
