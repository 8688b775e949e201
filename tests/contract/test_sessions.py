"""Locks that live in a server session (advisory locks), on every database that has them.

The server frees such a lock the moment its session ends; the holder must
learn of it (``lock_lost``, ``on_lost``, ``LockLost`` from release or from
leaving the block), never hold it twice, and never share a session with
another holder.
"""

from __future__ import annotations

import gc

import pytest

import django_dlock as dlock
from django_dlock import signals

from ..helpers import in_thread, run_threads, wait_until
from .cells import SESSIONS

#: what the error says when the server session changed under us
SWITCHED = {"postgresql": "PgBouncer", "mysql": "proxy"}


@pytest.mark.parametrize("cell", SESSIONS)
def test_holders_never_share_a_session(cell):
    with cell.lock("a") as mine:
        own = cell.session_of(mine).backend_pid

        def hold_b() -> int:
            with cell.lock("b") as theirs:
                assert cell.lock("a").acquire(timeout=0) is False
                return cell.session_of(theirs).backend_pid

        assert in_thread(hold_b) != own
        with cell.lock("c"):  # the same holder keeps all its locks on one session
            assert cell.holders("c") == [own]
    pids: dict[str, int] = {}
    import threading

    both = threading.Barrier(2)

    def hold(key: str) -> None:
        with cell.lock(key) as lk:
            pids[key] = cell.session_of(lk).backend_pid
            both.wait(30)  # both hold at once

    run_threads(hold, [("one",), ("two",)])
    assert pids["one"] != pids["two"]


@pytest.mark.parametrize("cell", SESSIONS)
def test_a_session_the_server_ends_is_reported_lost_and_frees_the_lock(cell):
    lost: list[dlock.LockLost] = []
    signalled: list[tuple[str, str]] = []

    def receiver(sender, name, strategy, reason, **kwargs):
        signalled.append((name, strategy))

    signals.lock_lost.connect(receiver)
    try:
        lk = cell.lock("victim", on_lost=lost.append)
        lk.acquire()
        cell.end_session(cell.session_of(lk).backend_pid)
        # The watcher notices the closed session without a statement of ours,
        # and reports it (lost is set first, then the signal and the callback).
        wait_until(lambda: lk.lost and bool(lost), timeout=30)
        assert len(lost) == 1 and isinstance(lost[0], dlock.LockLost)
        assert signalled == [(f"{cell.namespace}:victim", cell.strategy)]
        assert not lk.held() and not lk.owned()
        assert cell.try_once("victim") is True  # the server freed it with the session
        with pytest.raises(dlock.LockLost):
            lk.release()
        with lk:  # the same holder starts again on a new session
            assert lk.owned()
    finally:
        signals.lock_lost.disconnect(receiver)


@pytest.mark.parametrize("how", ["release", "leave"])
@pytest.mark.parametrize("cell", SESSIONS)
def test_a_loss_is_found_by_the_holder_without_the_watcher(cell, how):
    lk = cell.lock("quiet")
    lk.acquire()
    session = cell.session_of(lk)
    with session.mutex:  # keep the watcher away, as if it had not looked yet
        cell.end_session(session.backend_pid)
        wait_until(lambda: cell.holders("quiet") == [])
    with pytest.raises(dlock.LockLost):
        if how == "release":
            lk.release()
        else:
            lk.__exit__(None, None, None)
    assert cell.try_once("quiet") is True


@pytest.mark.parametrize("cell", SESSIONS)
def test_a_release_behind_our_back_is_never_ignored(cell):
    lk = cell.lock("unlocked")
    lk.acquire()
    cell.release_behind_our_back(cell.session_of(lk))
    assert not lk.owned()
    with pytest.raises(dlock.LockLost):
        lk.release()


@pytest.mark.parametrize("cell", SESSIONS)
def test_a_switched_server_session_is_refused(cell):
    keep = cell.lock("kept")
    keep.acquire()
    cell.switch_session(cell.session_of(keep))
    with pytest.raises(dlock.DLockError, match=SWITCHED[cell.vendor]):
        cell.lock("next").acquire(timeout=0)
    assert keep.lost  # what the session held is reported lost
    with pytest.raises(dlock.LockLost):
        keep.release()
    assert cell.try_once("kept") is True and cell.try_once("next") is True


@pytest.mark.parametrize("cell", SESSIONS)
def test_a_thread_that_ends_holding_frees_its_locks(cell):
    in_thread(lambda: cell.lock("leaked").acquire())
    gc.collect()
    wait_until(lambda: cell.holders("leaked") == [], timeout=30)
    assert not cell.lock("leaked").locked()
    assert cell.try_once("leaked") is True
