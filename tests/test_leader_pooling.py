"""Leader elections behind PgBouncer in transaction mode.

A candidate's attempt to take the lease is a lock statement: when every
server connection of the pooler is busy, the statement waits in PgBouncer's
client queue (which ignores a cancel) until ``query_wait_timeout``. The
election gives such an attempt up at its ``retry`` period, like a lock's
acquire at its timeout, and tries again at its next turn.
"""

from __future__ import annotations

import logging
import time

import pytest

import django_dlock as dlock

from .helpers import wait_until
from .test_pooling import TINY, _lease_rows, pool_held_busy, tiny_bouncer  # noqa: F401


@pytest.mark.django_db(transaction=True, databases=["default", TINY])
def test_a_campaign_attempt_behind_a_busy_pgbouncer_is_given_up_at_the_retry_period(
    tiny_bouncer,  # noqa: F811
    caplog,
):
    caplog.set_level(logging.WARNING, logger="django_dlock")
    election = dlock.LeaderElection(
        "pgb-busy", using=TINY, lease=8.0, renew_deadline=3.0, retry=0.5
    )
    with pool_held_busy(tiny_bouncer):
        election.start()
        try:
            # Longer than renew_deadline: an unbounded attempt would still be
            # waiting in PgBouncer's queue and be abandoned with its thread.
            end = time.monotonic() + 4.5
            while time.monotonic() < end:
                assert not election.is_leader
                time.sleep(0.1)
            assert _lease_rows("leader:pgb-busy") == []
        except BaseException:
            election.stop()
            raise
    try:
        wait_until(lambda: election.is_leader, 30)
    finally:
        election.stop()
    messages = [record.getMessage() for record in caplog.records]
    given_up = [m for m in messages if "campaign attempt failed" in m]
    assert given_up, messages
    assert not [m for m in given_up if "did not answer" in m], given_up
