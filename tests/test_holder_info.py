"""Who holds a lock, as the admin, ``dlock_list`` and ``dlock_show`` show it: the
process (and its management command), the thread or task, what it is doing (a
request, a Celery task, a worker job) and what ``DLOCK_HOLDER_INFO`` adds."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.test import Client, override_settings

import django_dlock as dlock

from .helpers import wait_until
from .views import PROBE

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent


def owner_of(name: str) -> str:
    from django_dlock.models import Lock as LockRow

    return LockRow.objects.held().get(name=name).owner


def test_a_views_lock_names_the_request():
    PROBE.reset()
    PROBE.close_gate()
    statuses: list[int] = []

    def call() -> None:
        try:
            statuses.append(Client().post("/invoice/77/?secret=1").status_code)
        finally:
            connections.close_all()

    thread = threading.Thread(target=call)
    thread.start()
    try:
        wait_until(lambda: PROBE.entered == 1)
        owner = owner_of("lock:invoice:77")
        assert owner.endswith("(POST /invoice/77/)"), owner
        assert "secret" not in owner  # never the query string
        out = call_command_output("dlock_list")
        assert "(POST /invoice/77/)" in out
    finally:
        PROBE.gate.set()
        thread.join(30)
    assert statuses == [200]


def call_command_output(*args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_a_celery_runs_lock_names_the_task():
    from celery import Celery

    from django_dlock.contrib.celery import SingleInstanceTask

    app = Celery("holder-info", set_as_current=False)
    seen: list[str] = []

    @app.task(base=SingleInstanceTask, name="billing.charge", lock_args=["invoice"])
    def charge(invoice: int) -> None:
        seen.append(owner_of("lock:celery:billing.charge:1"))

    charge(1)  # run here, as a worker runs it (no broker needed)
    assert seen and seen[0].endswith("(celery billing.charge)"), seen


def test_a_worker_jobs_locks_name_the_job():
    from django_dlock.jobs import Job, run_jobs

    seen: list[str] = []

    class Term:
        """A term that ends after one run (the jobs' loop asks only this)."""

        name = "holder-info"
        ended = False

        def wait(self, timeout: float | None = None) -> bool:
            return self.ended

    term = Term()

    def job() -> None:
        with dlock.lock("nightly"):
            seen.append(owner_of("lock:nightly"))
        term.ended = True

    run_jobs(term, [Job(path="reports.jobs.nightly", func=job, interval=60)])  # type: ignore[arg-type]
    assert seen and seen[0].endswith("(job reports.jobs.nightly)"), seen


def tenant() -> str:
    return "tenant=7"


def broken() -> str:
    raise RuntimeError("no tenant here")


def test_holder_info_adds_to_every_owner(caplog):
    with (
        override_settings(DLOCK_HOLDER_INFO="tests.test_holder_info.tenant"),
        dlock.lock("tenanted"),
    ):
        assert owner_of("lock:tenanted").endswith(" tenant=7")
    with override_settings(DLOCK_HOLDER_INFO=broken), dlock.lock("tenanted"):
        assert "tenant" not in owner_of("lock:tenanted")  # the lock is still taken
    assert any("DLOCK_HOLDER_INFO raised" in r.getMessage() for r in caplog.records)
    with dlock.lock("tenanted"):
        assert "tenant" not in owner_of("lock:tenanted")


@pytest.mark.parametrize("value", ["tests.test_holder_info.nothing", "tests.test_holder_info.ROOT"])
def test_a_bad_holder_info_is_a_system_check_error(value):
    with override_settings(DLOCK_HOLDER_INFO=value), pytest.raises(SystemCheckError, match="E042"):
        call_command("check")


def test_a_management_commands_locks_name_the_command():
    code = "from django_dlock.identity import current_holder; print(current_holder().owner())"
    admin = Path(sys.executable).parent / "django-admin"
    done = subprocess.run(
        [str(admin), "shell", "-c", code],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert f"pid={done.stdout.split('pid=')[1].split()[0]} django-admin shell " in done.stdout


def test_an_advisory_locks_session_is_named_after_its_holder():
    """pg_locks rows get a name: the session's application_name is its holder's
    owner text (what the request or task is doing included), as pg_stat_activity,
    dlock_list and the admin's advisory page show it."""
    from django_dlock.identity import doing

    from .helpers import give_back_sessions, in_thread, pg_locks

    try:
        with doing("POST /invoice/42/"), dlock.lock("invoice:42", strategy="advisory"):
            ((pid, _),) = pg_locks("invoice:42")
            with connections["default"].cursor() as cur:
                cur.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
                (name,) = cur.fetchone()
            assert name.startswith("dlock ") and "pid=" in name
            assert "(POST /invoice/42/)" in name
            out = StringIO()
            call_command("dlock_list", stdout=out)
            assert "POST /invoice/42/" in out.getvalue()
        # released: the session is idle in the pool, and keeps its last holder's
        # name (no statement renames it) until the next holder takes it
        assert pg_locks("invoice:42") == []
        with connections["default"].cursor() as cur:
            cur.execute("SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid])
            assert cur.fetchone() == (name,)

        def next_holder() -> str:
            try:
                with doing("POST /invoice/43/"), dlock.lock("invoice:43", strategy="advisory"):
                    ((again, _),) = pg_locks("invoice:43")
                    assert again == pid  # the pooled session, renamed
                    with connections["default"].cursor() as cur:
                        cur.execute(
                            "SELECT application_name FROM pg_stat_activity WHERE pid = %s", [pid]
                        )
                        return str(cur.fetchone()[0])
            finally:
                connections.close_all()

        renamed = in_thread(next_holder)
        assert renamed.startswith("dlock ") and "(POST /invoice/43/)" in renamed
    finally:
        give_back_sessions()
