"""Timeouts longer than any wait can count: no database, real threads and sockets.

A timeout over ``MAX_SECONDS`` (``float("inf")`` and ``sys.maxsize`` too)
waits forever, like ``None``; a long finite one is waited for in steps; the
statement watchdog survives anything and keeps firing the watches that are due.
"""

from __future__ import annotations

import math
import select
import socket
import sys
import threading
import time

import pytest

from django_dlock.retry import Deadline
from django_dlock.strategies import connection
from django_dlock.strategies.connection import statement_deadline
from django_dlock.validation import MAX_SECONDS, timeout_error


@pytest.mark.parametrize("timeout", [1e300, math.inf, sys.maxsize, 2**200, MAX_SECONDS * 1.5])
def test_a_timeout_longer_than_any_wait_waits_forever(timeout):
    assert timeout_error(timeout) is None  # accepted...
    deadline = Deadline(timeout)
    assert deadline.timeout is None and deadline.end == math.inf  # ...as "wait forever"
    assert statement_deadline(deadline, "default").end is None  # no statement is given up


@pytest.mark.parametrize("timeout", [0, 2.5, 30 * 86400, MAX_SECONDS])
def test_a_timeout_up_to_the_limit_is_a_deadline(timeout):
    deadline = Deadline(timeout)
    assert deadline.timeout == timeout
    assert deadline.end == pytest.approx(deadline.start + timeout)


@pytest.mark.parametrize("left", [30 * 86400, MAX_SECONDS])
def test_a_statement_with_a_far_deadline_is_waited_for_in_steps(left):
    # poll() counts milliseconds in a C int (about 24 days): a wait longer
    # than that must not raise OverflowError with the statement in flight
    ours, peer = socket.socketpair()
    try:
        done = threading.Timer(0.2, peer.send, [b"x"])
        done.start()
        connection._ready(ours.fileno(), select.POLLIN, time.monotonic() + left)
        assert ours.recv(1) == b"x"
    finally:
        ours.close()
        peer.close()


def _fired(at: float) -> tuple[connection._Watch, socket.socket, socket.socket]:
    """A watch due at ``at`` on one end of a socket pair (a statement's socket)."""
    ours, peer = socket.socketpair()
    watch = connection._Watch(ours, at, cancel=False)
    connection._watchdog.add(watch)
    return watch, ours, peer


@pytest.mark.parametrize("far", [1e300, math.inf, float(sys.maxsize), 1e12])
def test_the_watchdog_survives_a_watch_due_in_ages_and_serves_the_next(far):
    far_watch, far_socket, far_peer = _fired(time.monotonic() + far)
    watch, ours, peer = _fired(time.monotonic() + 0.2)
    try:
        ours.settimeout(30)
        # the due watch shuts the statement's socket down: its read returns
        assert ours.recv(1) == b""
        assert watch.finished is not None and watch.finished.wait(30)
        assert connection._watchdog.thread is not None
        assert connection._watchdog.thread.is_alive()
        assert not far_watch.fired
    finally:
        connection._watchdog.finish(far_watch)
        connection._watchdog.finish(watch)
        for sock in (far_socket, far_peer, ours, peer):
            sock.close()


def test_an_error_in_the_watchdog_is_logged_and_it_carries_on(monkeypatch, caplog):
    fire = connection._fire
    failures: list[connection._Watch] = []

    def fails_once(watch: connection._Watch) -> None:
        if failures:
            fire(watch)
            return
        failures.append(watch)
        assert watch.finished is not None
        watch.finished.set()  # (what _fire promises a waiting statement, whatever happens)
        raise RuntimeError("a bug in the watchdog")

    monkeypatch.setattr(connection, "_fire", fails_once)
    broken, broken_socket, broken_peer = _fired(time.monotonic())
    watch, ours, peer = _fired(time.monotonic() + 0.2)
    try:
        ours.settimeout(30)
        assert ours.recv(1) == b""  # the next watch still fires
        assert failures == [broken]
        assert connection._watchdog.thread is not None
        assert connection._watchdog.thread.is_alive()
        assert "the statement watchdog failed" in caplog.text
    finally:
        for sock in (broken_socket, broken_peer, ours, peer):
            sock.close()
