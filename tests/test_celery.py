"""Single-instance Celery tasks with real ``celery worker`` and ``celery beat`` processes.

The broker is the RabbitMQ server on 127.0.0.1:5672; every run uses a queue
of its own, so parallel runs never take each other's tasks. Workers and
beats run in their own process groups, killed at the end even on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
QUEUE = f"dlock-test-{uuid.uuid4().hex[:12]}"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


class Processes:
    """Celery processes of one test and the log they all write."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DLOCK_TEST_CHILD": "1",
            "DLOCK_CELERY_QUEUE": QUEUE,
            "DLOCK_CELERY_LOG": str(self.log),
            "PYTHONPATH": str(ROOT),
            **extra,
        }

    def start(self, *args: str, **env: str) -> subprocess.Popen[bytes]:
        out = open(self.log.with_suffix(f".{len(self.procs)}.out"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.celery_app", *args],
            cwd=ROOT,
            env=self.env(**env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, with its pool children
        )
        out.close()
        self.procs.append(proc)
        return proc

    def worker(self, concurrency: int = 3) -> subprocess.Popen[bytes]:
        ready = self.count("ready")
        proc = self.start(
            "worker",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            f"--queues={QUEUE}",
            f"--hostname={QUEUE}-{len(self.procs)}@%h",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "--loglevel=INFO",
        )
        wait_until(lambda: self.count("ready") > ready, timeout=60)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def kill_all(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                self.kill(proc)

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [line.split() for line in self.log.read_text().splitlines()]

    def count(self, *words: str) -> int:
        return sum(1 for line in self.lines() if line[: len(words)] == list(words))

    def output(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.log.parent.glob("*.out")))


def require_broker() -> None:
    """A missing RabbitMQ FAILS the test with a clear message; it is never skipped."""
    import socket

    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=5).close()
    except OSError as exc:
        pytest.fail(
            f"RabbitMQ is not reachable on 127.0.0.1:5672 ({exc}): start it "
            "(apt-get install rabbitmq-server; service rabbitmq-server start)",
            pytrace=False,
        )


@pytest.fixture
def celery(tmp_path: Path) -> Iterator[Processes]:
    require_broker()
    os.environ["DLOCK_CELERY_QUEUE"] = QUEUE  # for the app imported by this process
    os.environ["DLOCK_CELERY_LOG"] = str(tmp_path / "celery.log")
    procs = Processes(tmp_path / "celery.log")
    try:
        yield procs
    finally:
        procs.kill_all()
        os.environ.pop("DLOCK_CELERY_LOG", None)


def tasks():
    from tests import celery_app

    celery_app.LOG = os.environ["DLOCK_CELERY_LOG"]
    return celery_app


def lease(name: str):
    from django_dlock.models import Lock as LockRow

    return LockRow.objects.filter(name=f"lock:{name}").first()


def test_concurrent_calls_skip_or_retry_one_run_at_a_time(celery):
    app = tasks()
    celery.worker(concurrency=4)
    for _ in range(8):
        app.exclusive.apply_async(("k1", 0.6), queue=QUEUE)
    wait_until(lambda: celery.count("start", "k1") + celery.count("skip") == 8, timeout=60)
    wait_until(lambda: celery.count("end", "k1") == celery.count("start", "k1"))
    runs, skips = celery.count("start", "k1"), celery.count("skip")
    assert celery.count("OVERLAP") == 0, celery.output()
    assert runs >= 1 and skips >= 1, (runs, skips)  # 4 processes took them at once
    assert all(
        line[1] == 'lock:celery:tests.celery_app.exclusive:"k1"'
        for line in celery.lines()
        if line[0] == "skip"
    )

    # on_locked="retry": every call runs, one at a time, after retries.
    for _ in range(4):
        app.exclusive_retry.apply_async(("k2", 0.3), queue=QUEUE)
    wait_until(lambda: celery.count("end", "k2") == 4, timeout=60)
    assert celery.count("start", "k2") == 4
    assert celery.count("retry") >= 1
    assert celery.count("OVERLAP") == 0 and celery.count("failure") == 0, celery.output()
    # "end" is logged as the body ends, just before the task releases its lock
    wait_until(lambda: not lease('celery:tests.celery_app.exclusive_retry:"k2"').token)


def test_lock_permits_lets_that_many_runs_run_at_once(celery):
    """``lock_permits=2``: two runs of the task at once across the worker's
    processes, never three; the other calls are skipped."""
    app = tasks()
    celery.worker(concurrency=4)
    for _ in range(8):
        app.limited.apply_async(("k9", 0.8), queue=QUEUE)
    wait_until(lambda: celery.count("inside", "k9") + celery.count("skip") == 8, timeout=60)
    wait_until(lambda: celery.count("end", "k9") == celery.count("inside", "k9"))
    most = max(int(line[2]) for line in celery.lines() if line[:2] == ["inside", "k9"])
    assert most == 2, celery.output()
    assert celery.count("skip") >= 1
    assert all(
        line[1] == 'semaphore:celery:tests.celery_app.limited:"k9"'
        for line in celery.lines()
        if line[0] == "skip"
    )


def test_the_lease_is_renewed_while_a_task_runs_past_its_ttl(celery):
    app = tasks()
    celery.worker(concurrency=2)
    app.slow.apply_async(("k3", 4.0), queue=QUEUE)  # lock_ttl=1.0
    wait_until(lambda: celery.count("start", "k3") == 1, timeout=30)
    held = lease('celery:tests.celery_app.slow:"k3"')
    # Four half-second steps after the start: twice the TTL has gone by.
    wait_until(lambda: celery.count("step", "3") == 1, timeout=30)
    name = 'celery:tests.celery_app.slow:"k3"'
    assert lease(name).token == held.token
    import django_dlock as dlock

    assert dlock.lock(name).locked()
    app.slow.apply_async(("k3", 0.0), queue=QUEUE)  # a second call meanwhile: skipped
    wait_until(lambda: celery.count("skip") == 1, timeout=30)
    wait_until(lambda: celery.count("end", "k3") == 1, timeout=30)
    wait_until(lambda: not lease(name).token)  # released by the task, not expired
    assert lease(name).fence == held.fence
    assert celery.count("failure") == 0 and celery.count("OVERLAP") == 0, celery.output()


def test_a_killed_workers_lock_is_freed_by_its_ttl(celery):
    import django_dlock as dlock

    app = tasks()
    worker = celery.worker(concurrency=1)
    app.slow.apply_async(("k4", 60.0), queue=QUEUE)  # lock_ttl=1.0, renewed
    wait_until(lambda: celery.count("step", "1") == 1, timeout=30)
    name = 'celery:tests.celery_app.slow:"k4"'
    assert dlock.lock(name).locked()
    celery.kill(worker)  # SIGKILL to the worker and its pool: nothing releases
    wait_until(lambda: not dlock.lock(name).locked(), timeout=30)
    assert lease(name).token  # it ran out (expired); it was never released
    Path(f"{celery.log}.k4.inside").unlink()  # the killed run's own marker
    assert app.slow("k4", 0.5) == "k4"  # the next call runs (here, in this process)
    assert celery.count("start", "k4") == 2


def test_beat_processes_send_a_once_per_task_but_it_runs_once(celery):
    """Three real ``celery beat`` processes send ``digest`` every 0.5 s; it has
    ``once_per=600`` (a TaskLock): one run, every other delivery skipped."""
    celery.worker(concurrency=3)
    for n in range(3):
        celery.start(
            "beat",
            f"--schedule={celery.log.parent / f'beat-{n}'}",
            f"--pidfile={celery.log.parent / f'beat-{n}.pid'}",
            "--loglevel=INFO",
            DLOCK_CELERY_BEAT_EVERY="0.5",
        )
    wait_until(lambda: celery.count("beat") == 3, timeout=60)
    wait_until(lambda: celery.count("skip", "task:celery:tests.celery_app.digest") >= 6, timeout=60)
    for proc in celery.procs[1:]:
        celery.kill(proc)  # the beats
    assert celery.count("start", "digest") == 1, celery.output()
    assert celery.count("OVERLAP") == 0 and celery.count("failure") == 0


def test_bad_options_are_named_before_any_sql(django_assert_num_queries):
    from celery import Celery

    from django_dlock.contrib.celery import SingleInstanceTask

    app = Celery("bad-options", set_as_current=False)

    @app.task(base=SingleInstanceTask, lock_args=["invoice"])
    def charge(invoice_id: int) -> None: ...

    @app.task(base=SingleInstanceTask, on_locked="wait")
    def sync() -> None: ...

    @app.task(base=SingleInstanceTask, once_per=60, on_locked="retry")
    def digest() -> None: ...

    @app.task(base=SingleInstanceTask, once_per=60, lock_permits=2)
    def report() -> None: ...

    @app.task(base=SingleInstanceTask, lock_permits=0)
    def export() -> None: ...

    with django_assert_num_queries(0):
        with pytest.raises(ValueError, match=r"lock_args .* 'invoice', which is not an argument"):
            charge(42)
        with pytest.raises(ValueError, match='on_locked .* must be "skip" or "retry"'):
            sync()
        with pytest.raises(ValueError, match="once_per .* cannot be combined"):
            digest()
        with pytest.raises(ValueError, match="lock_permits cannot be combined"):
            report()
        with pytest.raises(ValueError, match="permits must be between 1 and 1000"):
            export()


def worker_of(celery: Processes, pid: int) -> subprocess.Popen[bytes]:
    """The worker (process group) whose pool process ``pid`` is."""
    return next(p for p in celery.procs if os.getpgid(pid) == p.pid)


def test_an_acks_late_task_killed_mid_run_runs_again_once_its_lease_ran_out(celery):
    """The worker running an ``acks_late`` task is killed (SIGKILL): RabbitMQ
    redelivers the message at once to the other worker, which finds the dead
    run's lease still held (5 s). It waits for that lease to run out and runs
    the task to the end, instead of skipping (and acknowledging) it."""
    app = tasks()
    celery.worker(concurrency=1)
    celery.worker(concurrency=1)
    hold = Path(f"{celery.log}.k5.hold")
    hold.touch()
    app.late.apply_async(("k5",), queue=QUEUE)
    wait_until(lambda: celery.count("step", "k5", "1") == 1, timeout=30)
    name = 'celery:tests.celery_app.late:"k5"'
    first = lease(name)
    pid = int(next(line for line in celery.lines() if line[:2] == ["start", "k5"])[-1])
    celery.kill(worker_of(celery, pid))  # SIGKILL mid-run: nothing releases, nothing acks
    Path(f"{celery.log}.k5.inside").unlink()  # the killed run's own marker
    hold.unlink()  # the next run ends at once
    wait_until(lambda: celery.count("end", "k5") == 1 or celery.count("skip") > 0, timeout=60)
    assert celery.count("skip") == 0, celery.output()  # the redelivery was not skipped
    assert celery.count("start", "k5") == 2
    assert celery.count("OVERLAP") == 0 and celery.count("failure") == 0, celery.output()
    wait_until(lambda: not lease(name).token)  # released by the second run
    assert lease(name).fence > first.fence  # a new lease: the dead one had run out


def test_arguments_whose_text_collided_run_under_distinct_keys(celery):
    """``("x:y", "z")`` and ``("x", "y:z")`` (and ``1``/``"1"``) were one key:
    the second call, while the first ran, was skipped."""
    app = tasks()
    celery.worker(concurrency=4)
    hold = Path(f"{celery.log}.pair.hold")
    hold.touch()
    calls = [("x:y", "z"), ("x", "y:z"), (None, 1), ("None", "1")]
    for args in calls:
        app.pair.apply_async(args, queue=QUEUE)
    wait_until(lambda: celery.count("pair") + celery.count("skip") == len(calls), timeout=60)
    hold.unlink()
    assert celery.count("skip") == 0, celery.output()
    assert sorted(line[1] for line in celery.lines() if line[0] == "pair") == sorted(
        json.dumps(list(args), separators=(",", ":")) for args in calls
    )
