"""PostgreSQL on psycopg2: a site that has not installed psycopg 3 keeps its
driver. ``lease``, ``row`` and ``advisory_xact`` work (through Django's
cursor, waiters polling), ``advisory`` is refused by name, and a site
without PostgreSQL needs no PostgreSQL driver at all."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"]),
]

ROOT = Path(__file__).resolve().parent.parent


def _run_without_psycopg3(tmp_path: Path, script: str) -> str:
    """Run ``script`` in a child whose ``import psycopg`` fails (psycopg 3 "not
    installed"), on the test databases; its output."""
    blocked = tmp_path / "blocked" / "psycopg"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ImportError("psycopg 3 is not installed")\n')
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(blocked.parent), str(ROOT)]),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DLOCK_TEST_CHILD": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_postgresql_on_psycopg2(tmp_path):
    out = _run_without_psycopg3(
        tmp_path,
        """
        import threading

        import django
        django.setup()
        from django.db import connections, transaction
        import django_dlock as dlock

        print("driver", connections["default"].Database.__name__)
        with dlock.lock("p2", using="default", ttl=10) as lk:
            print("lease", lk.fence is not None)
            # a waiter polls (no LISTEN without psycopg 3) and gets the key
            got = []
            waiter = threading.Thread(
                target=lambda: got.append(dlock.lock("p2", using="default").acquire(timeout=0))
            )
            waiter.start(); waiter.join()
            print("busy", got)
        other = dlock.lock("p2", using="default")
        print("free", other.acquire(timeout=5)); other.release()
        for strategy in ("row", "advisory_xact"):
            with transaction.atomic(using="default"), dlock.lock("p2x", strategy=strategy):
                print(strategy, "ok")
        lk = dlock.lock("p2", using="default", strategy="advisory")
        try:
            lk.acquire(timeout=0)
        except dlock.StrategyNotSupported as exc:
            print("advisory refused:", exc)
        from django.core.checks import run_checks
        from django.test.utils import override_settings
        with override_settings(DLOCK_DEFAULT_STRATEGY="advisory"):
            print("checks", [m.id for m in run_checks() if m.id.startswith("dlock.")])
        """,
    )
    assert "driver psycopg2" in out
    assert "lease True" in out
    assert "busy [False]" in out
    assert "free True" in out
    assert "row ok" in out and "advisory_xact ok" in out
    assert "advisory refused: the advisory strategy on PostgreSQL needs psycopg 3" in out
    assert 'pip install -e ".[postgresql]"' in out
    assert "checks ['dlock.E014']" in out


def test_a_site_without_postgresql_needs_no_postgresql_driver(tmp_path):
    out = _run_without_psycopg3(
        tmp_path,
        """
        import sys

        import django
        from django.conf import settings

        sys.modules["psycopg2"] = None  # no PostgreSQL driver at all
        import tests.settings as base

        settings.configure(
            INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_dlock"],
            DATABASES={"default": base.DATABASES["sqlite"]},
            USE_TZ=True,
        )
        django.setup()
        import django_dlock as dlock
        from django.core.management import call_command

        with dlock.lock("nopg", timeout=1) as lk:
            print("sqlite", lk.held())
        call_command("check")
        print("psycopg loaded:", "psycopg" in sys.modules and sys.modules["psycopg"] is not None)
        """,
    )
    assert "sqlite True" in out
    assert "psycopg loaded: False" in out
