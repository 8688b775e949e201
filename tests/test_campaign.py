"""The fault campaign (tests/campaign.py), bounded, on a PostgreSQL cluster of its own.

Holder processes are paused past their lease, killed, have their sessions
ended, and the cluster is restarted; the campaign exits non-zero on a false
loss, a raw driver error from a django-dlock call, a guard that reported an
error for writes that committed (or returned for writes that did not), or
two holders' guarded writes interleaved.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from . import pgcluster


@pytest.mark.slow
@pytest.mark.skipif(pgcluster.available() is not None, reason=str(pgcluster.available()))
def test_campaign_on_a_private_postgresql_cluster(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DLOCK_TEST_CHILD": "1"}
    command = [sys.executable, "-m", "tests.campaign", "--seconds", "35", "--seed", "43"]
    command += ["--private-cluster", "--logs", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
