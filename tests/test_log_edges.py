"""What the library logs and counts at the edges: hostile names, queued
waiters ahead of a free key, cancelled async acquires."""

from __future__ import annotations

import logging
import threading

import pytest

import django_dlock as dlock

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
