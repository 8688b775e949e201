"""4. Leader failover: how long until a standby leads after the leader dies.

Three ``manage.py runworker`` processes campaign in one election. The leader
is killed (SIGKILL: a crash) or stopped (SIGTERM: it steps down), and the
time from the signal to another worker's ``became leader`` line is measured
(median of several). A replacement worker keeps three in the race.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
TIMING = {"lease": 4.0, "renew_deadline": 3.0, "retry": 0.5}


def noop() -> None:
    """The job of the benchmark's workers: leadership is what is measured."""


class _Worker:
    def __init__(self, strategy: str, election: str) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.benchmarks.settings",
            "PYTHONPATH": ROOT,
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable, "-m", "django", "runworker",
            "--job", "tests.benchmarks.failover.noop", "--interval", "60",
            "--election", election, "--strategy", strategy,
            "--lease", str(TIMING["lease"]), "--renew-deadline", str(TIMING["renew_deadline"]),
            "--retry", str(TIMING["retry"]),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT
        )
        self.led_at: float | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("became leader"):
                self.led_at = time.monotonic()
            if line.startswith(("became leader", "standing by")):
                self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@dataclass
class Failover:
    strategy: str
    signal: str
    median_s: float
    samples: list[float]


def measure(strategy: str, signum: int, kills: int = 5) -> Failover:
    election = f"bench-{strategy}-{signum}-{os.getpid()}"
    workers = [_Worker(strategy, election) for _ in range(3)]
    samples: list[float] = []
    try:
        for worker in workers:
            worker.ready.wait(60)
        while len(samples) < kills:
            leader = _wait_for_leader(workers)
            others = [w for w in workers if w is not leader]
            for worker in others:
                worker.led_at = None
            sent = time.monotonic()
            leader.proc.send_signal(signum)
            end = sent + TIMING["lease"] + 30
            while time.monotonic() < end and not any(w.led_at for w in others):
                time.sleep(0.005)
            new = next((w for w in others if w.led_at), None)
            if new is None:
                raise RuntimeError(f"no standby took over ({strategy}, signal {signum})")
            samples.append(new.led_at - sent)  # type: ignore[operator]
            leader.stop()
            workers = [*others, _Worker(strategy, election)]
            workers[-1].ready.wait(60)
    finally:
        for worker in workers:
            worker.stop()
    return Failover(strategy, signal.Signals(signum).name, statistics.median(samples), samples)


def _wait_for_leader(workers: list[_Worker], timeout: float = 60) -> _Worker:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        leaders = [w for w in workers if w.led_at is not None and w.proc.poll() is None]
        if leaders:
            return max(leaders, key=lambda w: w.led_at or 0.0)
        time.sleep(0.01)
    raise RuntimeError("no worker became leader")


def run(kills: int = 5) -> list[Failover]:
    return [
        measure(strategy, signum, kills)
        for strategy in ("lease", "advisory")
        for signum in (signal.SIGKILL, signal.SIGTERM)
    ]
