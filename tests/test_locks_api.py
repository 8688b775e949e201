"""The front object as decorator, its signals, and identity after fork."""

from __future__ import annotations

import asyncio
import os

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import identity, signals

from .helpers import in_thread

pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])


@dlock.lock
def bare_decorated():
    return dlock.lock(f"{__name__}.bare_decorated").owned()


@dlock.lock(timeout=0)
def decorated(x):
    return x * 2


def test_decorator_default_key_is_module_qualname():
    assert bare_decorated() is True
    assert decorated(21) == 42
    assert not dlock.lock(f"{__name__}.decorated").locked()


def test_decorator_skip_sends_lock_skipped():
    skipped = []

    def receiver(sender, name, reason, **kwargs):
        skipped.append(name)

    calls = []

    @dlock.lock("nightly", timeout=0, on_fail="skip")
    def nightly():
        calls.append(1)
        return "ran"

    signals.lock_skipped.connect(receiver)
    try:
        with dlock.lock("nightly"):
            assert in_thread(nightly) is None
        assert nightly() == "ran"
    finally:
        signals.lock_skipped.disconnect(receiver)
    assert calls == [1] and skipped == ["lock:nightly"]


def test_decorator_raise_mode():
    @dlock.lock("busy", timeout=0)
    def job():
        return 1

    with dlock.lock("busy"), pytest.raises(dlock.LockTimeout):
        in_thread(job)


def test_async_decorator():
    @dlock.lock("async-job", timeout=0, on_fail="skip")
    async def job():
        return dlock.lock("async-job").held()

    async def main():
        result = await job()
        from asgiref.sync import sync_to_async

        await sync_to_async(connections.close_all)()
        return result

    assert asyncio.run(main()) is True


def test_acquired_and_released_signals_carry_timings():
    events = []

    def on_acquired(sender, name, strategy, fence, wait, **kw):
        events.append(("acquired", name, strategy, wait >= 0, fence))

    def on_released(sender, name, strategy, held, **kw):
        events.append(("released", name, strategy, held >= 0))

    signals.lock_acquired.connect(on_acquired)
    signals.lock_released.connect(on_released)
    try:
        with dlock.lock("signalled") as lk:
            fence = lk.fence
    finally:
        signals.lock_acquired.disconnect(on_acquired)
        signals.lock_released.disconnect(on_released)
    assert events == [
        ("acquired", "lock:signalled", "lease", True, fence),
        ("released", "lock:signalled", "lease", True),
    ]


def test_properties_answer_for_the_calling_holder():
    lk = dlock.lock("shared-object")
    with lk:
        assert lk.fence is not None and lk.held()
        assert in_thread(lambda: (lk.fence, lk.held(), lk.lost)) == (None, False, False)
        assert in_thread(lambda: lk.token) != lk.token
    assert lk.fence is None
    assert repr(lk) == "<Lock lock:shared-object strategy=lease>"


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_worker_identity_and_holdings_are_renewed_after_fork():
    parent_bits = identity.worker().bits
    with dlock.lock("forked"):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: new identity, holds nothing
            ok = identity.worker().bits != parent_bits and not identity.current_holder().holdings
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
    assert answer == b"1"


def test_a_loss_reported_through_the_holder_reaches_the_lock_that_holds_the_slot():
    lost: list[Exception] = []
    lk = dlock.lock("reported", on_lost=lost.append)
    holder = identity.current_holder()
    with pytest.raises(dlock.LockLost), lk:
        (holding,) = lk._holdings()
        slot = (lk.alias, "lease", "lock:reported")
        assert holder.holdings[slot] is holding
        assert holder.losses[slot] == holding.mark_lost
        assert holder.report_lost(slot, "the session ended") is True
        assert lk.lost
    assert [str(e) for e in lost] == ["lock 'lock:reported' was lost: the session ended"]
    # released: nobody hears that slot any more, and the key can be taken again
    assert slot not in holder.losses and slot not in holder.holdings
    assert holder.report_lost(slot, "too late") is False
    with lk:
        assert not lk.lost
    assert len(lost) == 1


def test_not_owned_names_the_thread_or_task_that_asked():
    lk = dlock.lock("api-not-owned")
    with pytest.raises(dlock.LockNotOwned, match="not held by this thread 'MainThread'"):
        lk.release()
    with pytest.raises(dlock.LockNotOwned, match="not held by this thread 'MainThread'"):
        lk.extend()

    async def in_a_task() -> None:
        with pytest.raises(dlock.LockNotOwned, match="not held by this task 'releaser'"):
            await lk.arelease()
        with pytest.raises(dlock.LockNotOwned, match="not held by this task 'releaser'"):
            await lk.aextend()

    async def main() -> None:
        await asyncio.create_task(in_a_task(), name="releaser")

    asyncio.run(main())
