"""Importing code that declares locks never fails on settings.

A urlconf that imports a module-level ``@with_lock`` view (or a module-level
``@dlock.lock(...)`` function) must import even when ``DLOCK_DEFAULT_*``
settings are invalid, so that ``manage.py check`` reports dlock.E001/E002
instead of dying with a traceback. Each test runs a real ``manage.py check``
in a fresh interpreter, on a settings module and urlconf written for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.test import override_settings

import django_dlock as dlock
from django_dlock.decorators import with_lock

# ``manage.py check`` runs in a child process on the test databases (Django 6
# also runs the database checks there), so they must exist.
pytestmark = pytest.mark.django_db(databases=["default", "sqlite", "mysql"])

ROOT = Path(__file__).resolve().parent.parent

WITH_LOCK_VIEWS = """
from django.http import HttpResponse
from django_dlock.decorators import with_lock

@with_lock("invoice:{invoice_id}")
def pay(request, invoice_id):
    return HttpResponse("paid")
"""

LOCK_FUNCTIONS = """
import django_dlock as dlock
from django.http import HttpResponse

@dlock.lock(timeout=0, on_fail="skip")
def nightly_report():
    return "done"

@dlock.lock("report")
def report():
    return "done"

def pay(request, invoice_id):
    return HttpResponse(nightly_report())
"""

URLS = """
from django.urls import path
from importcheck_views import pay

urlpatterns = [path("invoice/<int:invoice_id>/", pay)]
"""


def manage_check(
    tmp_path: Path, views: str, **settings: object
) -> subprocess.CompletedProcess[str]:
    """Run ``manage.py check`` with ``settings`` on top of the test settings."""
    lines = ["from tests.settings import *  # noqa", 'ROOT_URLCONF = "importcheck_urls"']
    lines += [f"{name} = {value!r}" for name, value in settings.items()]
    (tmp_path / "importcheck_settings.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "importcheck_urls.py").write_text(textwrap.dedent(URLS))
    (tmp_path / "importcheck_views.py").write_text(textwrap.dedent(views))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    env["DJANGO_SETTINGS_MODULE"] = "importcheck_settings"
    # The test databases: Django 6's ``check`` also runs the database checks.
    env["DLOCK_TEST_CHILD"] = "1"
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


BAD_SETTINGS = [
    ({"DLOCK_DEFAULT_STRATEGY": "zookeeper"}, "dlock.E001"),
    ({"DLOCK_DEFAULT_TTL": 0}, "dlock.E002"),
    ({"DLOCK_DEFAULT_TTL": "30"}, "dlock.E002"),
]


@pytest.mark.parametrize(("settings", "check_id"), BAD_SETTINGS)
def test_check_reports_bad_settings_with_a_with_lock_view(tmp_path, settings, check_id):
    result = manage_check(tmp_path, WITH_LOCK_VIEWS, **settings)
    assert "Traceback" not in result.stderr, result.stderr
    assert check_id in result.stderr
    assert result.returncode == 1


def test_check_passes_with_good_settings(tmp_path):
    result = manage_check(tmp_path, WITH_LOCK_VIEWS)
    assert result.returncode == 0, result.stderr
    # (Django 6 also runs its database checks: mysql.W003 may be reported)
    assert not re.search(r"dlock\.[EW]\d", result.stdout + result.stderr)


@pytest.mark.parametrize(("settings", "check_id"), BAD_SETTINGS[:2])
def test_check_reports_bad_settings_with_a_module_level_lock(tmp_path, settings, check_id):
    result = manage_check(tmp_path, LOCK_FUNCTIONS, **settings)
    assert "Traceback" not in result.stderr, result.stderr
    assert check_id in result.stderr
    assert result.returncode == 1


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("DLOCK_DEFAULT_STRATEGY", "zookeeper", dlock.StrategyNotSupported),
        ("DLOCK_DEFAULT_TTL", 0, ValueError),
    ],
)
def test_bad_settings_surface_at_the_first_call(setting, value, error):
    with override_settings(**{setting: value}):

        @with_lock("k")
        def work(request):  # decorating does not read the settings
            raise AssertionError("must not run")

        with pytest.raises(error):
            work(None)


def test_without_the_app_installed_check_says_to_add_it(tmp_path):
    """A project whose models declare locks, "django_dlock" left out of
    INSTALLED_APPS: ``check`` passed and the locks ran (or NotMigrated said to
    run a migrate that fails)."""
    app = tmp_path / "importcheck_app"
    app.mkdir()
    (app / "__init__.py").write_text("")
    (app / "models.py").write_text(textwrap.dedent(LOCK_FUNCTIONS))
    installed = ["django.contrib.contenttypes", "django.contrib.auth", "importcheck_app"]
    result = manage_check(tmp_path, LOCK_FUNCTIONS, INSTALLED_APPS=installed, MIDDLEWARE=[])
    assert result.returncode == 1, result.stdout + result.stderr
    assert "(dlock.E000)" in result.stderr, result.stderr
    assert '"django_dlock" is not in INSTALLED_APPS: add it there' in result.stderr
    assert "Traceback" not in result.stderr
