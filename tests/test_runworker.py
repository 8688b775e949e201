"""``manage.py dlock_runworker`` (alias ``runworker``): real worker processes on one election.

Workers are started as ``python -m django dlock_runworker ...`` on the test
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
from django.core.management import call_command, get_commands, load_command_class
from django.core.management.base import CommandError
from django.db import connections
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

db = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


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
    """A ``dlock_runworker`` process whose output lines are collected as they come."""

    def __init__(
        self,
        *args: str,
        runs: str | None = None,
        python: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        command = python or [sys.executable, "-m", "django", "dlock_runworker", *args]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**child_env(runs), **(env or {})},
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
def test_became_leader_is_printed_before_the_jobs_first_output():
    """The leader's line came from the election's callback thread, after the
    first job had already printed."""
    worker = Worker(
        "--job", "tests.jobs.say_hi", "--interval", "0.05", "--election", "order", *FAST
    )
    try:
        wait_until(lambda: worker.first("job says hi") is not None, 60)
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr()
    finally:
        worker.kill()
    lines = [line for line in worker.lines() if not line.startswith("worker ")]
    assert lines[0].startswith("became leader (term "), lines[:3]
    assert lines[1] == "job says hi"


@db
@pytest.mark.parametrize("command", ["dlock_runworker", "runworker"])
def test_jobs_from_the_setting(tmp_path, command):
    runs = str(tmp_path / "runs.jsonl")
    script = (
        "import django; django.setup()\n"
        "from django.core.management import call_command\n"
        "from django.test.utils import override_settings\n"
        "with override_settings(DLOCK_WORKER_JOBS=["
        "{'job': 'tests.jobs.record_term', 'interval': 0.1}, 'tests.jobs.hello']):\n"
        f"    call_command({command!r}, '--election', 'setting', '-v', '2',"
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


# -- the command's names ----------------------------------------------------------------------


def test_runworker_is_an_alias_of_dlock_runworker():
    from django_dlock.management.commands import dlock_runworker, runworker

    assert runworker.Command is dlock_runworker.Command
    commands = get_commands()
    assert commands["dlock_runworker"] == commands["runworker"] == "django_dlock"
    for name in ("dlock_runworker", "runworker"):
        assert type(load_command_class("django_dlock", name)) is dlock_runworker.Command


@pytest.mark.parametrize("command", ["dlock_runworker", "runworker"])
def test_both_names_run_the_same_command(command):
    with pytest.raises(CommandError, match="unknown database alias 'nope' \\(known: default, "):
        call_command(command, "--job", "tests.jobs.hello", "--using", "nope", stdout=StringIO())
    with pytest.raises(CommandError, match="no jobs to run"):
        call_command(command, stdout=StringIO())


@pytest.mark.parametrize("first", [True, False], ids=["other-app-first", "other-app-last"])
def test_another_apps_runworker_never_hides_dlock_runworker(first):
    """Django Channels has a ``runworker`` command too: the app listed first in
    INSTALLED_APPS owns ``runworker``; ``dlock_runworker`` is always ours."""
    from django.conf import settings

    from django_dlock.management.commands import dlock_runworker

    other = "tests.fake_channels"
    installed = list(settings.INSTALLED_APPS)
    installed = [other, *installed] if first else [*installed, other]
    with override_settings(INSTALLED_APPS=installed):
        commands = get_commands()
        assert commands["dlock_runworker"] == "django_dlock"
        assert commands["runworker"] == (other if first else "django_dlock")
        command = load_command_class(commands["runworker"], "runworker")
        assert (type(command) is dlock_runworker.Command) is not first
        out = StringIO()
        if first:
            call_command("runworker", stdout=out)
            assert out.getvalue() == "the other app's runworker\n"
        with pytest.raises(CommandError, match="unknown database alias 'nope'"):
            call_command("dlock_runworker", "--job", "tests.jobs.hello", "--using", "nope")
    assert get_commands()["runworker"] == "django_dlock"


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
        [sys.executable, "-m", "django", "dlock_runworker", *args],
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
        (["--job", "tests.jobs.hello", "--using", "nope"], "unknown database alias 'nope'"),
        (["--job", "tests.jobs.hello", "--election", ""], "must not be empty"),
        ([], "no jobs to run"),
    ],
)
def test_bad_arguments_raise_command_error(args, message):
    with pytest.raises(CommandError) as info:
        call_command("dlock_runworker", *args, stdout=StringIO(), stderr=StringIO())
    assert message in str(info.value)


@pytest.mark.parametrize("option", ["--using", "--database"])
@pytest.mark.parametrize("alias", ["sqlite", "mysql"])
def test_advisory_needs_postgresql_and_the_message_suggests_what_runs(option, alias):
    with pytest.raises(CommandError, match="PostgreSQL") as info:
        call_command(
            "dlock_runworker",
            "--job",
            "tests.jobs.hello",
            "--strategy",
            "advisory",
            option,
            alias,
            stdout=StringIO(),
        )
    message = str(info.value)
    assert "use the lease strategy" in message
    # what it suggests is what runworker accepts
    suggested = message.partition("use the ")[2].split()[0]
    with pytest.raises(CommandError, match="cannot use the strategy 'row'"):
        call_command("dlock_runworker", "--job", "tests.jobs.hello", "--strategy", "row")
    assert suggested == "lease" and "row" not in message


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


# -- leadership that never overlaps: frozen leaders, dead connections, GIL-bound jobs ----------

#: SIGSTOP/SIGCONT rounds per database: half between two jobs, half during a job
FREEZE_ROUNDS = 4
#: the fenced job's interval and length (seconds)
JOB_INTERVAL, JOB_SECONDS = 0.5, 0.3


def check_fenced_runs(runs: list[dict]) -> None:
    """What "exactly one leader acts" means for a job that fences by term.

    * No job is called with a term its process knows is over (``ok_call``).
      A job that starts (on the database clock) after a later term started
      was frozen between that call and its start, the window no check can
      close (see "Fencing by term" in the docs): it is told at once that its
      term has ended (``ok_start`` false), so a job that checks its term
      right before its write never writes with it.
    * A run that saw its term valid at its end (``ok_end``) held the term
      throughout: such runs of different processes never overlap on the
      database clock, and their terms increase with time.
    """
    for run in runs:
        assert run["ok_call"], f"a job was called after its term had ended: {run}"
        later = [r["start"] for r in runs if r["term"] > run["term"]]
        if later and run["start"] >= min(later):
            assert not run["ok_start"], f"a job started with a stale term, not told: {run}"
    valid = sorted((r for r in runs if r["ok_end"]), key=lambda r: r["start"])
    for before, after in zip(valid, valid[1:], strict=False):
        if before["pid"] != after["pid"]:
            assert before["end"] <= after["start"], (
                f"two leaders ran jobs at once: {before} {after}"
            )
        assert before["term"] <= after["term"], f"terms do not increase with time: {before} {after}"


def sqlite_write_locked(alias: str) -> bool:
    """Whether another process keeps SQLite's database file locked (for half a second)."""
    import sqlite3

    from django.db import connections

    path = connections[alias].settings_dict["NAME"]
    for _ in range(5):
        probe = sqlite3.connect(path, timeout=0)
        try:
            probe.execute("BEGIN EXCLUSIVE")
            probe.rollback()
            return False
        except sqlite3.OperationalError:
            time.sleep(0.1)
        finally:
            probe.close()
    return True


