"""``manage.py runworker``: real worker processes on one election.

Workers are started as ``python -m django runworker ...`` on the test
databases (``DLOCK_TEST_CHILD=1``). Waits are bounded ("within N seconds" is
a bound on a wait, never a speed assertion).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test.utils import override_settings

from django_dlock import checks, jobs
from django_dlock.leader import Leadership
from django_dlock.models import Lock as LockRow

from .factories import LockFactory
from .helpers import wait_until

ROOT = str(Path(__file__).resolve().parent.parent)
FAST = ["--lease", "2", "--renew-deadline", "1.5", "--retry", "0.4"]
LEASE, RETRY = 2.0, 0.4
#: the advisory runs use a long lease: a hand-over well within it cannot have
#: waited for the lease to run out
ADVISORY = ["--lease", "10", "--renew-deadline", "5", "--retry", "0.4"]
#: extra seconds a bounded wait allows for process scheduling on a busy machine
SLACK = 3.0

db = pytest.mark.django_db(transaction=True, databases="__all__")


def child_env(runs: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DLOCK_TEST_CHILD="1",
        PYTHONPATH=ROOT,
        PYTHONUNBUFFERED="1",
    )
    if runs is not None:
        env["DLOCK_TEST_RUNS"] = runs
    return env


class Worker:
    """A ``runworker`` process whose output lines are collected as they come."""

    def __init__(self, *args: str, runs: str | None = None, python: list[str] | None = None):
        command = python or [sys.executable, "-m", "django", "runworker", *args]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(runs),
            cwd=ROOT,
        )
        self.pid = self.proc.pid
        self.out: list[tuple[float, str]] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, None), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, into) -> None:
        for line in stream:
            if into is None:
                self.err.append(line)
            else:
                into.append((time.monotonic(), line.rstrip("\n")))

    def lines(self) -> list[str]:
        return [line for _, line in self.out]

    def first(self, text: str, after: float = 0.0) -> float | None:
        """When a line containing ``text`` was first printed (after ``after``)."""
        return next((t for t, line in list(self.out) if text in line and t >= after), None)

    @property
    def leading(self) -> bool:
        """Leading according to its own lifecycle lines."""
        state = False
        for line in self.lines():
            if line.startswith("became leader"):
                state = True
            elif line.startswith(("lost leadership", "stepped down")):
                state = False
        return state and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30) -> int:
        code = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def stderr(self) -> str:
        return "".join(self.err)


def leaders(workers: list[Worker]) -> list[Worker]:
    return [w for w in workers if w.leading]


def read_runs(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_terms(runs: list[dict]) -> list[tuple[int, int, float, float]]:
    """(term, pid, start, end) per term; no two overlap, terms increase with time."""
    terms: dict[int, dict] = {}
    for run in runs:
        term = terms.setdefault(run["term"], {"pids": set(), "start": run["start"], "end": 0.0})
        term["pids"].add(run["pid"])
        term["start"] = min(term["start"], run["start"])
        term["end"] = max(term["end"], run["end"])
    table = sorted(
        ((term, min(t["pids"]), t["start"], t["end"]) for term, t in terms.items()),
        key=lambda item: item[2],
    )
    for term, value in terms.items():
        assert len(value["pids"]) == 1, f"term {term} was run by several processes"
    for before, after in zip(table, table[1:], strict=False):
        assert before[0] < after[0], f"terms do not increase with time: {table}"
        assert before[3] <= after[2], f"leadership intervals overlap: {before} and {after}"
    return table


def failover(workers: list[Worker], old: Worker, signum: int, bound: float) -> tuple[Worker, float]:
    """Send ``signum`` to the leader ``old``; wait (bounded) for another to lead."""
    sent = time.monotonic()
    old.signal(signum)
    others = [w for w in workers if w is not old]
    wait_until(lambda: any(w.first("became leader", sent) for w in others), bound)
    new = next(w for w in others if w.first("became leader", sent))
    return new, new.first("became leader", sent) - sent


# -- one election, three workers ------------------------------------------------------------------


@db
@pytest.mark.parametrize("strategy", ["lease", "advisory"])
def test_three_workers_exactly_one_leads_and_fails_over(strategy, tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    timings = ADVISORY if strategy == "advisory" else FAST
    args = [
        "--job",
        "tests.jobs.record_term",
        "--interval",
        "0.1",
        "--election",
        "three",
        "--strategy",
        strategy,
        *timings,
    ]
    workers = [Worker(*args, runs=runs) for _ in range(3)]
    try:
        wait_until(lambda: len(leaders(workers)) == 1, 60)
        first = leaders(workers)[0]
        wait_until(lambda: sum(bool(w.first("standing by, leader is")) for w in workers) == 2, 30)
        wait_until(lambda: len(read_runs(runs)) >= 5, 30)
        assert len(leaders(workers)) == 1

        # SIGKILL: the lease must run out first; advisory: the lock goes with
        # the session at once (the bound stays well below its 10 s lease)
        bound = (0.0 if strategy == "advisory" else LEASE) + RETRY + SLACK
        second, took = failover(workers, first, signal.SIGKILL, bound)
        print(f"{strategy}: SIGKILL failover {took:.3f} s")
        first.wait()
        wait_until(lambda: len(leaders(workers)) == 1, 10)
        assert leaders(workers) == [second]
        runs_before = len(read_runs(runs))
        wait_until(lambda: len(read_runs(runs)) >= runs_before + 5, 30)

        # SIGTERM: the leader steps down at once, a standby leads within ~ one retry
        third, took = failover(workers, second, signal.SIGTERM, RETRY + SLACK)
        print(f"{strategy}: SIGTERM failover {took:.3f} s")
        assert second.wait() == 0
        assert second.lines()[-1] == "stepped down"
        runs_before = len(read_runs(runs))
        wait_until(lambda: len(read_runs(runs)) >= runs_before + 5, 30)

        third.signal(signal.SIGINT)
        assert third.wait() == 0
        assert third.lines()[-1] == "stepped down"
    finally:
        for worker in workers:
            worker.kill()
    table = check_terms(read_runs(runs))
    assert [pid for _, pid, _, _ in table] == [first.pid, second.pid, third.pid]
    for worker in (first, second, third):
        assert any(line.startswith("became leader (term ") for line in worker.lines())
    assert "Traceback" not in second.stderr() + third.stderr()


# -- a failing job, verbosity, the setting ------------------------------------------------------


@db
def test_a_job_that_raises_is_logged_and_the_worker_goes_on(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    worker = Worker(
        "--job",
        "tests.jobs.fail_every_other",
        "--interval",
        "0.05",
        "--election",
        "failing",
        *FAST,
        runs=runs,
    )
    try:
        wait_until(lambda: len(read_runs(runs)) >= 4, 60)
        assert worker.proc.poll() is None
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0
    finally:
        worker.kill()
    err = worker.stderr()
    assert "job tests.jobs.fail_every_other raised" in err
    assert "Traceback (most recent call last)" in err
    assert "RuntimeError: job failure number 1" in err
    assert "RuntimeError: job failure number 2" in err


@db
@pytest.mark.parametrize("verbosity", ["0", "2"])
def test_verbosity(verbosity, tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    worker = Worker(
        "--job",
        "tests.jobs.record_term",
        "--interval",
        "0.1",
        "--election",
        f"verbosity{verbosity}",
        "-v",
        verbosity,
        *FAST,
        runs=runs,
    )
    try:
        wait_until(lambda: len(read_runs(runs)) >= 3, 60)
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0
    finally:
        worker.kill()
    lines = worker.lines()
    if verbosity == "0":
        assert lines == []
    else:
        assert any(line.startswith("ran tests.jobs.record_term in ") for line in lines)
        assert any(line.startswith("became leader (term ") for line in lines)
        assert lines[-1] == "stepped down"


@db
def test_jobs_from_the_setting(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    script = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "from django.test.utils import override_settings\n"
        "with override_settings(DLOCK_WORKER_JOBS=["
        "{'job': 'tests.jobs.record_term', 'interval': 0.1}, 'tests.jobs.hello']):\n"
        "    call_command('runworker', '--election', 'setting', '-v', '2',"
        " '--lease', '2', '--renew-deadline', '1.5', '--retry', '0.4')\n"
    )
    worker = Worker(python=[sys.executable, "-c", script], runs=runs)
    try:
        wait_until(lambda: len(read_runs(runs)) >= 3, 60)
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr()
    finally:
        worker.kill()
    assert any("tests.jobs.hello every 60 s" in line for line in worker.lines())
    assert any(line.startswith("ran tests.jobs.hello") for line in worker.lines())


# -- bad configuration fails fast ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--job", "tests.jobs.hello", "--lease", "1", "--renew-deadline", "1"],
            "lease (1 s) must be greater than renew_deadline (1 s)",
        ),
        (["--job", "tests.jobs.nope"], "cannot import job 'tests.jobs.nope'"),
        (
            ["--job", "tests.jobs.hello", "--strategy", "nonsense"],
            "LeaderElection cannot use the strategy 'nonsense'",
        ),
    ],
)
def test_bad_configuration_exits_non_zero_with_a_clear_message(args, message):
    done = subprocess.run(
        [sys.executable, "-m", "django", "runworker", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--job", "tests.jobs.hello", "--lease", "5", "--renew-deadline", "8"],
            "must be greater than renew_deadline",
        ),
        (
            ["--job", "tests.jobs.hello", "--renew-deadline", "2", "--retry", "2"],
            "must be greater than retry * 1.2",
        ),
        (["--job", "tests.jobs.nope"], "cannot import job 'tests.jobs.nope'"),
        (["--job", "no_such_module.job"], "cannot import job 'no_such_module.job'"),
        (["--job", "hello"], "is not a dotted path"),
        (["--job", "tests.jobs.NOT_CALLABLE"], "is not callable"),
        (["--job", "tests.jobs.hello", "--interval", "0"], "--interval: the interval must be"),
        (["--job", "tests.jobs.hello", "--strategy", "row"], "cannot use the strategy 'row'"),
        (["--job", "tests.jobs.hello", "--database", "nope"], "unknown database alias 'nope'"),
        (["--job", "tests.jobs.hello", "--election", ""], "must not be empty"),
        ([], "no jobs to run"),
    ],
)
def test_bad_arguments_raise_command_error(args, message):
    with pytest.raises(CommandError) as info:
        call_command("runworker", *args, stdout=StringIO(), stderr=StringIO())
    assert message in str(info.value)


def test_advisory_needs_postgresql():
    with pytest.raises(CommandError, match="PostgreSQL"):
        call_command(
            "runworker",
            "--job",
            "tests.jobs.hello",
            "--strategy",
            "advisory",
            "--database",
            "sqlite",
            stdout=StringIO(),
        )


# -- DLOCK_WORKER_JOBS and its system check --------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ids"),
    [
        ([], []),
        (["tests.jobs.hello", {"job": "tests.jobs.record_term", "interval": 5}], []),
        ("tests.jobs.hello", ["dlock.E030"]),
        ([42], ["dlock.E031"]),
        ([{"path": "tests.jobs.hello"}], ["dlock.E031"]),
        (["hello"], ["dlock.E031"]),
        ([{"job": "tests.jobs.hello", "interval": -1}], ["dlock.E032"]),
        ([{"job": "tests.jobs.hello", "interval": "5"}], ["dlock.E032"]),
        (["tests.jobs.nope", "tests.jobs.NOT_CALLABLE"], ["dlock.E033", "dlock.E033"]),
    ],
)
def test_worker_jobs_system_check(value, ids):
    with override_settings(DLOCK_WORKER_JOBS=value):
        found = checks.check_worker_jobs()
    assert [error.id for error in found] == ids
    for error in found:
        assert (
            error.msg.startswith("DLOCK_WORKER_JOBS is invalid: entry") or error.id == "dlock.E030"
        )


def test_command_line_jobs_replace_the_setting():
    loaded = jobs.load_jobs(["tests.jobs.hello"], 5, ["tests.jobs.record_term"])
    assert [(job.path, job.interval) for job in loaded] == [("tests.jobs.hello", 5.0)]
    loaded = jobs.load_jobs([], 5, ["tests.jobs.hello", {"job": "tests.jobs.record_term"}])
    assert [(job.path, job.interval) for job in loaded] == [
        ("tests.jobs.hello", 5.0),
        ("tests.jobs.record_term", 5.0),
    ]


# -- the job loop and the built-in cleanup job ---------------------------------------------------


def test_run_jobs_keeps_intervals_survives_errors_and_stops_with_the_term():
    leadership = Leadership("loop", 1, "me")
    calls: list[str] = []
    reports: list[tuple[str, str | None]] = []

    def fast() -> None:
        calls.append("fast")
        if len(calls) == 3:
            raise ValueError("third call fails")
        if calls.count("fast") >= 6:
            leadership._end("test over")

    def slow() -> None:
        calls.append("slow")

    loaded = [jobs.Job("t.fast", fast, 0.01), jobs.Job("t.slow", slow, 60)]
    jobs.run_jobs(leadership, loaded, lambda job, s, e: reports.append((job.path, e and str(e))))
    assert calls.count("slow") == 1 and calls.count("fast") == 6
    assert ("t.fast", "third call fails") in reports


@db
def test_cleanup_job_deletes_free_rows_only():
    LockFactory.create_batch(3, expired=True)
    held = LockFactory()
    assert jobs.cleanup() == 3
    assert list(LockRow.objects.values_list("name", flat=True)) == [held.name]
