"""What the library logs and counts at the edges: hostile names, queued
waiters ahead of a free key, cancelled async acquires."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.test import override_settings
from prometheus_client import REGISTRY

import django_dlock as dlock
from django_dlock import metrics

pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "django_dlock"]


def test_a_control_character_in_a_name_cannot_forge_a_log_line(caplog):
    name = "job\n2026-01-01 INFO django-dlock: FORGED\x1b[2K"
    caplog.set_level(logging.DEBUG, logger="django_dlock")
    lk = dlock.lock(name, ttl=30)
    with lk:
        busy = threading.Thread(target=lambda: dlock.lock(name).acquire(timeout=0))
        busy.start()
        busy.join(30)
    logged = messages(caplog)
    assert any("acquired" in m for m in logged)
    assert any("gave up" in m for m in logged)
    assert any("released" in m for m in logged)
    for message in logged:
        assert "\n" not in message and "\x1b" not in message, message
        assert "FORGED" in message  # the name is there, escaped: nothing is hidden


def test_a_printable_name_is_logged_as_it_is(caplog):
    caplog.set_level(logging.DEBUG, logger="django_dlock")
    with dlock.lock("plain:name"):
        pass
    assert any("acquired lock:plain:name (" in m for m in messages(caplog))


def test_a_free_key_kept_by_queued_waiters_is_not_called_held(caplog):
    """Only the ticket of a waiter ahead keeps a newcomer out: the message says so."""
    name = "log-queued-ahead"
    holder = dlock.lock(name, ttl=30)
    assert holder.acquire(timeout=0)
    queued, go = threading.Event(), threading.Event()
    results: list[bool] = []

    def waiter() -> None:
        lk = dlock.lock(name)
        results.append(lk.enqueue())  # False: a ticket in the queue, kept alive
        queued.set()
        go.wait(30)
        results.append(lk.wait(timeout=10))
        lk.release()

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert queued.wait(30)
        holder.release()  # free now; the waiter's ticket stays ahead
        caplog.set_level(logging.INFO, logger="django_dlock")
        assert not dlock.lock(name).acquire(timeout=0)
    finally:
        go.set()
        thread.join(30)
    assert results == [False, True]
    warned = [m for m in messages(caplog) if "gave up" in m]
    assert len(warned) == 1
    assert "other waiters are queued ahead" in warned[0], warned
    assert "held by someone else" not in warned[0]


def test_a_held_key_is_still_called_held(caplog):
    caplog.set_level(logging.INFO, logger="django_dlock")
    with dlock.lock("log-held"):
        thread = threading.Thread(target=lambda: dlock.lock("log-held").acquire(timeout=0))
        thread.start()
        thread.join(30)
    assert any("log-held is held by someone else; gave up" in m for m in messages(caplog))


def acquires(outcome: str) -> float:
    labels = {"strategy": "lease", "outcome": outcome}
    return REGISTRY.get_sample_value("dlock_acquire_seconds_count", labels) or 0.0


def waiters() -> float:
    return REGISTRY.get_sample_value("dlock_waiters") or 0.0


def test_a_cancelled_async_acquire_is_counted_cancelled_not_error():
    name = "metrics-cancelled"
    with override_settings(DLOCK_METRICS="prometheus"):
        assert metrics.observer is not None
        before = acquires("cancelled"), acquires("error")

        async def cancel_a_waiting_acquire() -> None:
            base = waiters()
            task = asyncio.ensure_future(dlock.lock(name, timeout=30).aacquire())
            give_up = time.monotonic() + 30
            while waiters() <= base:  # its ticket is in the queue: it waits
                assert time.monotonic() < give_up and not task.done()
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        with dlock.lock(name, ttl=30):
            async_to_sync(cancel_a_waiting_acquire)()
        assert acquires("cancelled") == before[0] + 1
        assert acquires("error") == before[1]
        assert not dlock.lock(name).locked()  # the cancelled acquire left nothing held


#: "contention ... at INFO" in a sentence, "| `INFO` | contention: ..." in a table
CONTENTION_LEVEL = re.compile(
    r"contention\b[^.|]*?\bat `?(DEBUG|INFO|WARNING|ERROR)\b"
    r"|\| `(DEBUG|INFO|WARNING|ERROR)` \| contention"
)


def test_the_pages_state_the_level_contention_is_logged_at(caplog):
    """views.md once said WARNING while the code logged INFO: each page that
    states contention's level states the one a timed-out acquire logs at."""
    caplog.set_level(logging.DEBUG, logger="django_dlock")
    with dlock.lock("log-level"):
        thread = threading.Thread(target=lambda: dlock.lock("log-level").acquire(timeout=0))
        thread.start()
        thread.join(30)
    (record,) = [r for r in caplog.records if "gave up" in r.getMessage()]
    root = Path(__file__).resolve().parent.parent
    stated = {
        page.name: [
            "".join(found) for found in CONTENTION_LEVEL.findall(" ".join(page.read_text().split()))
        ]
        for page in sorted((root / "docs").glob("*.md"))
    }
    stated = {name: levels for name, levels in stated.items() if levels}
    assert {"views.md", "signals.md", "troubleshooting.md"} <= set(stated)
    assert {name: set(levels) for name, levels in stated.items()} == {
        name: {record.levelname} for name in stated
    }
