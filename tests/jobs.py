"""Jobs run by the worker tests (real processes).

Each job records what it did in a file named by an environment variable
(one line per run, appended in one write), with timestamps read from the
database clock.
"""

from __future__ import annotations

import json
import os
import time

from django.db import connections


def _db_now(alias: str = "default") -> float:
    """The database clock as a Unix timestamp."""
    connection = connections[alias]
    sql = {
        "postgresql": "SELECT EXTRACT(EPOCH FROM clock_timestamp())",
        "sqlite": "SELECT (julianday('now') - 2440587.5) * 86400.0",
        "mysql": "SELECT UNIX_TIMESTAMP(NOW(6))",
    }[connection.vendor]
    with connection.cursor() as cur:
        cur.execute(sql)
        return float(cur.fetchone()[0])


def _append(path: str, record: dict) -> None:
    line = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def record_term() -> None:
    """Record (term, pid, start, end) of one run on the leader (DLOCK_TEST_RUNS)."""
    from django_dlock.leader import current_leadership

    leadership = current_leadership()
    start = _db_now()
    time.sleep(0.05)
    end = _db_now()
    _append(
        os.environ["DLOCK_TEST_RUNS"],
        {
            "term": leadership.term if leadership else None,
            "pid": os.getpid(),
            "start": start,
            "end": end,
        },
    )


def _alias() -> str:
    return os.environ.get("DLOCK_TEST_ALIAS", "default")


def record_fenced() -> None:
    """A job that fences its write by term, as the docs tell jobs to.

    Records its start and end on the database clock, and whether its term
    was still valid (``not current_leadership().ended``) when it was called
    and right after each of the two readings: a run whose ``ok_end`` is
    true held a valid term from its start to its end.
    """
    from django_dlock.leader import current_leadership

    leadership = current_leadership()
    assert leadership is not None
    ok_call = not leadership.ended
    start = _db_now(_alias())
    ok_start = not leadership.ended
    # (a test that freezes the leader during a job waits for this line)
    _append(os.environ["DLOCK_TEST_RUNS"] + ".started", {"pid": os.getpid()})
    time.sleep(float(os.environ.get("DLOCK_TEST_JOB_SECONDS", "0.3")))
    end = _db_now(_alias())
    ok_end = not leadership.ended
    _append(
        os.environ["DLOCK_TEST_RUNS"],
        {
            "term": leadership.term,
            "pid": os.getpid(),
            "start": start,
            "end": end,
            "ok_call": ok_call,
            "ok_start": ok_start,
            "ok_end": ok_end,
        },
    )


def record_db() -> None:
    """Read the database clock and record it; a failure is recorded too, and raised."""
    try:
        now = _db_now(_alias())
    except Exception:
        _append(os.environ["DLOCK_TEST_RUNS"], {"pid": os.getpid(), "ok": False})
        raise
    from django_dlock.leader import current_leadership

    leadership = current_leadership()
    term = leadership.term if leadership else None
    record = {"pid": os.getpid(), "ok": True, "now": now, "term": term}
    _append(os.environ["DLOCK_TEST_RUNS"], record)


def _regex_size_for(seconds: float) -> int:
    """The size at which the catastrophic expression of :func:`hold_gil` runs at least
    ``seconds`` here (each step up doubles the time).

    Measured in CPU time of this thread (``time.thread_time``), at the first
    size that takes 20 ms of it: other processes busy on the machine do not
    count, so the run, which takes at least its CPU time on the wall clock,
    lasts at least ``seconds`` however busy the machine is then.
    """
    import math
    import re
    import time

    def took(size: int) -> float:
        started = time.thread_time()
        assert re.match(r"(a+)+$", "a" * size + "b") is None
        return max(time.thread_time() - started, 1e-6)

    size = 16
    while (fastest := min(took(size) for _ in range(3))) < 0.02:
        size += 1
    return size + max(0, math.ceil(math.log2(seconds / fastest)))


