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
