"""``locked_task`` with real ``db_worker`` processes (Django's Tasks framework).

Three workers of the ORM backend (django-tasks-db on Django 6, the
django-tasks backport's own on older Django) serve the whole module: they
start once, poll every 0.1 s and take runs from the test database. Every
test uses keys of its own, so what one test enqueued never meets another's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from django_dlock.contrib.tasks import TaskResultStatus

from .helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3

#: a run that ended well ("SUCCEEDED" in the backport's 0.9 series)
SUCCEEDED = "SUCCESSFUL" if hasattr(TaskResultStatus, "SUCCESSFUL") else "SUCCEEDED"

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.slow,
    pytest.mark.tasks_worker,
]


class Workers:
    def __init__(self, log: Path) -> None:
        self.log = log
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DLOCK_TEST_CHILD": "1",
            "DLOCK_TASKS_LOG": str(self.log),
            "PYTHONPATH": str(ROOT),
        }
        out = open(self.log.with_suffix(f".{len(self.procs)}.out"), "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "db_worker", "--interval", "0.1"]
            + ["--no-startup-delay", "--queue-name", "*", "--skip-checks"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.procs.append(proc)
        return proc

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [line.split() for line in self.log.read_text().splitlines()]

    def count(self, *words: str) -> int:
        return sum(1 for line in self.lines() if line[: len(words)] == list(words))

    def output(self) -> str:
        text = self.log.read_text() if self.log.exists() else ""
        return text + "\n".join(p.read_text() for p in sorted(self.log.parent.glob("*.out")))

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[Workers]:
    with django_db_blocker.unblock():
        from django.conf import settings

        if "default" not in getattr(settings, "TASKS", {}) or "Database" not in str(
            settings.TASKS["default"]["BACKEND"]
        ):
            pytest.fail(
                "the ORM task backend is not installed: pip install django-tasks-db "
                "(Django 6), or django-tasks<0.10 on older Django",
                pytrace=False,
            )
    group = Workers(tmp_path_factory.mktemp("tasks") / "tasks.log")
    try:
        for _ in range(WORKERS):
            group.start()
        yield group
    finally:
        group.stop()


def finished(*results) -> bool:
    for result in results:
        result.refresh()
    return all(r.is_finished for r in results)


def test_a_burst_in_skip_mode_runs_the_body_once(workers):
    """Ten runs at once: one body, nine skips, all successful; a run that
    comes after the 1 s lease would have run out (renewed) is skipped too."""
    from tests import tasks_app

    runs = [tasks_app.exclusive.enqueue("burst", 6.0) for _ in range(10)]
    wait_until(lambda: workers.count("start", "burst") == 1, timeout=30)
    started = time.monotonic()
    wait_until(lambda: workers.count("skip", 'lock:exclusive:"burst"') == 9, timeout=30)
    # twice the 1 s lease after the body began: it lives on renewals only
    time.sleep(max(0.0, started + 2 - time.monotonic()))
    late = tasks_app.exclusive.enqueue("burst", 0)
    wait_until(lambda: workers.count("skip", 'lock:exclusive:"burst"') == 10, timeout=30)
    wait_until(lambda: finished(*runs, late), timeout=30)
    assert workers.count("start", "burst") == 1, workers.output()
    assert workers.count("end", "burst") == 1  # the late run skipped while the body ran
    words = [line[0] for line in workers.lines() if "burst" in " ".join(line)]
    assert words.index("end") == len(words) - 1, words
    assert all(r.status == SUCCEEDED for r in [*runs, late])
    assert sorted(str(r.return_value) for r in runs) == ["None"] * 9 + ["burst"]


def test_retry_mode_runs_every_call_one_at_a_time_per_key(workers):
    from tests import tasks_app

    runs = [tasks_app.queued.enqueue(key, 0.3) for key in ("a", "b") for _ in range(4)]
    wait_until(lambda: workers.count("end", "a") + workers.count("end", "b") == 8, timeout=90)
    assert workers.count("start", "a") == 4 and workers.count("start", "b") == 4
    assert workers.count("OVERLAP") == 0, workers.output()
    # the busy runs ended at once and enqueued themselves again
    wait_until(lambda: finished(*runs), timeout=30)
    assert all(r.status == SUCCEEDED for r in runs)


def test_permits_two_never_three_at_once(workers):
    from tests import tasks_app

    for _ in range(10):
        tasks_app.limited.enqueue("p", 0.6)
    wait_until(lambda: workers.count("end", "p") == 10, timeout=90)
    inside = [int(line[2]) for line in workers.lines() if line[:2] == ["inside", "p"]]
    assert len(inside) == 10 and max(inside) == 2, workers.output()


def test_a_killed_worker_frees_the_key_within_its_lease(workers):
    """SIGKILL the worker in the body: the key is free again within the
    lease (1 s) and 2 s, and the next run runs. The killed run's result
    stays RUNNING (the backend never hears of it again)."""
    import django_dlock as dlock
    from tests import tasks_app

    tasks_app.exclusive.enqueue("killed", 60.0)
    wait_until(lambda: workers.count("start", "killed") == 1, timeout=30)
    pid = next(int(line[2]) for line in workers.lines() if line[:2] == ["start", "killed"])
    proc = next(p for p in workers.procs if p.pid == pid)
    assert dlock.lock('exclusive:"killed"').locked()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    killed_at = time.monotonic()
    wait_until(lambda: not dlock.lock('exclusive:"killed"').locked(), timeout=30)
    freed_after = time.monotonic() - killed_at
    assert freed_after <= 1 + 2, freed_after  # the bound: ttl + 2 s
    os.remove(f"{workers.log}.killed.inside")  # the killed body's marker
    workers.procs.remove(proc)
    workers.start()
    after = tasks_app.exclusive.enqueue("killed", 0)
    wait_until(lambda: finished(after), timeout=30)
    assert after.return_value == "killed"
    assert workers.count("start", "killed") == 2
