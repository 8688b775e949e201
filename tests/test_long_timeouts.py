"""Timeouts longer than any wait can count, on real databases.

``timeout=1e300``, ``float("inf")`` and ``sys.maxsize`` wait forever (like
``None``); a long finite timeout (a month, years) is a deadline waited for in
steps. Either way the acquire works, the connection stays usable for the
next statements, and the statement watchdog still gives up later statements
at their deadlines.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connections, transaction

import django_dlock as dlock
from django_dlock.retry import Deadline
from django_dlock.strategies import connection
from django_dlock.strategies.connection import Abandoned, statement_deadline, watched_raw

from .helpers import give_back_sessions, pg_locks, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

#: forever (over 10**9 seconds), then a month and three years (deadlines past what
#: one poll() or lock_timeout can count)
TIMEOUTS = [1e300, math.inf, sys.maxsize, 30 * 86400, 1e8]
IDS = ["1e300", "inf", "maxsize", "month", "1e8"]


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield
    give_back_sessions()


def _watchdog_serves_a_deadline() -> None:
    """A statement with a deadline that the server does not answer in time is
    given up by the watchdog thread at that deadline."""
    other = connections["default"].copy("default")
    other.ensure_connection()
    raw = other.connection
    start = time.monotonic()
    try:
        with statement_deadline(Deadline(0), "default"), pytest.raises(Abandoned):
            watched_raw(raw, lambda: raw.execute("SELECT pg_sleep(30)"))
    finally:
        other.close()
    assert time.monotonic() - start < 10  # not the 30 s of the statement
    assert connection._watchdog.thread is not None and connection._watchdog.thread.is_alive()


def _normal_calls(alias: str, strategy: str) -> None:
    """Ordinary statements on the thread's connections after the long acquire."""
    with dlock.lock("long:after", strategy=strategy, using=alias, timeout=5) as lk:
        assert lk.owned()
    assert dlock.lock("long:after", using=alias).acquire(timeout=0) is True
    dlock.lock("long:after", using=alias).release()
    with connections[alias].cursor() as cur:
        cur.execute("SELECT 1")
        assert cur.fetchone()[0] == 1


@pytest.mark.parametrize("timeout", TIMEOUTS, ids=IDS)
@pytest.mark.parametrize(
    ("alias", "strategy"),
    [
        ("default", "lease"),
        ("default", "advisory"),
        ("sqlite", "lease"),
        ("mysql", "lease"),
        ("mysql", "advisory"),
    ],
)
def test_a_huge_timeout_acquires_and_leaves_the_connection_usable(alias, strategy, timeout):
    lk = dlock.lock("long:free", strategy=strategy, using=alias, timeout=timeout)
    with lk:
        assert lk.owned()
    assert lk.acquire(timeout=timeout)
    lk.release()
    _normal_calls(alias, strategy)
    if alias == "default":
        _watchdog_serves_a_deadline()


@pytest.mark.parametrize("timeout", TIMEOUTS, ids=IDS)
@pytest.mark.parametrize("strategy", ["row", "advisory_xact"])
def test_a_huge_timeout_in_the_callers_transaction(strategy, timeout):
    with transaction.atomic(), dlock.lock("long:xact", strategy=strategy, timeout=timeout) as lk:
        assert lk.owned()
        with connections["default"].cursor() as cur:
            cur.execute("SELECT 1")
    _normal_calls("default", "lease")
    _watchdog_serves_a_deadline()


def _waiting(alias: str, strategy: str, name: str) -> bool:
    if strategy == "advisory":
        return bool(pg_locks(name, granted=False))
    with connections[alias].cursor() as cur:
        cur.execute("SELECT count(*) FROM django_dlock_waiter WHERE name = %s", [f"lock:{name}"])
        return int(cur.fetchone()[0]) > 0


@pytest.mark.parametrize("two_phase", [False, True], ids=["acquire", "enqueue-wait"])
@pytest.mark.parametrize("timeout", [1e300, sys.maxsize, 1e8], ids=["1e300", "maxsize", "1e8"])
@pytest.mark.parametrize("strategy", ["lease", "advisory"])
def test_a_waiter_with_a_huge_timeout_gets_the_lock_at_release(strategy, timeout, two_phase):
    holder = dlock.lock("long:busy", strategy=strategy)
    assert holder.acquire(timeout=0)
    got: dict[str, Any] = {}

    def wait() -> None:
        try:
            lk = dlock.lock("long:busy", strategy=strategy, timeout=timeout)
            if two_phase:
                assert lk.enqueue() is False
                assert lk.wait(timeout)
            else:
                assert lk.acquire()
            with lk:  # (re-entered, then released twice)
                got["owned"] = lk.owned()
            lk.release()
        except BaseException as exc:  # reported below
            got["error"] = exc
        finally:
            connections.close_all()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        wait_until(lambda: _waiting("default", strategy, "long:busy") or not waiter.is_alive())
    finally:
        holder.release()
        waiter.join(30)
    assert not waiter.is_alive()
    assert got == {"owned": True}
