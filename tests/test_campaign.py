"""The fault campaign (tests/campaign.py), bounded, on a PostgreSQL cluster of its own.

Holder processes are paused past their lease, killed, have their sessions
ended, and the cluster is restarted; the campaign exits non-zero on a false
loss, a raw driver error from a django-dlock call, a guard that reported an
error for writes that committed (or returned for writes that did not), or
two holders' guarded writes interleaved.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from django.db import connections

from . import campaign, pgcluster


@pytest.mark.slow
@pytest.mark.skipif(pgcluster.available() is not None, reason=str(pgcluster.available()))
def test_campaign_on_a_private_postgresql_cluster(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DLOCK_TEST_CHILD": "1"}
    command = [sys.executable, "-m", "tests.campaign", "--seconds", "35", "--seed", "43"]
    command += ["--private-cluster", "--logs", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]


def _events(folder, holder, *events):
    with open(folder / f"holder-{holder}.jsonl", "w") as f:
        for event in events:
            f.write(json.dumps({"t": 0.0, **event}) + "\n")


@pytest.mark.django_db(transaction=True, databases=["sqlite"])
def test_the_checks_find_each_kind_of_violation(tmp_path):
    """The campaign's checks, on logs and rows made by hand (no faults run)."""
    with connections["sqlite"].cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {campaign.TABLE}")
        cur.execute(campaign._DDL["sqlite"].format(t=campaign.TABLE))
        insert = (
            f"INSERT INTO {campaign.TABLE} (k, fence, holder, seq, uid) VALUES (%s, %s, %s, %s, %s)"
        )
        cur.execute(insert, ["k", 5, "h", 1, "h.1"])  # returned, committed: fine
        cur.execute(insert, ["k", 5, "h", 3, "h.3"])  # raised LockLost, committed
        cur.execute(insert, ["k", 4, "g", 1, "g.1"])  # an older fence after a newer one
    raw = {
        "raw": True,
        "exc": "OperationalError",
        "msg": "boom",
        "tb": "Traceback (most recent call last): ...",
        "repr": "OperationalError('boom')",
    }
    _events(
        tmp_path,
        "h",
        {"ev": "acquire", "gid": 1, "m": 100.0},
        {"ev": "grant", "gid": 1, "key": "k", "fence": 5, "waited": 0.0, "m": 100.0},
        {"ev": "guard", "uid": "h.1", "gid": 1, "fence": 5, "m": 100.1},
        {"ev": "guard_end", "uid": "h.1", "gid": 1, "ok": True, "took": 0.1, "m": 100.2},
        {"ev": "guard", "uid": "h.2", "gid": 1, "fence": 5, "m": 100.2},
        {"ev": "guard_end", "uid": "h.2", "gid": 1, "ok": True, "took": 0.1, "m": 100.3},
        {"ev": "guard", "uid": "h.3", "gid": 1, "fence": 5, "m": 100.3},
        {
            "ev": "guard_end",
            **{"uid": "h.3", "gid": 1, "ok": False, "where": "guard", "took": 0.1, "m": 100.4},
            **{"exc": "LockLost", "msg": "lost"},
        },
        {"ev": "call", "where": "extend", "gid": 1, "ok": False, "took": 0.0, "m": 100.4, **raw},
        # reported lost 0.5 s into a 2 s lease, no fault: false whatever the probe says
        {"ev": "loss", "loss": 1, "via": "on_lost", "gid": 1, "key": "k", "m": 100.5},
        {"ev": "probe", "loss": 1, "ours": False, "row": None, "m": 100.6},
        # the database still had the lease, 1 s of it
        {"ev": "loss", "loss": 2, "via": "guard", "gid": 1, "key": "k", "m": 103.0},
        {"ev": "probe", "loss": 2, "ours": True, "fence": 5, "left": 1.0, "m": 103.1},
        # reported at the holder's lease end, a moment before the database's: allowed
        {"ev": "loss", "loss": 3, "via": "on_lost", "gid": 1, "key": "k", "m": 103.0},
        {"ev": "probe", "loss": 3, "ours": True, "fence": 5, "left": 0.01, "m": 103.1},
    )
    report = campaign.check("sqlite", tmp_path, [], ttl=2.0, notes=[])
    found = {kind: len(items) for kind, items in report.violations.items()}
    assert found == {
        "false loss (reported within the ttl, no fault)": 1,
        "false loss (the database still had the lease)": 1,
        "guard returned but its row is missing": 1,
        "guard reported an error but its row committed": 1,
        "raw error from a django-dlock call (first of each kind)": 1,
        "exclusion": 1,
    }
    assert report.counts["loss reports at the local lease end"] == 1
    assert "violations: 6" in report.as_text()
