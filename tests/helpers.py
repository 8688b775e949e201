"""Small helpers shared by the tests (no mocking of the database)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

import django_dlock as dlock
from django_dlock import dbclock
from django_dlock.keys import make_key, pg_locks_ids
from django_dlock.strategies.connection import close_private_connections


def in_thread(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``func`` in a new thread (a different lock holder) and return its result."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = func(*args, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "thread did not finish"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def run_threads(
    func: Callable[..., Any], arg_lists: list[tuple[Any, ...]], timeout: float = 300
) -> None:
    """Run ``func(*args)`` in one thread per entry, all at once.

    Each thread closes its database connections when it ends. Re-raises the
    first error of any thread; fails if a thread has not finished in time.
    """
    errors: list[BaseException] = []

    def run(*args: Any) -> None:
        try:
            func(*args)
        except BaseException as exc:
            errors.append(exc)
        finally:
            close_private_connections()
            connections.close_all()

    threads = [threading.Thread(target=run, args=args) for args in arg_lists]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def expire_now(alias: str, name: str) -> None:
    """End a lease at once, on the database clock (as if its TTL ran out)."""
    connection = connections[alias]
    now = dbclock.now_plus_sql(connection)
    with connection.cursor() as cur:
        cur.execute(f"UPDATE django_dlock_lock SET expire_at = {now} WHERE name = %s", [-1.0, name])
        assert cur.rowcount == 1


def row(alias: str, name: str) -> tuple[str, int] | None:
    """(token, fence) of the row ``name``, or None."""
    with connections[alias].cursor() as cur:
        cur.execute("SELECT token, fence FROM django_dlock_lock WHERE name = %s", [name])
        found = cur.fetchone()
    return None if found is None else (found[0], int(found[1]))


def publish(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` whole: another process that sees the file
    exist reads all of it, even if the writer is paused or killed right after
    (written beside it, then renamed into place)."""
    part = f"{os.fspath(path)}.part"
    with open(part, "w") as f:
        f.write(text)
    os.replace(part, path)


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait (bounded) for ``predicate``: a wait, not an assertion on speed."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached within the bound")
        time.sleep(0.02)


def end_server_session(alias: str, backend_pid: int) -> None:
    """What an operator or a fail-over does: the server of ``alias`` ends the
    session ``backend_pid`` (PostgreSQL ``pg_terminate_backend``, MySQL/MariaDB
    ``KILL``), waited for until the server no longer lists it.

    Both return before the session has ended (MariaDB's killed thread still
    holds its ``GET_LOCK`` locks for a moment); its locks are freed as it
    ends, before the server stops listing it.
    """
    with connections[alias].cursor() as cur:
        if connections[alias].vendor == "postgresql":
            cur.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
            listed = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
        else:
            cur.execute("KILL %s", [backend_pid])
            listed = "SELECT count(*) FROM information_schema.processlist WHERE id = %s"

    def gone() -> bool:
        with connections[alias].cursor() as cur:
            cur.execute(listed, [backend_pid])
            return cur.fetchone()[0] == 0

    wait_until(gone, timeout=30)


def pg_locks(key: Any, *, alias: str = "default", granted: bool | None = True) -> list[Any]:
    """(pid, mode) of the advisory locks on ``key`` (a key or a made one) in the
    test database of ``alias``; ``granted=None``: granted or waiting."""
    classid, objid, objsubid = pg_locks_ids(make_key(key) if not hasattr(key, "name") else key)
    sql = (
        "SELECT pid, mode FROM pg_locks WHERE locktype = 'advisory' AND database = "
        "(SELECT oid FROM pg_database WHERE datname = current_database()) AND "
        "classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = %s"
    )
    params: list[Any] = [classid, objid, objsubid]
    if granted is not None:
        sql += " AND granted = %s"
        params.append(granted)
    with connections[alias].cursor() as cur:
        cur.execute(sql, params)
        return sorted(cur.fetchall())


def give_back_sessions() -> None:
    """After a test: no advisory session of this process may still hold a lock
    (threads that ended are buried by the watcher); close them all."""
    from django_dlock.strategies.advisory import sessions

    gc.collect()
    wait_until(lambda: not sessions.holding_sessions(), timeout=30)
    sessions.close_all()
    close_private_connections()


class HeldInThread:
    """A thread of its own that acquires ``lk`` (a lock, a read lock, a
    semaphore's permit) and holds it until :meth:`release`; ``fence`` is the
    number it was granted. A loss while it holds is no error here (some
    tests take the lock away)."""

    def __init__(self, lk: Any) -> None:
        self.acquired = threading.Event()
        self.go = threading.Event()
        self.fence: int | None = None
        self.lk = lk

        def run() -> None:
            try:
                with contextlib.suppress(dlock.LockLost), lk:
                    self.fence = lk.fence
                    self.acquired.set()
                    self.go.wait(60)
            finally:
                close_private_connections()
                connections.close_all()

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def wait(self) -> HeldInThread:
        """Return once it holds the lock (bounded: fails if it never does)."""
        assert self.acquired.wait(30)
        return self

    def release(self) -> None:
        self.go.set()
        self.thread.join(30)
        assert not self.thread.is_alive()
