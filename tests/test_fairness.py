"""Fair waiting on the lease strategy, with real processes, on all three databases.

The order of arrival is made certain without timing: a waiter is started
only once the previous one's ticket is in the queue table. The grants are
then recorded by the waiters themselves (an appended line each), so the
order they were granted in is read back, never inferred from clocks.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from multiprocessing.process import BaseProcess

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import cleanup
from django_dlock.dbclock import now_sql
from django_dlock.strategies import queue

from . import procs
from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

WAITERS = 5


def _live_tickets(alias: str, name: str) -> list[int]:
    connection = connections[alias]
    with connection.cursor() as cur:
        cur.execute(
            "SELECT id FROM django_dlock_waiter WHERE name = %s "
            f"AND expire_at > {now_sql(connection)} ORDER BY id",
            [name],
        )
        return [int(row[0]) for row in cur.fetchall()]


def _all_tickets(alias: str, name: str) -> list[int]:
    with connections[alias].cursor() as cur:
        cur.execute("SELECT id FROM django_dlock_waiter WHERE name = %s ORDER BY id", [name])
        return [int(row[0]) for row in cur.fetchall()]


def _waiter(alias: str, key: str, index: int, log_path: str, hold_until: str | None) -> None:
    lk = dlock.lock(key, using=alias, ttl=60, timeout=120, retry_interval=0.02)
    with lk:
        with open(log_path, "a") as log:
            log.write(f"{index} {lk.fence}\n")
        while hold_until is not None and not os.path.exists(hold_until):
            time.sleep(0.01)


def _read_log(path: str) -> list[tuple[int, int]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(a), int(b)) for a, b in (line.split() for line in f if line.strip())]


def _tickets_are(alias: str, name: str, count: int) -> bool:
    return len(_live_tickets(alias, name)) == count


def _start_in_order(
    alias: str, lk: dlock.Lock, count: int, log: str, hold: str | None
) -> list[BaseProcess]:
    started = []
    for index in range(count):
        started.append(procs.start(_waiter, alias, lk.name[len("lock:") :], index, log, hold))
        wait_until(functools.partial(_tickets_are, alias, lk.name, index + 1), timeout=60)
    return started


def _join(started: list[BaseProcess]) -> None:
    for proc in started:
        proc.join(120)
        assert proc.exitcode == 0, f"waiter exited with {proc.exitcode}"


@pytest.mark.slow
def test_grants_follow_arrival_order(alias, tmp_path):
    log = str(tmp_path / "grants")
    holder = dlock.lock("fifo", using=alias, ttl=60)
    assert holder.acquire(timeout=0)
    started = _start_in_order(alias, holder, WAITERS, log, None)
    holder.release()
    _join(started)
    grants = _read_log(log)
    assert [index for index, _ in grants] == list(range(WAITERS))
    fences = [fence for _, fence in grants]
    assert fences == sorted(fences) and len(set(fences)) == WAITERS
    assert _all_tickets(alias, holder.name) == []


@pytest.mark.slow
def test_try_once_does_not_barge_past_waiters(alias, tmp_path):
    log, hold = str(tmp_path / "grants"), str(tmp_path / "hold")
    holder = dlock.lock("nobarge", using=alias, ttl=60)
    assert holder.acquire(timeout=0)
    started = _start_in_order(alias, holder, 1, log, hold)
    holder.release()
    # Whether or not the waiter has taken it yet, a try-once must not get
    # it: a ticket is waiting, or the waiter holds it (until told to stop).
    assert not dlock.lock("nobarge", using=alias).acquire(timeout=0)
    # Neither does the previous holder, trying again at once.
    assert not holder.acquire(timeout=0)
    wait_until(lambda: len(_read_log(log)) == 1, timeout=60)
    open(hold, "w").close()
    _join(started)


@pytest.mark.slow
def test_newcomer_with_a_timeout_queues_behind(alias, tmp_path):
    log = str(tmp_path / "grants")
    holder = dlock.lock("behind", using=alias, ttl=60)
    assert holder.acquire(timeout=0)
    started = _start_in_order(alias, holder, 2, log, None)
    # A third waiter arrives last; it is granted last.
    late = procs.start(_waiter, alias, "behind", 2, log, None)
    wait_until(lambda: len(_live_tickets(alias, holder.name)) == 3, timeout=60)
    holder.release()
    _join([*started, late])
    assert [index for index, _ in _read_log(log)] == [0, 1, 2]


@pytest.mark.slow
def test_a_killed_waiter_is_skipped(alias, tmp_path):
    log = str(tmp_path / "grants")
    holder = dlock.lock("killed", using=alias, ttl=60)
    assert holder.acquire(timeout=0)
    started = _start_in_order(alias, holder, 2, log, None)
    first_ticket = _live_tickets(alias, holder.name)[0]
    assert started[0].pid is not None
    os.kill(started[0].pid, signal.SIGKILL)
    started[0].join(30)
    holder.release()
    # The second waiter gets the lock once the dead one's ticket runs out
    # (a bound, not a measurement: the ticket lives queue.ticket_ttl()).
    wait_until(lambda: len(_read_log(log)) == 1, timeout=queue.ticket_ttl() * 4 + 30)
    assert [index for index, _ in _read_log(log)] == [1]
    _join(started[1:])
    # The dead ticket is left behind until cleanup removes it.
    assert _all_tickets(alias, holder.name) == [first_ticket]
    assert cleanup.delete_dead_waiters(alias) == 1
    assert _all_tickets(alias, holder.name) == []