def hold_gil() -> None:
    """Hold the GIL for seconds in C code (a catastrophic regular expression), then record."""
    import re

    from django_dlock.leader import current_leadership

    leadership = current_leadership()
    assert leadership is not None
    start = _db_now(_alias())
    if "DLOCK_TEST_STARTED" in os.environ:
        with open(os.environ["DLOCK_TEST_STARTED"], "w") as f:
            f.write(str(os.getpid()))
    if "DLOCK_TEST_GIL_SECONDS" in os.environ:
        size = _regex_size_for(float(os.environ["DLOCK_TEST_GIL_SECONDS"]))
    else:
        size = int(os.environ.get("DLOCK_TEST_REGEX_SIZE", "26"))
    assert re.match(r"(a+)+$", "a" * size + "b") is None
    end = _db_now(_alias())
    _append(
        os.environ["DLOCK_TEST_RUNS"],
        {
            "term": leadership.term,
            "pid": os.getpid(),
            "start": start,
            "end": end,
            "ok_start": True,
            "ok_end": not leadership.ended,
        },
    )


def unreachable() -> None:
    """A job whose database is down: the error Django raises then."""
    from django.db import OperationalError

    raise OperationalError("could not connect to server: Connection refused")


def fail_every_other() -> None:
    """Raise on odd runs (counted in DLOCK_TEST_RUNS): the worker must survive."""
    path = os.environ["DLOCK_TEST_RUNS"]
    runs = 0
    if os.path.exists(path):
        with open(path) as f:
            runs = sum(1 for _ in f)
    _append(path, {"run": runs, "pid": os.getpid()})
    if runs % 2 == 0:
        raise RuntimeError(f"job failure number {runs // 2 + 1}")


def hello() -> None:
    """The smallest job (prints nothing)."""


def say_hi() -> None:
    """A job that prints a line at once (the worker's output order)."""
    print("job says hi", flush=True)


NOT_CALLABLE = 42


# -- TaskLock in real processes (run by tests.procs) ------------------------------


def fire_task(
    alias: str,
    path: str,
    start_at: float,
    duration: float,
    every: float,
    min_hold: float,
    max_hold: float,
) -> None:
    """Fire the same TaskLock job every ``every`` s from ``start_at`` for ``duration`` s.

    Each run appends its fence, its lease's ``acquired_at`` and the database's
    now (Unix timestamps on the database clock) to ``path``.
    """
    from django_dlock.dbclock import DbNow
    from django_dlock.models import Lock as LockRow
    from django_dlock.tasklock import TaskLock

    task = TaskLock("fired", min_hold=min_hold, max_hold=max_hold, using=alias)

    def body() -> None:
        fence = task.fence
        acquired_at, now = (
            LockRow.objects.using(alias)
            .filter(name="task:fired", fence=fence)
            .annotate(db_now=DbNow())
            .values_list("acquired_at", "db_now")
            .get()
        )
        _append(
            path,
            {
                "pid": os.getpid(),
                "fence": fence,
                "acquired_at": acquired_at.timestamp(),
                "now": now.timestamp(),
            },
        )

    while time.time() < start_at:
        time.sleep(0.01)
    end = start_at + duration
    while time.time() < end:
        task.run(body)
        time.sleep(every)


def hold_task_forever(alias: str, marker: str, max_hold: float) -> None:
    """Take a TaskLock and hang inside it (the test SIGKILLs this process)."""
    from django_dlock.tasklock import TaskLock

    with TaskLock("crashing", max_hold=max_hold, using=alias) as acquired:
        with open(marker, "w") as f:
            f.write("acquired" if acquired else "skipped")
        time.sleep(3600)


GUARDED_COUNTER = "dlock_guarded_counter"


def count_guarded() -> None:
    """A job that adds one to a counter in the database under its term's guard.

    It reads the counter, works (sleeps: a freeze of the test lands here),
    then writes the counter plus one, all in ``current_leadership().guard()``:
    a run whose term ended before it could commit writes nothing. Records the
    value it committed, or that the guard refused it.
    """
    from django_dlock.exceptions import LockLost
    from django_dlock.leader import current_leadership

    leadership = current_leadership()
    assert leadership is not None
    connection = connections[_alias()]
    record: dict = {"term": leadership.term, "pid": os.getpid()}
    try:
        with leadership.guard(), connection.cursor() as cur:
            cur.execute(f"SELECT n FROM {GUARDED_COUNTER} WHERE id = 1")
            value = int(cur.fetchone()[0]) + 1
            _append(os.environ["DLOCK_TEST_RUNS"] + ".started", {"pid": os.getpid()})
            time.sleep(float(os.environ.get("DLOCK_TEST_JOB_SECONDS", "0.3")))
            cur.execute(f"UPDATE {GUARDED_COUNTER} SET n = %s WHERE id = 1", [value])
        record["committed"] = value
    except LockLost as exc:
        record["refused"] = str(exc)
    _append(os.environ["DLOCK_TEST_RUNS"], record)
