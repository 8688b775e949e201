"""Jobs for ``manage.py dlock_runworker``: loading, the leader's job loop, built-in jobs.

A job is a callable that takes no arguments, named by its dotted path. The
worker runs each job every ``interval`` seconds, on the leader only: first
right after it becomes leader, then ``interval`` seconds after each start
(a job that overruns its interval runs again at once; jobs never overlap,
they run one after another in the leader's thread).

``DLOCK_WORKER_JOBS`` lists the jobs of ``dlock_runworker`` when no ``--job`` is
given; each entry is a dotted path (run every ``--interval`` seconds) or a
dict ``{"job": "dotted.path", "interval": seconds}``::

    DLOCK_WORKER_JOBS = [
        "myapp.jobs.send_reminders",
        {"job": "django_dlock.jobs.cleanup", "interval": 3600},
    ]

A job can read its leadership term (to fence its writes) with
:func:`django_dlock.leader.current_leadership`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import import_string

from django_dlock.exceptions import DatabaseUnavailable, DLockError
from django_dlock.identity import doing
from django_dlock.leader import Leadership

__all__ = [
    "Job",
    "JobError",
    "JobsUnreachable",
    "cleanup",
    "load_jobs",
    "run_isolated_jobs",
    "run_jobs",
    "setting_problems",
]

logger = logging.getLogger("django_dlock")

#: default seconds between two runs of a job
DEFAULT_INTERVAL = 60.0


class JobError(ValueError):
    """A job is badly specified or cannot be imported.

    ``check_id`` is the system check that reports the same problem in
    ``DLOCK_WORKER_JOBS``.
    """

    def __init__(self, message: str, check_id: str = "dlock.E031") -> None:
        super().__init__(message)
        self.check_id = check_id


@dataclass(frozen=True)
class Job:
    """A job of the worker: its dotted path, the callable and its interval."""

    path: str
    func: Callable[[], Any]
    interval: float


def _interval_problem(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"the interval must be a number of seconds, not {type(value).__name__}"
    if not math.isfinite(value) or value <= 0:
        return f"the interval must be a finite number of seconds > 0, got {value!r}"
    return None


def _entry(item: object, default_interval: float) -> tuple[str, float]:
    """``(path, interval)`` of one ``DLOCK_WORKER_JOBS`` entry (no import)."""
    if isinstance(item, str):
        path, interval = item, default_interval
    elif isinstance(item, dict):
        unknown = set(item) - {"job", "interval"}
        if "job" not in item or unknown:
            raise JobError(
                'a job entry must be a dotted path or {"job": "dotted.path", "interval": '
                f"seconds}}, got {item!r}"
            )
        path, interval = item["job"], item.get("interval", default_interval)
        if not isinstance(path, str):
            raise JobError(f'"job" must be a dotted path string, got {path!r}')
    else:
        raise JobError(
            'a job entry must be a dotted path or {"job": "dotted.path", "interval": seconds}, '
            f"not {type(item).__name__}"
        )
    if "." not in path.strip(".") or path != path.strip():
        raise JobError(f"{path!r} is not a dotted path (module.function)")
    problem = _interval_problem(interval)
    if problem is not None:
        raise JobError(f"job {path!r}: {problem}", "dlock.E032")
    return path, float(interval)


def import_job(path: str) -> Callable[[], Any]:
    """Import the job at ``path``.

    Raises:
        JobError: it cannot be imported, or is not callable.
    """
    try:
        func = import_string(path)
    except ImportError as exc:
        raise JobError(f"cannot import job {path!r}: {exc}", "dlock.E033") from None
    except Exception as exc:  # the module itself failed while importing
        raise JobError(
            f"importing job {path!r} failed: {type(exc).__name__}: {exc}", "dlock.E033"
        ) from None
    if not callable(func):
        raise JobError(
            f"job {path!r} is not callable (it is a {type(func).__name__})", "dlock.E033"
        )
    result: Callable[[], Any] = func
    return result


def load_jobs(
    paths: Iterable[str], interval: float = DEFAULT_INTERVAL, setting: object = ()
) -> list[Job]:
    """The jobs of a worker: ``paths`` (every ``interval`` s), else the ``setting``.

    Raises:
        JobError: an entry is malformed, a job cannot be imported, or the
            interval is not a positive number.
    """
    problem = _interval_problem(interval)
    if problem is not None:
        raise JobError(f"--interval: {problem}", "dlock.E032")
    paths = list(paths)
    if paths:
        entries = [_entry(path, float(interval)) for path in paths]
    else:
        if not isinstance(setting, (list, tuple)):
            raise JobError(
                f"DLOCK_WORKER_JOBS must be a list, not {type(setting).__name__}", "dlock.E030"
            )
        entries = [_entry(item, float(interval)) for item in setting]
    return [Job(path, import_job(path), every) for path, every in entries]


def setting_problems(value: object) -> list[tuple[str, str]]:
    """What is wrong with a ``DLOCK_WORKER_JOBS`` value: ``(check id, message)`` pairs."""
    if not isinstance(value, (list, tuple)):
        return [("dlock.E030", f"must be a list, not {type(value).__name__}")]
    found: list[tuple[str, str]] = []
    for index, item in enumerate(value):
        try:
            path, _ = _entry(item, DEFAULT_INTERVAL)
            import_job(path)
        except JobError as exc:
            found.append((exc.check_id, f"entry {index}: {exc}"))
    return found


class JobsUnreachable(DLockError):
    """The leader's jobs could not reach the database for too long (``step_down=True``)."""


