"""TaskLock: try once, skip when held, keep the lease for min_hold (database clock)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections

import django_dlock as dlock
from django_dlock import signals
from django_dlock.models import Lock as LockRow

from . import procs
from .helpers import expire_now, in_thread, row, wait_until
from .jobs import fire_task, hold_task_forever

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def lease_seconds(alias: str, name: str) -> tuple[float, float, str]:
    """(expire_at - acquired_at, expire_at - now) in seconds on the database clock, token."""
    from django_dlock.dbclock import DbNow

    acquired_at, expire_at, now, token = (
        LockRow.objects.using(alias)
        .filter(name=name)
        .annotate(db_now=DbNow())
        .values_list("acquired_at", "expire_at", "db_now", "token")
        .get()
    )
    return (expire_at - acquired_at).total_seconds(), (expire_at - now).total_seconds(), token


@pytest.fixture
def skipped():
    seen: list[dict] = []

    def receiver(sender, **kwargs):
        seen.append({"sender": sender, **kwargs})

    signals.lock_skipped.connect(receiver)
    yield seen
    signals.lock_skipped.disconnect(receiver)


def test_decorator_runs_once_then_skips_until_min_hold_passes(alias, skipped, caplog):
    calls: list[int] = []

    # min_hold long enough for a loaded machine; its end is brought forward
    # on the database clock below
    @dlock.TaskLock("digest", min_hold=60, max_hold=90, using=alias)
    def send_digest(n: int) -> int:
        calls.append(n)
        return n * 10

    assert send_digest(1) == 10
    with caplog.at_level("INFO", logger="django_dlock"):
        assert send_digest(2) is None  # the same thread: min_hold still runs
    assert in_thread(send_digest, 3) is None  # another holder: skipped too
    assert calls == [1]
    assert [s["name"] for s in skipped] == ["task:digest", "task:digest"]
    assert all(s["sender"] is dlock.TaskLock and s["reason"] == "held" for s in skipped)
    assert "skipped task task:digest" in caplog.text
    expire_now(alias, "task:digest")  # min_hold has passed
    assert in_thread(send_digest, 4) == 40
    assert calls == [1, 4]


def test_min_hold_is_kept_on_the_database_clock(alias):
    task = dlock.TaskLock("clocked", min_hold=120, max_hold=600, using=alias)
    assert task.run(lambda: None) is None  # ran (returns the function's None)
    held_for, left, token = lease_seconds(alias, "task:clocked")
    assert held_for == pytest.approx(120, abs=0.002)  # acquired_at + min_hold exactly
    assert 100 < left <= 120
    assert token == ""  # nobody owns it; it is simply not free yet
    assert task.locked() and not task.held()
    assert in_thread(lambda: task.run(lambda: "ran")) is None


def test_max_hold_is_the_lease_while_running(alias):
    task = dlock.TaskLock("bounded", min_hold=1, max_hold=90, using=alias)

    def body() -> float:
        held_for, _, token = lease_seconds(alias, "task:bounded")
        assert token == task.token and task.fence == row(alias, "task:bounded")[1]
        return held_for

    assert task.run(body) == pytest.approx(90, abs=0.002)


def test_a_run_longer_than_min_hold_frees_the_lock_on_exit(alias):
    task = dlock.TaskLock("slow", min_hold=0.1, max_hold=30, using=alias)
    assert task.run(time.sleep, 0.3) is None
    _, left, _ = lease_seconds(alias, "task:slow")
    assert left <= 0
    assert in_thread(lambda: task.run(lambda: "again")) == "again"


def test_min_hold_zero_frees_on_exit_and_fences_increase(alias):
    task = dlock.TaskLock("free", using=alias)
    fences = [task.run(lambda: task.fence) for _ in range(3)]
    assert all(f is not None for f in fences)
    assert fences == sorted(fences) and len(set(fences)) == 3


def test_with_form_says_whether_to_run(alias, skipped):
    task = dlock.TaskLock("with-form", min_hold=60, max_hold=120, using=alias)
    ran = []
    with task as acquired:
        assert acquired is True
        assert in_thread(lambda: task.__enter__()) is False
        ran.append("first")
    with task as acquired:
        assert acquired is False
        assert not task.held()
    assert ran == ["first"]
    assert len(skipped) == 2


def test_exception_in_the_body_still_keeps_min_hold(alias):
    task = dlock.TaskLock("boom", min_hold=60, max_hold=120, using=alias)
    with pytest.raises(RuntimeError), task as acquired:
        assert acquired
        raise RuntimeError("job failed")
    held_for, left, token = lease_seconds(alias, "task:boom")
    assert held_for == pytest.approx(60, abs=0.002) and left > 0 and token == ""
    assert task.run(lambda: "again") is None


def test_extend_for_a_long_run(alias):
    task = dlock.TaskLock("long", min_hold=1, max_hold=5, using=alias)
    with task as acquired:
        assert acquired
        task.extend(300)
        _, left, _ = lease_seconds(alias, "task:long")
        assert left > 250


def test_default_name_is_module_qualname(alias):
    @dlock.TaskLock(min_hold=60, max_hold=60, using=alias)
    def nightly() -> str:
        return "done"

    assert nightly() == "done"
    assert row(alias, f"task:{__name__}.{nightly.__qualname__}") is not None
    assert nightly() is None


def test_namespaces_do_not_collide(alias):
    with dlock.TaskLock("shared-name", max_hold=30, using=alias) as acquired:
        assert acquired
        assert in_thread(lambda: dlock.lock("shared-name", using=alias).acquire(timeout=0))


def test_async_forms(alias):
    task = dlock.TaskLock("async-task", min_hold=60, max_hold=120, using=alias)

    @dlock.TaskLock("async-decorated", min_hold=60, max_hold=120, using=alias)
    async def decorated() -> str:
        await asyncio.sleep(0)
        return "ran"

    async def body() -> str:
        return "body"

    async def main() -> tuple:
        first = await decorated()
        second = await decorated()
        async with task as acquired:
            inside = acquired
        async with task as again:
            inside_again = again
        ran = await dlock.TaskLock("async-run", max_hold=30, using=alias).arun(body)
        await sync_to_async(connections.close_all)()
        return first, second, inside, inside_again, ran

    assert asyncio.run(main()) == ("ran", None, True, False, "body")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_hold": -1}, "min_hold"),
        ({"min_hold": 10, "max_hold": 5}, "must not exceed max_hold"),
        ({"max_hold": 0}, "max_hold"),
        ({"min_hold": "1"}, "min_hold must be a number"),
        ({"max_hold": float("inf")}, "max_hold"),
    ],
)
def test_bad_arguments(options, message):
    with pytest.raises(ValueError, match=message):
        dlock.TaskLock("bad", **options)


def test_bad_name():
    with pytest.raises(dlock.InvalidLockKey):
        dlock.TaskLock("")


@pytest.mark.slow
def test_four_processes_run_the_job_at_most_once_per_min_hold(alias, tmp_path):
    """4 processes fire every 0.2 s for 5 s with min_hold=1 (database clock)."""
    min_hold, every, duration = 1.0, 0.2, 5.0
    path = str(tmp_path / "runs.jsonl")
    start_at = time.time() + 8.0  # after every process has started Django
    procs.run_all(
        fire_task,
        [(alias, path, start_at, duration, every, min_hold, 30.0)] * 4,
        timeout=120,
    )
    with open(path) as f:
        runs = sorted((json.loads(line) for line in f), key=lambda r: r["acquired_at"])
    assert len(runs) >= 3
    for run in runs:
        assert run["now"] >= run["acquired_at"]
    for before, after in zip(runs, runs[1:], strict=False):
        # at most once per min_hold, on the database clock (exact: one clock)
        assert after["acquired_at"] - before["acquired_at"] >= min_hold - 1e-6
        assert after["fence"] > before["fence"]
        # at least once per min_hold + one firing interval (plus slack for a
        # busy machine: a bound, not a speed measurement)
        assert after["acquired_at"] - before["acquired_at"] <= min_hold + every + 1.0
    assert len({run["pid"] for run in runs}) >= 1


@pytest.mark.slow
def test_a_crashed_holder_is_freed_by_max_hold(alias, tmp_path):
    marker = str(tmp_path / "marker")
    proc = procs.start(hold_task_forever, alias, marker, 2.0)
    try:
        wait_until(lambda: _read(marker) == "acquired", 60)
        held_for, _, _ = lease_seconds(alias, "task:crashing")
        assert held_for == pytest.approx(2.0, abs=0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        task = dlock.TaskLock("crashing", max_hold=2.0, using=alias)
        assert task.run(lambda: "ran") is None  # still held by the dead process
        wait_until(lambda: task.run(lambda: "ran") == "ran", 2.0 + 10)
    finally:
        if proc.is_alive():
            proc.kill()


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def test_decorated_function_is_safe_to_share_between_threads(alias):
    calls: list[str] = []
    barrier = threading.Barrier(4)

    @dlock.TaskLock("shared", min_hold=60, max_hold=60, using=alias)
    def job() -> None:
        calls.append(threading.current_thread().name)

    def fire() -> None:
        barrier.wait()
        job()
        connections.close_all()

    threads = [threading.Thread(target=fire) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(calls) == 1