def freeze_once(
    workers: list[Worker], runs: str, during: bool, bound: float, alias: str
) -> float | None:
    """SIGSTOP the leader (between two jobs, or during one), SIGCONT after a standby led.

    Returns the seconds from SIGSTOP to another worker's "became leader";
    ``None`` when, on SQLite, the leader froze while holding the database
    file's lock (nobody can write until it runs again).
    """
    wait_until(lambda: len(leaders(workers)) == 1, 30)
    leader = leaders(workers)[0]
    count = len(read_runs(runs))
    wait_until(lambda: len(read_runs(runs)) > count, 30)  # a run just ended
    if during:  # stop the next job as soon as it has started (it then works 0.3 s)
        started = len(read_runs(runs + ".started"))
        wait_until(lambda: len(read_runs(runs + ".started")) > started, 30)
    try:
        new, took = failover(workers, leader, signal.SIGSTOP, bound)
    except AssertionError:
        if alias != "sqlite" or not sqlite_write_locked(alias):
            raise
        new, took = None, None
    if new is not None:
        count = len(read_runs(runs))
        wait_until(lambda: any(r["pid"] == new.pid for r in read_runs(runs)[count:]), 30)
    resumed = time.monotonic()
    leader.signal(signal.SIGCONT)
    wait_until(lambda: leader.first("lost leadership", resumed) is not None, 30)
    assert leader.proc.poll() is None
    return took


