"""The example site: its checks pass and the README's demo command works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _manage(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "testproject.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_site_checks_pass(tmp_path):
    result = _manage(tmp_path, "check")
    assert result.returncode == 0, result.stderr
    assert "no issues" in result.stdout


@pytest.mark.slow
def test_demo_shows_contention_and_clean_handoffs(tmp_path):
    result = _manage(tmp_path, "dlock_demo", "--rounds", "2", "--work", "0.2")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "database: sqlite3" in out
    assert out.count("ACQUIRED") == 4
    assert "4 acquisitions (expected 4)" in out and "overlapping holds: 0" in out
    assert "OK: one holder at a time" in out


def test_demo_rejects_bad_arguments(tmp_path):
    result = _manage(tmp_path, "dlock_demo", "--rounds", "0")
    assert result.returncode != 0
    assert "--workers and --rounds must be >= 1" in result.stderr


@pytest.mark.django_db(transaction=True)
def test_checkout_form_posts_with_its_csrf_token_and_a_refused_post_leaves_no_row():
    import re

    from django.conf import settings
    from django.test import Client, override_settings

    from django_dlock.models import Lock as LockRow
    from testproject import settings as site

    middleware = [*settings.MIDDLEWARE, "django_dlock.middleware.LockMiddleware"]
    with override_settings(
        ROOT_URLCONF="testproject.urls",
        MIDDLEWARE=middleware,
        DLOCK_MIDDLEWARE_RULES=site.DLOCK_MIDDLEWARE_RULES,
    ):
        browser = Client(enforce_csrf_checks=True)
        assert browser.post("/checkout/").status_code == 403  # no token: refused
        assert not LockRow.objects.filter(name__startswith="lock:checkout:").exists()
        form = browser.get("/checkout/").content.decode()
        found = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
        assert found is not None, form
        response = browser.post("/checkout/", {"csrfmiddlewaretoken": found.group(1)})
        assert response.status_code == 200 and response.json() == {"ordered": True}
        assert LockRow.objects.filter(name__startswith="lock:checkout:anon:").count() == 1


def test_the_example_job_logs_its_heartbeat_at_info_and_the_site_shows_it():
    """The example job logged each heartbeat at WARNING: routine news."""
    script = (
        "import logging, django; django.setup()\n"
        "from testproject.demo.jobs import heartbeat\n"
        "class Seen(logging.Handler):\n"
        "    def emit(self, record): print('LEVEL', record.levelname)\n"
        "logging.getLogger('testproject.demo.jobs').addHandler(Seen())\n"
        "heartbeat()\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["LEVEL INFO"]
    assert "heartbeat from " in result.stderr  # the site's console handler printed it


def test_the_demo_says_why_its_fences_have_gaps():
    """On PostgreSQL the demo printed fences 1..9 for 6 grants, unexplained."""
    import io

    from testproject.demo.management.commands.dlock_demo import Command

    def held(start: int, fence: int) -> str:
        return f"worker A: released      [held {start} {start + 5} {fence}]"

    out = io.StringIO()
    Command(stdout=out)._summary([held(0, 1), held(10, 3), held(20, 5)], 3)
    assert "fences 1..5 for 3 acquisitions: the numbers have gaps" in out.getvalue()
    out = io.StringIO()
    Command(stdout=out)._summary([held(0, 1), held(10, 2)], 2)
    assert "gaps" not in out.getvalue()
