"""What the hot path remembers between calls, and that it never stands in for the database.

A lock remembers a few answers that do not change between calls (a key's
validation and hash, whether a database can do a strategy, whether advisory
locks take fencing numbers) so that an uncontended acquire + release costs
little more than its SQL. These tests pin what must still hold: answers per
key, per namespace and per database, settings overridden in tests, signals
for receivers connected at any time.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import pytest
from django.db import transaction
from django.test.utils import override_settings

import django_dlock as dlock
from django_dlock import locks, signals
from django_dlock.conf import conf
from django_dlock.exceptions import InvalidLockKey
from django_dlock.keys import make_key
from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.connection import close_private_connections

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


@pytest.fixture(autouse=True)
def _tidy():
    yield
    sessions.close_all()
    close_private_connections()


def test_a_key_used_again_is_the_same_key_in_its_own_namespace():
    first = make_key("hot:1")
    assert make_key("hot:1") == first
    assert make_key("hot:1", "task").name == "task:hot:1"
    assert make_key("hot:1", "task").advisory != first.advisory
    assert make_key("hot:1").name == "lock:hot:1"


@pytest.mark.parametrize("bad", ["", "x" * 300, "nul\x00"])
def test_a_bad_key_is_refused_every_time(bad):
    for _ in range(2):
        with pytest.raises(InvalidLockKey):
            make_key(bad)


def test_an_unknown_namespace_is_refused_for_a_key_already_made():
    make_key("hot:ns")
    with pytest.raises(ValueError, match="unknown namespace"):
        make_key("hot:ns", "nope")


def test_a_strategy_a_database_cannot_do_is_refused_at_every_call():
    with transaction.atomic(), dlock.lock("hot:db", strategy="advisory_xact", timeout=0) as lk:
        assert lk.held()
    for _ in range(2):
        with pytest.raises(dlock.StrategyNotSupported, match="needs PostgreSQL"):
            dlock.lock("hot:db", strategy="advisory", using="sqlite").acquire()
    # ... and PostgreSQL still can, after the refusals
    with dlock.lock("hot:db", strategy="advisory", timeout=0) as lk:
        assert lk.held()


def test_advisory_fencing_follows_override_settings():
    with dlock.lock("hot:fence", strategy="advisory", timeout=0) as lk:
        assert lk.fence is None
    with override_settings(DLOCK_ADVISORY_FENCING=True):
        with dlock.lock("hot:fence", strategy="advisory", timeout=0) as lk:
            assert isinstance(lk.fence, int)
        with transaction.atomic(), dlock.lock("hot:fence", strategy="advisory_xact") as lk:
            assert isinstance(lk.fence, int)
    with dlock.lock("hot:fence", strategy="advisory", timeout=0) as lk:
        assert lk.fence is None


def test_a_setting_the_lock_has_read_follows_override_settings():
    with dlock.lock("hot:setting", timeout=0):
        assert conf.LEASE_SYNCHRONOUS_COMMIT is True  # read, and kept
    with override_settings(DLOCK_LEASE_SYNCHRONOUS_COMMIT=False):
        assert conf.LEASE_SYNCHRONOUS_COMMIT is False
        with dlock.lock("hot:setting", timeout=0) as lk:
            assert lk.held()
    assert conf.LEASE_SYNCHRONOUS_COMMIT is True


@pytest.mark.parametrize("strategy", ["lease", "advisory"])
def test_an_uncontended_pair_raises_nothing_in_its_own_code_or_settings(strategy):
    """A raised and caught exception costs about as much client time as a
    dozen calls (a setting the project does not have, read through Django's
    settings, raises AttributeError at every read)."""
    with dlock.lock("hot:quiet", strategy=strategy, timeout=0):
        pass  # (first use: connections, prepared statements, settings read)
    raised: list[str] = []

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "exception" and arg[0] is not StopIteration:  # (a coroutine's end, traced)
            where = frame.f_code.co_filename
            if "django_dlock" in where or "django/conf" in where:
                raised.append(f"{arg[0].__name__} in {frame.f_code.co_name} ({where})")
        return trace

    sys.settrace(trace)
    try:
        with dlock.lock("hot:quiet", strategy=strategy, ttl=60, timeout=0):
            pass
    finally:
        sys.settrace(None)
    assert raised == []


def test_signals_reach_a_receiver_connected_after_locks_were_used():
    with dlock.lock("hot:signal", strategy="advisory", timeout=0):
        pass
    seen: list[tuple[str, str]] = []

    def acquired(sender, name, **kwargs):
        seen.append(("acquired", name))

    def released(sender, name, **kwargs):
        seen.append(("released", name))

    signals.lock_acquired.connect(acquired)
    signals.lock_released.connect(released)
    try:
        with dlock.lock("hot:signal", strategy="advisory", timeout=0):
            pass
    finally:
        signals.lock_acquired.disconnect(acquired)
        signals.lock_released.disconnect(released)
    assert seen == [("acquired", "lock:hot:signal"), ("released", "lock:hot:signal")]


def test_the_package_hands_out_the_lock_function_itself():
    assert dlock.lock is locks.lock
    assert dlock.Lock is locks.Lock


def test_the_thread_connection_is_djangos_in_threads_and_under_an_event_loop():
    import asyncio
    import threading

    from django.db import connections

    from django_dlock.strategies.connection import thread_connection

    assert thread_connection("default") is connections["default"]
    seen = {}

    def other_thread():
        try:
            seen["thread"] = (thread_connection("default"), connections["default"])
        finally:
            connections.close_all()

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    mine, django_s = seen["thread"]
    assert mine is django_s and mine is not connections["default"]

    async def in_loop():
        # under a running loop, asgiref keeps connections per context: no shortcut
        return thread_connection("default"), connections["default"]

    mine, django_s = asyncio.run(in_loop())
    assert mine is django_s