@pytest.mark.slow
@db
@pytest.mark.parametrize(
    ("alias", "strategy"),
    [("default", "lease"), ("default", "advisory"), ("mysql", "lease"), ("sqlite", "lease")],
)
def test_a_frozen_leader_is_replaced_and_never_acts_with_its_old_term(alias, strategy, tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    args = [
        "--job", "tests.jobs.record_fenced", "--interval", str(JOB_INTERVAL),
        "--election", f"frozen-{strategy}", "--strategy", strategy, "--using", alias, *FAST,
    ]  # fmt: skip
    env = {"DLOCK_TEST_ALIAS": alias, "DLOCK_TEST_JOB_SECONDS": str(JOB_SECONDS)}
    workers = [Worker(*args, runs=runs, env=env) for _ in range(3)]
    try:
        wait_until(lambda: len(leaders(workers)) == 1, 60)
        # frozen past its lease: a standby leads within lease + retry (+ scheduling slack)
        bound = LEASE + RETRY + SLACK
        took = [freeze_once(workers, runs, n % 2 == 1, bound, alias) for n in range(FREEZE_ROUNDS)]
        print(f"{alias} {strategy}: SIGSTOP failover {[t and round(t, 3) for t in took]}")
        assert sum(t is not None for t in took) >= FREEZE_ROUNDS // 2
    finally:
        for worker in workers:
            worker.signal(signal.SIGCONT)
            worker.kill()
    found = read_runs(runs)
    check_fenced_runs(found)
    fenced = [r for r in found if r["ok_start"] and not r["ok_end"]]
    # The rounds that freeze a job stop it right after it marked its start; on a
    # loaded machine one of them may still miss. At least one must have frozen a
    # job, or the case this test is about was not exercised.
    assert fenced, "no round froze a job: the case was not exercised"
    assert all(w.stderr().count("Traceback") == 0 for w in workers), workers[0].stderr()


@pytest.mark.slow
@db
@pytest.mark.parametrize("alias", ["default", "mysql"], ids=["postgresql", "mariadb"])
def test_a_frozen_leaders_guarded_jobs_never_commit_after_its_successor_began(alias, tmp_path):
    # Each job reads a counter, works, and writes it plus one under its term's
    # guard. A leader frozen in the middle of a job resumes after a standby
    # led: its write must not commit (it would lose the successor's updates).
    from .jobs import GUARDED_COUNTER

    with connections[alias].cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {GUARDED_COUNTER}")
        cur.execute(f"CREATE TABLE {GUARDED_COUNTER} (id INTEGER PRIMARY KEY, n INTEGER)")
        cur.execute(f"INSERT INTO {GUARDED_COUNTER} (id, n) VALUES (1, 0)")
    runs = str(tmp_path / "runs.jsonl")
    args = [
        "--job", "tests.jobs.count_guarded", "--interval", str(JOB_INTERVAL),
        "--election", "frozen-guarded", "--using", alias, *FAST,
    ]  # fmt: skip
    env = {"DLOCK_TEST_ALIAS": alias, "DLOCK_TEST_JOB_SECONDS": str(JOB_SECONDS)}
    workers = [Worker(*args, runs=runs, env=env) for _ in range(3)]
    try:
        wait_until(lambda: len(leaders(workers)) == 1, 60)
        bound = LEASE + RETRY + SLACK
        for _ in range(2):  # frozen in the middle of a job
            freeze_once(workers, runs, True, bound, alias)
    finally:
        for worker in workers:
            worker.signal(signal.SIGCONT)
            worker.kill()
    found = read_runs(runs)
    committed = [r for r in found if "committed" in r]
    refused = [r for r in found if "refused" in r]
    # every committed run added one to what the previous one committed: no
    # update was lost to a stale leader, and terms only grew
    assert sorted(r["committed"] for r in committed) == list(range(1, len(committed) + 1))
    by_value = sorted(committed, key=lambda r: r["committed"])
    assert all(a["term"] <= b["term"] for a, b in zip(by_value, by_value[1:], strict=False))
    with connections[alias].cursor() as cur:
        cur.execute(f"SELECT n FROM {GUARDED_COUNTER} WHERE id = 1")
        assert cur.fetchone()[0] == len(committed)
    assert refused, "no frozen job was refused: the freezes missed the jobs"
    assert all(w.stderr().count("Traceback") == 0 for w in workers), workers[0].stderr()


def terminate_other_backends() -> int:
    """``pg_terminate_backend`` every other session of the test database (the workers')."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return int(cur.fetchone()[0])


@db
def test_jobs_get_a_new_connection_after_theirs_was_terminated(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    worker = Worker(
        "--job", "tests.jobs.record_db", "--interval", "0.2",
        "--election", "terminated", "--database", "default", *FAST,
        runs=runs,
    )  # fmt: skip
    try:
        wait_until(lambda: len(read_runs(runs)) >= 3, 60)
        for _ in range(3):  # three times, each after the jobs got going again
            assert terminate_other_backends() >= 1
            count = len(read_runs(runs))
            # the jobs succeed again (within one interval; the bound allows scheduling)
            wait_until(lambda: sum(r["ok"] for r in read_runs(runs)[count:]) >= 3, 10)  # noqa: B023
            after = read_runs(runs)[count:]
            # at most the run that held the killed connection fails; every later one succeeds
            first_ok = next(i for i, r in enumerate(after) if r["ok"])
            assert first_ok <= 1 and all(r["ok"] for r in after[first_ok:]), after
        assert worker.proc.poll() is None
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0
    finally:
        worker.kill()


@db
def test_jobs_that_cannot_reach_the_database_are_reported_and_can_step_down(tmp_path):
    args = ["--job", "tests.jobs.unreachable", "--interval", "0.1", *FAST]
    loud = Worker(*args, "--election", "unreachable-loud")
    stepping = Worker(*args, "--election", "unreachable-step", "--step-down-when-unreachable")
    try:
        assert stepping.wait(60) == 1  # stepped down, and says why
        wait_until(lambda: "jobs have not reached the database for" in loud.stderr(), 60)
        assert loud.proc.poll() is None
    finally:
        loud.kill()
        stepping.kill()
    assert "have not reached the database for" in stepping.stderr()
    assert "stepping down" in stepping.stderr()
    assert stepping.lines()[-1] == "stepped down"


@pytest.mark.slow
@db
def test_an_isolated_job_that_holds_the_gil_cannot_starve_the_renewals(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    args = [
        "--job", "tests.jobs.hold_gil", "--interval", "0.5", "--election", "gil",
        "--isolate", *FAST,
    ]  # fmt: skip
    # the GIL is held for over the 2 s lease (sized by the job on this machine)
    slow = {"DLOCK_TEST_GIL_SECONDS": str(LEASE * 1.5)}
    workers = [Worker(*args, runs=runs, env=slow) for _ in range(2)]
    try:
        wait_until(lambda: len(read_runs(runs)) >= 2, 180)
        assert len(leaders(workers)) == 1
        assert all(w.proc.poll() is None for w in workers)
    finally:
        for worker in workers:
            worker.kill()
    found = read_runs(runs)
    # each run held the GIL longer than the lease, yet the leader kept its term
    assert all(r["end"] - r["start"] > LEASE for r in found), found
    assert len({(r["pid"], r["term"]) for r in found}) == 1, found
    assert all(r["ok_end"] for r in found)
    assert not any(
        line.startswith(("lost leadership", "stepped down")) for w in workers for line in w.lines()
    )


@pytest.mark.slow
@db
def test_an_isolated_job_is_stopped_when_the_term_is_lost(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    marker = str(tmp_path / "started")
    worker = Worker(
        "--job", "tests.jobs.hold_gil", "--interval", "0.5", "--election", "isolated-lost",
        "--isolate", *FAST,
        runs=runs,
        env={"DLOCK_TEST_REGEX_SIZE": "40", "DLOCK_TEST_STARTED": marker},
    )  # fmt: skip
    try:
        wait_until(lambda: os.path.exists(marker) and Path(marker).read_text(), 60)
        with open(marker) as f:
            child = int(f.read())
        lost_at = time.monotonic()
        with connection_cursor() as cur:  # the admin's force-release, in effect
            cur.execute(
                "UPDATE django_dlock_lock SET token = 'stolen' WHERE name = 'leader:isolated-lost'"
            )
        wait_until(lambda: worker.first("lost leadership", lost_at) is not None, 10)
        wait_until(lambda: not alive(child), 10)  # SIGTERM, then SIGKILL
        assert worker.proc.poll() is None
    finally:
        worker.kill()
    assert read_runs(runs) == []


@pytest.mark.slow
@db
def test_an_isolated_job_ends_with_its_sigkilled_leader(tmp_path):
    # The job holds the GIL (its listening thread cannot run), so only the
    # kernel can end it when the leader dies; else it would run on for
    # minutes while a standby leads.
    marker = str(tmp_path / "started")
    worker = Worker(
        "--job", "tests.jobs.hold_gil", "--interval", "0.5", "--election", "isolated-kill",
        "--isolate", *FAST,
        runs=str(tmp_path / "runs.jsonl"),
        env={"DLOCK_TEST_REGEX_SIZE": "40", "DLOCK_TEST_STARTED": marker},
    )  # fmt: skip
    child = None
    try:
        wait_until(lambda: os.path.exists(marker) and Path(marker).read_text(), 60)
        with open(marker) as f:
            child = int(f.read())
        assert alive(child)
        worker.kill()  # SIGKILL: the leader cannot stop its child
        wait_until(lambda: not alive(child), 10)
    finally:
        worker.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, maybe between open and read
        return False


def connection_cursor():
    from django.db import connection

    return connection.cursor()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lease", "advisory"])
def test_jobs_work_again_after_a_postgresql_restart(strategy, tmp_path):
    from .pgcluster import PrivateCluster

    cluster = PrivateCluster(fsync="off").create()
    try:
        env = {"DLOCK_TEST_PG_PORT": str(cluster.port)}
        name = f"test_dlock{os.environ.get('DLOCK_TEST_DB_SUFFIX', '')}"
        cluster.create_database(name)
        subprocess.run(
            [sys.executable, "-m", "django", "migrate", "--database", "default", "-v", "0"],
            env={**child_env(), **env},
            cwd=ROOT,
            check=True,
            timeout=300,
        )
        runs = str(tmp_path / "runs.jsonl")
        args = [
            "--job", "tests.jobs.record_db", "--interval", "0.2", "--election", "restarted",
            "--strategy", strategy, *FAST,
        ]  # fmt: skip
        workers = [Worker(*args, runs=runs, env=env) for _ in range(2)]
        try:
            wait_until(lambda: len(read_runs(runs)) >= 3, 60)
            before = time.monotonic()
            cluster.restart()
            restarted = time.monotonic()
            back = len(read_runs(runs))
            # the jobs succeed again soon after the server is back (bounded wait)
            wait_until(lambda: sum(r["ok"] for r in read_runs(runs)[back:]) >= 1, 20)
            first_run = time.monotonic() - restarted
            wait_until(lambda: sum(r["ok"] for r in read_runs(runs)[back:]) >= 5, 20)
            wait_until(lambda: len(leaders(workers)) == 1, 20)
            assert all(w.proc.poll() is None for w in workers)
        finally:
            for worker in workers:
                worker.kill()
        after = read_runs(runs)[back:]
        first_ok = next(i for i, r in enumerate(after) if r["ok"])
        # the server was back before restart() returned: at most the run that
        # held a connection of the old server fails
        ok = [r for r in read_runs(runs) if r["ok"]]
        check_terms([{**r, "start": r["now"], "end": r["now"]} for r in ok])
        changes = [w.first("became leader", before) for w in workers]
        print(
            f"{strategy}: restart took {restarted - before:.2f} s, first job run "
            f"{first_run:.2f} s later, new term after "
            f"{[round(t - before, 2) for t in changes if t is not None]} s, "
            f"runs after the restart {[r['ok'] for r in after][:8]}"
        )
        assert first_ok <= 1 and all(r["ok"] for r in after[first_ok:]), after
    finally:
        cluster.destroy()


@pytest.mark.slow
@db
def test_an_advisory_standby_that_may_not_end_the_frozen_leaders_session_waits(tmp_path):
    """Without the privilege to see and end the holder's session, no take-over (documented)."""
    from django.db import connection

    role = f"dlock_weak{os.environ.get('DLOCK_TEST_DB_SUFFIX', '')}"
    with connection.cursor() as cur:
        cur.execute(f'DROP ROLE IF EXISTS "{role}"')
        cur.execute(f'CREATE ROLE "{role}" LOGIN NOSUPERUSER')
        cur.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA public TO "{role}"')
        cur.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO "{role}"')
    args = [
        "--job", "tests.jobs.hello", "--interval", "0.2", "--election", "weak",
        "--strategy", "advisory", *FAST,
    ]  # fmt: skip
    leader = Worker(*args)  # a superuser's session: only a superuser may end it
    standby = None
    try:
        wait_until(lambda: leader.leading, 60)
        standby = Worker(*args, env={"DLOCK_TEST_PG_USER": role})
        wait_until(lambda: standby.first("standing by") is not None, 60)
        stopped = time.monotonic()
        leader.signal(signal.SIGSTOP)
        time.sleep(LEASE + RETRY + SLACK)
        assert standby.first("became leader", stopped) is None
        leader.signal(signal.SIGCONT)  # it finds its term over and lets go
        wait_until(lambda: standby.first("became leader", stopped) is not None, 10)
    finally:
        leader.signal(signal.SIGCONT)
        leader.kill()
        if standby is not None:
            standby.kill()
        with connection.cursor() as cur:
            cur.execute(f'DROP OWNED BY "{role}"')
            cur.execute(f'DROP ROLE "{role}"')


@pytest.mark.slow
@db
def test_an_isolated_worker_stops_gracefully(tmp_path):
    runs = str(tmp_path / "runs.jsonl")
    worker = Worker(
        "--job", "tests.jobs.record_fenced", "--interval", "0.5", "--election", "isolated-stop",
        "--isolate", *FAST,
        runs=runs,
        env={"DLOCK_TEST_JOB_SECONDS": "1.0"},
    )  # fmt: skip
    try:
        wait_until(lambda: len(read_runs(runs)) >= 1, 60)
        time.sleep(0.3)  # inside the next run
        worker.signal(signal.SIGTERM)
        assert worker.wait() == 0, worker.stderr()
    finally:
        worker.kill()
    found = read_runs(runs)
    assert len(found) >= 2  # the run in progress finished
    assert found[-1]["ok_start"] and not found[-1]["ok_end"]  # and saw its term end
    assert worker.lines()[-1] == "stepped down"
