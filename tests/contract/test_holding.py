"""Holding, on every cell: state, re-entry and several keys at once."""

from __future__ import annotations

import threading

import pytest
from django.db import connections

import django_dlock as dlock

from ..helpers import in_thread, pg_locks
from .cells import ALL, RELEASED, HeldElsewhere


@pytest.mark.parametrize("cell", RELEASED)
def test_acquire_release_and_state(cell):
    lk = cell.lock("state", ttl=30)
    assert not lk.locked() and not lk.owned() and not lk.held()
    assert lk.acquire(timeout=0) is True
    assert lk.locked() and lk.owned() and lk.held()
    assert lk.name == f"{cell.namespace}:state"
    assert cell.holders("state") == [cell.holder_of(lk)]
    if cell.vendor == "postgresql" and cell.session:
        assert [mode for _, mode in pg_locks("state", alias=cell.alias)] == ["ExclusiveLock"]
    assert (lk.fence is not None) is cell.fences
    assert cell.try_once("state") is False
    lk.release()
    assert not lk.locked() and not lk.owned() and not lk.held() and lk.fence is None
    assert cell.holders("state") == []
    assert cell.try_once("state") is True
    with pytest.raises(dlock.LockNotOwned):
        lk.release()
    if cell.strategy != "lease":  # no lease row is written
        from django_dlock.models import Lock as LockRow

        assert not LockRow.objects.using(cell.alias).filter(name="lock:state").exists()


@pytest.mark.parametrize("cell", ALL)
def test_reentry_is_counted_by_the_holder_and_held_once_in_the_database(cell):
    with cell.transaction():
        outer = cell.lock("re")
        with outer:
            fence = outer.fence
            with cell.lock("re") as inner:  # another Lock object, the same holder
                assert inner.held() and inner.fence == fence
                with inner, outer:
                    pass
            assert outer.owned()
            assert cell.try_once("re") is False  # still held after the inner blocks
            if cell.holders("re") is not None:
                assert len(cell.holders("re")) == 1  # one lock in the database
            with pytest.raises(dlock.LockReentrantError):
                cell.lock("re", reentrant=False).acquire(timeout=0)
            assert outer.owned()
        if not cell.transactional:
            assert cell.try_once("re") is True
            # explicit acquires are counted too: the last release frees it
            for _ in range(3):
                assert outer.acquire(timeout=0)
            outer.release()
            outer.release()
            assert cell.try_once("re") is False
            outer.release()
    assert cell.try_once("re") is True


@pytest.mark.parametrize("cell", ALL)
def test_many_keys_all_or_none(cell):
    holder = HeldElsewhere(cell, "b")
    try:

        def all_three() -> bool:
            with cell.transaction():
                return cell.lock(["a", "b", "c"]).acquire(timeout=0)

        assert in_thread(all_three) is False
        if cell.holders("a") is not None:
            assert cell.holders("a") == [] and cell.holders("c") == []  # given back
        assert cell.try_once("a") is True and cell.try_once("c") is True
    finally:
        holder.release()
    with cell.hold(["b", "a", "a", "c"]) as lk:
        assert list(lk.fences) == [f"{cell.namespace}:{k}" for k in "abc"]
        assert not any(cell.try_once(k) for k in "abc")
        holders = [cell.holders(k) for k in "abc"]
        if holders[0] is not None:
            # one holder for all (a lease row shows (token, fence): the token)
            ids = {h[0] if isinstance(h, tuple) else h for found in holders for h in found}
            assert len(ids) == 1
        with pytest.raises(dlock.DLockError, match="fences"):
            _ = lk.fence
        with cell.lock(["d", "b"]):  # "b" is re-entered, "d" is taken
            assert cell.try_once("d") is False
    assert all(cell.try_once(k) for k in "abcd")


@pytest.mark.parametrize("cell", ALL)
def test_many_keys_in_opposite_orders_do_not_deadlock(cell):
    def loop(keys: list[str]) -> None:
        try:
            for _ in range(30):
                with cell.hold(keys, timeout=60, retry_interval=0.005):
                    pass
        finally:
            connections.close_all()

    threads = [threading.Thread(target=loop, args=(k,)) for k in (["x", "y"], ["y", "x"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