def _unreachable(error: BaseException | None) -> bool:
    """Whether a job failed because its database connection is unusable."""
    from django.db import InterfaceError, OperationalError

    return isinstance(error, (OperationalError, InterfaceError, DatabaseUnavailable))


def run_jobs(
    leadership: Leadership,
    jobs: list[Job],
    report: Callable[[Job, float, BaseException | None], None] | None = None,
    *,
    unreachable_after: float | None = None,
    step_down: bool = False,
    alarm: Callable[[str], None] | None = None,
) -> None:
    """Run ``jobs`` on their intervals until ``leadership`` ends.

    Right before each run the term is checked on this process's clock
    (:attr:`Leadership.ended`, the deadline ``is_leader`` uses): a leader
    that was frozen past its renew deadline starts nothing. Database
    connections that are broken or older than ``CONN_MAX_AGE`` are closed
    before and after each run (what Django does around a request), so a job
    after a lost connection or a database restart gets a new one.

    A job that raises is logged with its traceback (and passed to
    ``report``); the loop goes on. ``report(job, seconds, error)`` is called
    after every run. When jobs have failed for lack of a database
    connection (``OperationalError`` / ``InterfaceError``, or a lock's
    :class:`~django_dlock.DatabaseUnavailable`) for longer than
    ``unreachable_after`` seconds, an error is logged; with ``step_down``,
    :class:`JobsUnreachable` is raised (``LeaderElection.run`` then steps
    down and raises it). ``alarm(message)`` is called with the same news
    (the loss, and the recovery).
    """
    from django.db import close_old_connections

    if not jobs:
        raise JobError("no jobs to run")
    due = [time.monotonic()] * len(jobs)
    failing_since: float | None = None
    warned = False
    while not leadership.ended:
        index = min(range(len(jobs)), key=due.__getitem__)
        wait = due[index] - time.monotonic()
        if wait > 0:
            leadership.wait(wait)
            continue
        close_old_connections()
        if leadership.ended:  # checked again right before the start
            break
        job = jobs[index]
        started = time.monotonic()
        error: BaseException | None = None
        try:
            with doing(f"job {job.path}"):
                job.func()
        except Exception as exc:
            error = exc
            logger.exception("django-dlock: job %s raised", job.path)
        finally:
            close_old_connections()
        due[index] = started + job.interval
        if report is not None:
            report(job, time.monotonic() - started, error)
        if not _unreachable(error):
            if warned:
                logger.warning(
                    "django-dlock: the jobs of %r reach the database again", leadership.name
                )
                if alarm is not None:
                    alarm("jobs reach the database again")
            failing_since, warned = None, False
            continue
        if failing_since is None:
            failing_since = started
        down = time.monotonic() - failing_since
        if unreachable_after is not None and down > unreachable_after and not warned:
            warned = True
            logger.error(
                "django-dlock: the leader of %r (term %s) is leading, but its jobs have not "
                "reached the database for %.1f s: %s",
                leadership.name,
                leadership.term,
                down,
                error,
            )
            if alarm is not None:
                alarm(f"jobs have not reached the database for {down:.1f} s: {error}")
            if step_down:
                raise JobsUnreachable(
                    f"the jobs of {leadership.name!r} have not reached the database for "
                    f"{down:.1f} s (last error: {error}); stepping down"
                )


def run_isolated_jobs(
    specs: list[tuple[str, float]],
    verbosity: int,
    unreachable_after: float,
    step_down: bool,
    leadership: Leadership,
) -> None:
    """The job loop of ``dlock_runworker --isolate``, in the child process of a term.

    ``specs`` are ``(dotted path, interval)`` pairs; lines go to this
    process's stdout and stderr, as ``dlock_runworker`` prints them.
    """
    import sys
    import traceback

    loaded = [Job(path, import_job(path), interval) for path, interval in specs]

    def report(job: Job, seconds: float, error: BaseException | None) -> None:
        if error is not None:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            sys.stderr.write(f"job {job.path} raised after {seconds:.3f} s:\n{text}\n")
            sys.stderr.flush()
        elif verbosity >= 2:
            line = f"ran {job.path} in {seconds:.3f} s"
            if verbosity >= 3:
                line = f"{time.strftime('%H:%M:%S')} {line}"
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def alarm(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    run_jobs(
        leadership,
        loaded,
        report,
        unreachable_after=unreachable_after,
        step_down=step_down,
        alarm=alarm,
    )


def cleanup() -> int:
    """Built-in job: delete free lease rows, in batches (``dlock_cleanup``).

    Runs :func:`django_dlock.cleanup.delete_free` on the database of the
    :class:`~django_dlock.models.Lock` model. Add
    ``"django_dlock.jobs.cleanup"`` to ``DLOCK_WORKER_JOBS`` (or run
    ``dlock_runworker --job django_dlock.jobs.cleanup``). Returns the rows deleted.
    """
    from django_dlock.cleanup import delete_free
    from django_dlock.conf import lock_alias

    alias = lock_alias()
    deleted = delete_free(alias)
    logger.info("django-dlock: cleanup deleted %d free lease row(s) on %r", deleted, alias)
    return deleted
