"""Prometheus metrics (``DLOCK_METRICS = "prometheus"``) in prometheus_client's default registry."""

from __future__ import annotations

import sys
import threading

import pytest
from django.core import checks
from django.test import override_settings
from prometheus_client import REGISTRY, generate_latest

import django_dlock as dlock
from django_dlock import metrics, signals
from django_dlock import operations as override
from django_dlock.checks import check_metrics

from .helpers import in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def acquires(strategy: str, outcome: str) -> float:
    return sample("dlock_acquire_seconds_count", strategy=strategy, outcome=outcome)


@pytest.fixture
def on():
    with override_settings(DLOCK_METRICS="prometheus"):
        assert metrics.observer is not None
        yield
    assert metrics.observer is None


def test_off_by_default_nothing_is_connected_or_counted(alias):
    assert metrics.observer is None
    with override_settings(DLOCK_METRICS="prometheus"):
        pass  # registers the metrics once, then switches them off again
    receivers = [signals.lock_acquired, signals.lock_released, signals.lock_lost]
    assert not any(s.has_listeners() for s in receivers)
    before = acquires("lease", "acquired"), sample("dlock_held_seconds_count", strategy="lease")
    with dlock.lock("metrics-off", using=alias):
        pass
    after = acquires("lease", "acquired"), sample("dlock_held_seconds_count", strategy="lease")
    assert after == before


def test_acquired_and_held_are_observed(on, alias):
    acquired = acquires("lease", "acquired")
    held = sample("dlock_held_seconds_count", strategy="lease")
    lk = dlock.lock("metrics-a", using=alias)
    with lk, lk:  # a re-entry is no second acquisition
        pass
    assert acquires("lease", "acquired") == acquired + 1
    assert sample("dlock_held_seconds_count", strategy="lease") == held + 1


def test_skipped_timeout_and_error_outcomes(on, alias):
    holder = dlock.lock("metrics-b", using=alias)
    holder.acquire()
    try:
        skipped, timed_out = acquires("lease", "skipped"), acquires("lease", "timeout")
        assert in_thread(lambda: dlock.lock("metrics-b", using=alias).acquire(timeout=0)) is False
        assert acquires("lease", "skipped") == skipped + 1

        @dlock.lock("metrics-b", using=alias, timeout=0, on_fail="skip")
        def job() -> str:
            return "ran"

        assert in_thread(job) is None
        assert acquires("lease", "skipped") == skipped + 2
        waiting = dlock.lock("metrics-b", using=alias, retry_interval=0.01)
        assert in_thread(lambda: waiting.acquire(timeout=0.2)) is False
        assert acquires("lease", "timeout") == timed_out + 1
        assert acquires("lease", "skipped") == skipped + 2
        errors = acquires("lease", "error")
        with pytest.raises(dlock.LockReentrantError):
            dlock.lock("metrics-b", using=alias, reentrant=False).acquire()
        assert acquires("lease", "error") == errors + 1
    finally:
        holder.release()


def test_a_tasklock_skip_is_skipped(on):
    task = dlock.TaskLock("metrics-task", min_hold=60)
    assert task.run(lambda: "ran") == "ran"
    skipped = acquires("lease", "skipped")
    assert task.run(lambda: "ran") is None  # ran less than min_hold ago
    assert acquires("lease", "skipped") == skipped + 1


def test_lost_is_counted(on):
    lk = dlock.lock("metrics-lost", ttl=300)
    lk.acquire()
    lost = sample("dlock_lost_total", strategy="lease")
    override.force_release("default", names=["lock:metrics-lost"])
    with pytest.raises(dlock.LockLost):
        lk.release()
    assert sample("dlock_lost_total", strategy="lease") == lost + 1


def test_waiters_gauge_counts_blocked_callers(on):
    holder = dlock.lock("metrics-w")
    holder.acquire()
    base = sample("dlock_waiters")
    done = threading.Event()

    def wait() -> None:
        with dlock.lock("metrics-w", timeout=30, retry_interval=0.01):
            done.set()

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: sample("dlock_waiters") == base + 2)
        in_thread(lambda: dlock.lock("metrics-w").acquire(timeout=0))  # a try is no waiter
        assert sample("dlock_waiters") == base + 2
    finally:
        holder.release()
        for thread in threads:
            thread.join(30)
    assert done.is_set()
    assert sample("dlock_waiters") == base


def test_async_acquire_is_observed(on):
    from asgiref.sync import async_to_sync

    async def take() -> None:
        async with dlock.lock("metrics-async"):
            pass

    acquired = acquires("lease", "acquired")
    async_to_sync(take)()
    assert acquires("lease", "acquired") == acquired + 1


def test_the_exposition_shows_the_four_metrics(on):
    with dlock.lock("metrics-text"):
        pass
    text = generate_latest(REGISTRY).decode()
    for line in (
        "# TYPE dlock_acquire_seconds histogram",
        "# TYPE dlock_held_seconds histogram",
        "# TYPE dlock_lost_total counter",
        "# TYPE dlock_waiters gauge",
        'dlock_acquire_seconds_count{outcome="acquired",strategy="lease"}',
    ):
        assert line in text


def test_check_e040_invalid_setting():
    for value in ("statsd", True, "Prometheus"):
        with override_settings(DLOCK_METRICS=value):
            assert [m.id for m in check_metrics()] == ["dlock.E040"]
            assert metrics.observer is None  # an invalid value leaves metrics off
    with override_settings(DLOCK_METRICS="prometheus"):
        assert check_metrics() == []
    assert check_metrics() == []


def test_check_e041_prometheus_client_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    with override_settings(DLOCK_METRICS="prometheus"):
        found = check_metrics()
        assert metrics.observer is None
    assert [m.id for m in found] == ["dlock.E041"] and found[0].level == checks.ERROR
