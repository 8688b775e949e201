"""``manage.py dlock_runworker``: run jobs on the elected leader only.

Start it on every machine; one of them leads and runs the jobs, the others
stand by and take over when it stops or dies::

    python manage.py dlock_runworker --job myapp.jobs.send_reminders --interval 30
    python manage.py dlock_runworker      # the jobs of DLOCK_WORKER_JOBS

``manage.py runworker`` is an alias (the same command class, see
``runworker.py``). Django Channels has a ``runworker`` command too: when
both apps are installed, the app listed first in ``INSTALLED_APPS`` owns
``runworker``, while ``dlock_runworker`` is always this one. The election's
default name stays ``"runworker"`` (lock ``leader:runworker``), so workers
started under either name campaign in the same election.

SIGTERM / SIGINT: the running job finishes, the worker steps down (a standby
takes over at once) and exits with status 0. A second signal does not wait.
``--isolate`` runs the jobs in a child process that cannot starve the
renewals and is stopped when the term is lost.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_dlock import signals
from django_dlock.conf import conf
from django_dlock.exceptions import DLockError
from django_dlock.jobs import (
    DEFAULT_INTERVAL,
    Job,
    JobError,
    load_jobs,
    run_isolated_jobs,
    run_jobs,
)
from django_dlock.leader import LeaderElection, Leadership


class Command(BaseCommand):
    help = (
        "Run jobs on the leader only: every worker campaigns in a leader election, "
        "the leader runs the jobs on their intervals, the others stand by."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--job",
            action="append",
            dest="jobs",
            default=[],
            metavar="DOTTED.PATH",
            help="a job to run (a callable without arguments); repeatable. "
            "Without --job, the jobs of DLOCK_WORKER_JOBS run.",
        )
        parser.add_argument(
            "--interval",
            type=float,
            default=DEFAULT_INTERVAL,
            help=f"seconds between two runs of a job (default {DEFAULT_INTERVAL:g})",
        )
        parser.add_argument(
            "--election", default="runworker", help='the election\'s name (default "runworker")'
        )
        parser.add_argument(
            "--lease", type=float, default=15.0, help="leadership lease in seconds (default 15)"
        )
        parser.add_argument(
            "--renew-deadline",
            type=float,
            default=10.0,
            help="seconds a leader keeps trying to renew before it stops leading (default 10)",
        )
        parser.add_argument(
            "--retry",
            type=float,
            default=2.0,
            help="seconds between attempts to acquire or renew (default 2)",
        )
        parser.add_argument(
            "--strategy", default="lease", help='"lease" (default) or "advisory" (PostgreSQL)'
        )
        parser.add_argument(
            "--using",
            "--database",
            dest="using",
            default=None,
            metavar="ALIAS",
            help="database alias of the election (--database is the same option)",
        )
        parser.add_argument(
            "--isolate",
            action="store_true",
            help="run the jobs in a child process that is stopped (SIGTERM, then SIGKILL) "
            "when the term is lost: a job that holds the GIL cannot starve the renewals",
        )
        parser.add_argument(
            "--step-down-when-unreachable",
            action="store_true",
            help="when the jobs have not reached the database for longer than the renew "
            "deadline, step down and exit with status 1 (default: keep leading and log "
            "an error)",
        )
        parser.add_argument(
            "--identity", default=None, help='how this worker is named (default "<host> pid=<pid>")'
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.verbosity = int(options["verbosity"])
        self._mutex = threading.Lock()
        try:
            jobs = load_jobs(options["jobs"], options["interval"], conf.WORKER_JOBS)
        except JobError as exc:
            raise CommandError(str(exc)) from None
        if not jobs:
            raise CommandError("no jobs to run: give --job dotted.path or set DLOCK_WORKER_JOBS")
        try:
            election = LeaderElection(
                options["election"],
                lease=options["lease"],
                renew_deadline=options["renew_deadline"],
                retry=options["retry"],
                strategy=options["strategy"],
                using=_aliases(options["using"]),
                identity=options["identity"],
            )
        except (ValueError, DLockError) as exc:
            raise CommandError(str(exc)) from None
        if options["isolate"]:  # (else _lead says it, before the jobs' first output)
            election.on_started_leading = lambda term: self._say(f"became leader (term {term})")
        election.on_stopped_leading = lambda: self._stopped(election)
        self.jobs = jobs
        self.election = election
        names = ", ".join(f"{job.path} every {job.interval:g} s" for job in jobs)
        self._say(
            f"worker {election.identity!r} campaigning in election {election.name!r} "
            f"({election.strategy}, lease {election.lease:g} s): {names}"
        )
        self.step_down = bool(options["step_down_when_unreachable"])
        signals.leader_changed.connect(self._leader_changed, weak=False)
        try:
            if options["isolate"]:
                target = functools.partial(
                    run_isolated_jobs,
                    [(job.path, job.interval) for job in jobs],
                    self.verbosity,
                    election.renew_deadline,
                    self.step_down,
                )
                election.run(target, isolate=True)
            else:
                election.run(self._lead)
        except DLockError as exc:
            raise CommandError(str(exc)) from None
        finally:
            signals.leader_changed.disconnect(self._leader_changed)

    # -- the leader's work -------------------------------------------------------

    def _lead(self, leadership: Leadership) -> None:
        # said here, in the thread that runs the jobs: on_started_leading runs in
        # the election's callback thread, and came after a job's first output
        self._say(f"became leader (term {leadership.term})")
        run_jobs(
            leadership,
            self.jobs,
            self._report,
            unreachable_after=self.election.renew_deadline,
            step_down=self.step_down,
            alarm=self._alarm,
        )

    def _alarm(self, line: str) -> None:
        with self._mutex:
            self.stderr.write(line)
            self.stderr.flush()

    def _report(self, job: Job, seconds: float, error: BaseException | None) -> None:
        if error is not None:
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            with self._mutex:
                self.stderr.write(f"job {job.path} raised after {seconds:.3f} s:\n{text}")
                self.stderr.flush()
            return
        if self.verbosity >= 2:
            self._say(f"ran {job.path} in {seconds:.3f} s")

    # -- lifecycle lines -------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self.verbosity < 1:
            return
        with self._mutex:
            if self.verbosity >= 3:
                line = f"{time.strftime('%H:%M:%S')} {line}"
            self.stdout.write(line)
            self.stdout.flush()

    def _leader_changed(
        self, sender: Any, *, leader: str | None, term: int | None, election: Any, **kwargs: Any
    ) -> None:
        if election is self.election and leader is not None and leader != election.identity:
            self._say(f"standing by, leader is {leader} (term {term})")

    def _stopped(self, election: LeaderElection) -> None:
        reason = election.stopped_reason or ""
        if reason.startswith("lost"):
            self._say(f"lost leadership ({reason.partition(': ')[2]})")
        else:
            self._say("stepped down")


def _aliases(using: str | None) -> Any:
    """``--using a,b,c`` names a quorum of databases (a list); one name stays a name."""
    if using is None or "," not in using:
        return using
    return [alias.strip() for alias in using.split(",")]
