"""``manage.py dlock_selfcheck`` on each database, with real processes, and on a
broken setup: advisory locks through PgBouncer in transaction mode."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from . import pgbouncer

pytestmark = [pytest.mark.slow]

BOUNCER = "selfcheck_bouncer"


def run(*args: str, **options) -> str:
    out = StringIO()
    call_command("dlock_selfcheck", *args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


@pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])
def test_selfcheck_passes_on_each_database(alias, monkeypatch):
    monkeypatch.setenv("DLOCK_TEST_CHILD", "1")  # the children use the test databases
    out = run(using=alias, processes=3, seconds=1.0)
    # a direct connection hears its notifications: no warning about a pooler
    for check in ("one lock, here", "wake-ups", "mutual exclusion", "fencing order", "hand-off"):
        assert re.search(rf"^{re.escape(check)} +PASS", out, re.M), out
    assert "WARN" not in out, out
    # the shared PostgreSQL server has no standby
    replication = re.search(r"^replication +PASS +no standby streams", out, re.M)
    assert (replication is not None) == (alias == "default"), out
    found = re.search(r"(\d+) acquisitions by 3 processes, counter (\d+)", out)
    assert found and found.group(1) == found.group(2) and int(found.group(1)) > 0, out
    assert out.rstrip().endswith("dlock_selfcheck passed")


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_selfcheck_of_advisory_locks_passes_on_a_direct_connection(monkeypatch):
    monkeypatch.setenv("DLOCK_TEST_CHILD", "1")
    out = run(strategy="advisory", processes=2, seconds=0.5)
    assert re.search(r"^sessions +PASS +a direct connection", out, re.M), out
    assert re.search(r"^mutual exclusion +PASS", out, re.M), out


@pytest.fixture(scope="module")
def bouncer(django_db_setup, django_db_blocker):
    with django_db_blocker.unblock(), pgbouncer.attached(BOUNCER, "transaction") as running:
        yield running


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_selfcheck_fails_on_advisory_locks_behind_a_transaction_mode_pgbouncer(bouncer):
    out = StringIO()
    with pytest.raises(CommandError, match="dlock_selfcheck failed: one lock, here"):
        call_command("dlock_selfcheck", using=BOUNCER, strategy="advisory", processes=2, stdout=out)
    text = out.getvalue()
    assert re.search(r"^one lock, here +FAIL +SessionSwitched: .*transaction mode", text, re.M)
    assert "mutual exclusion" not in text  # nothing more was started


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_the_sessions_probe_sees_a_pooler_that_shares_sessions(bouncer):
    """The check behind "one lock, here": two clients, one server session."""
    from django_dlock.selfcheck import _sessions

    verdict = _sessions(BOUNCER, "advisory")
    assert verdict is not None and verdict.result == "FAIL", verdict
    assert "transaction mode" in verdict.detail
    assert _sessions(BOUNCER, "lease") is None  # a lease needs no session of its own


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_the_wake_ups_check_passes_on_a_direct_connection_with_a_fresh_listener():
    """The check waits for the listener's own test notification before it reads
    the listener's health: a listener started by the check itself hears."""
    from django_dlock import notify
    from django_dlock.selfcheck import _wake_ups

    old = notify._listeners.pop("default", None)
    if old is not None:
        old.stop()
    verdict = _wake_ups("default", "lease")
    assert verdict.result == "PASS", verdict
    assert "wakes the next waiter" in verdict.detail


@pytest.mark.django_db(transaction=True, databases=["default", BOUNCER])
def test_the_wake_ups_check_warns_behind_a_transaction_mode_pgbouncer(bouncer):
    from django_dlock import notify
    from django_dlock.selfcheck import _wake_ups

    old = notify._listeners.pop(BOUNCER, None)
    if old is not None:
        old.stop()
    try:
        verdict = _wake_ups(BOUNCER, "lease")
    finally:
        found = notify._listeners.pop(BOUNCER, None)
        if found is not None:
            found.stop()
    assert verdict.result == "WARN", verdict
    assert "cannot hear" in verdict.detail


def test_bad_options_are_command_errors():
    with pytest.raises(CommandError, match="--processes must be from 1 to 64"):
        run(processes=0)
    with pytest.raises(CommandError, match="unknown strategy 'zookeeper'"):
        run(strategy="zookeeper")
