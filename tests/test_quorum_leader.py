"""Leader elections on a quorum: ``LeaderElection(using=["q1", "q2", "q3"])``.

Three real PostgreSQL databases on the test server; one is taken down with
``ALLOW_CONNECTIONS false`` and terminated sessions (see test_quorum.py).
Waits are bounded ("within N seconds" bounds a wait, never a speed claim).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db import connections

import django_dlock as dlock
from django_dlock import notify
from django_dlock.strategies import quorum

from .helpers import wait_until
from .test_quorum import QUORUM, bring_up, rows, take_down
from .test_runworker import FAST, LEASE, RETRY, SLACK, Worker, check_terms, leaders, read_runs

DATABASES = ["default", *QUORUM]
pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)

NAME = "leader:{}"


@pytest.fixture(autouse=True)
def _close_workers() -> Iterator[None]:
    yield
    quorum.close_all()
    notify.stop_all()


@pytest.fixture
def outage() -> Iterator[None]:
    """For tests that take databases down: all are back afterwards."""
    yield
    for alias in QUORUM:
        bring_up(alias)
    quorum.close_all()
    connections.close_all()


def election(name: str, **kwargs) -> dlock.LeaderElection:
    kwargs.setdefault("lease", 6.0)
    kwargs.setdefault("renew_deadline", 3.0)
    kwargs.setdefault("retry", 0.5)
    return dlock.LeaderElection(name, using=QUORUM, **kwargs)


def live_on(name: str) -> list[str]:
    """The databases (among those up) where the election's lease is live."""
    found = []
    for alias in QUORUM:
        try:
            row = rows(alias, NAME.format(name))
        except Exception:
            connections[alias].close()
            continue
        if row is not None and row[2]:
            found.append(alias)
    return found


def expiry(alias: str, name: str):
    with connections[alias].cursor() as cur:
        cur.execute("SELECT expire_at FROM django_dlock_lock WHERE name = %s", [NAME.format(name)])
        return cur.fetchone()[0]


# -- bad input: clear errors before any SQL ------------------------------------------------


@pytest.mark.django_db(databases=[])
@pytest.mark.parametrize(
    ("using", "error", "message"),
    [
        ([], ValueError, "names no database"),
        (["q1", "q2", "q1"], ValueError, "'q1' more than once"),
        (["q1", "nope"], ValueError, "unknown database alias 'nope'"),
    ],
)
def test_bad_quorums_are_refused(using, error, message):
    with pytest.raises(error, match=message):
        dlock.LeaderElection("bad", using=using)


@pytest.mark.django_db(databases=[])
def test_the_advisory_strategy_cannot_lead_on_a_quorum():
    with pytest.raises(dlock.StrategyNotSupported, match="needs strategy='lease'"):
        dlock.LeaderElection("bad", using=QUORUM, strategy="advisory")
    with pytest.raises(CommandError, match="more than once"):
        call_command(
            "dlock_runworker", "--job", "tests.jobs.hello", "--using", "q1,q2,q1", stdout=StringIO()
        )


# -- one leader on a majority ---------------------------------------------------------


def test_a_leader_keeps_leading_with_one_database_down_and_steps_down_without_a_majority(
    outage,
):
    stopped: list[str] = []
    leader = election("q-lead", on_stopped_leading=lambda: stopped.append("stopped"))
    leader.start()
    try:
        wait_until(lambda: leader.is_leader, 30)
        term = leader.term
        assert len(live_on("q-lead")) >= 2
        record = leader.leader()
        assert record is not None and record.term == term
        assert record.identity == leader.identity

        take_down("q3")
        # It renews on q1 and q2: their leases move on while it still leads.
        before = expiry("q1", "q-lead")
        wait_until(lambda: expiry("q1", "q-lead") > before and expiry("q2", "q-lead") > before, 30)
        assert leader.is_leader and leader.term == term and not stopped
        assert leader.leader().term == term

        take_down("q1")
        wait_until(lambda: not leader.is_leader, 30)
        # It stopped leading before its lease ran out on the database that is
        # left: its release there matched a live lease (a release only
        # clears the token of an unexpired lease), so no other candidate
        # could have taken the leadership while it still led.
        wait_until(lambda: rows("q2", NAME.format("q-lead"))[0] == "", 30)
        assert leader.stopped_reason is not None
        assert leader.stopped_reason.startswith("lost")
        wait_until(lambda: stopped == ["stopped"], 10)
        with pytest.raises(dlock.QuorumUnavailable):
            leader.leader()
    finally:
        bring_up("q1")
        bring_up("q3")
        leader.stop()


def test_without_a_majority_a_candidate_tries_once_per_retry_period(outage, caplog):
    # Each failed round gives back the lease it took on the database that is
    # up, and that release notifies: a candidate woken by it would try again
    # at once, in a loop. Between two attempts it sleeps at least
    # 0.8 * retry (the jitter's floor), so 4 s allow at most 11 attempts.
    caplog.set_level(logging.WARNING, logger="django_dlock")
    take_down("q1")
    take_down("q3")
    candidate = election("q-spin", retry=0.5)
    candidate.start()
    try:
        time.sleep(4)
    finally:
        candidate.stop()
    attempts = [r for r in caplog.records if "campaign attempt failed" in r.getMessage()]
    assert attempts, "the candidate never tried"
    assert all("QuorumUnavailable" in r.getMessage() for r in attempts)
    assert len(attempts) <= 11, len(attempts)
    assert not candidate.is_leader


def test_a_standby_takes_over_and_the_term_grows_across_changing_majorities(outage):
    """Each new leader's term is above every earlier one, even when its
    majority shares a single database with the majority before it.

    q3's fencing sequence is far ahead: a term won on a majority with q3 is
    big, and the next majority without q3 must still give a bigger one.
    """
    with connections["q3"].cursor() as cur:
        cur.execute("SELECT setval('django_dlock_fence', 100000)")
    terms = []
    for down in ("q1", "q3", "q2", "q3", "q1"):
        take_down(down)
        first, standby = election("q-terms"), election("q-terms")
        first.start()
        try:
            wait_until(lambda: first.is_leader, 30)  # noqa: B023
            terms.append(first.term)
            standby.start()
            wait_until(lambda: standby.leader() is not None, 30)  # noqa: B023
            assert not standby.is_leader
            first.stop()  # steps down: the standby takes over
            wait_until(lambda: standby.is_leader, 30)  # noqa: B023
            terms.append(standby.term)
            assert standby.leader().identity == standby.identity
        finally:
            first.stop()
            standby.stop()
        bring_up(down)
    assert all(a < b for a, b in zip(terms, terms[1:], strict=False)), terms
    assert max(terms) > 100000


# -- runworker --using q1,q2,q3: real processes --------------------------------------------


def test_runworker_on_a_quorum_runs_the_job_on_one_worker_and_fails_over(tmp_path, outage):
    runs = str(tmp_path / "runs.jsonl")
    args = [
        "--job",
        "tests.jobs.record_term",
        "--interval",
        "0.1",
        "--election",
        "quorum-workers",
        "--using",
        "q1,q2,q3",
        *FAST,
    ]
    workers = [Worker(*args, runs=runs) for _ in range(2)]
    try:
        wait_until(lambda: len(leaders(workers)) == 1, 60)
        first = leaders(workers)[0]
        wait_until(lambda: len(read_runs(runs)) >= 5, 30)
        take_down("q2")  # one database down: the same leader goes on
        count = len(read_runs(runs))
        wait_until(lambda: len(read_runs(runs)) >= count + 5, 30)
        assert leaders(workers) == [first]
        bring_up("q2")

        first.signal(signal.SIGKILL)  # the lease runs out, the standby leads
        first.wait()
        second = next(w for w in workers if w is not first)
        wait_until(lambda: second.leading, LEASE + RETRY + SLACK + 30)
        count = len(read_runs(runs))
        wait_until(lambda: len(read_runs(runs)) >= count + 5, 30)
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
    finally:
        for worker in workers:
            worker.kill()
    table = check_terms(read_runs(runs))
    assert [pid for _, pid, _, _ in table] == [first.pid, second.pid]
    assert "Traceback" not in second.stderr()


# -- a quorum of different database engines ------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "q1", "sqlite", "mysql"])
def test_a_quorum_of_postgresql_sqlite_and_mariadb_elects_one_leader():
    aliases = ["q1", "sqlite", "mysql"]
    first = dlock.LeaderElection("mixed", using=aliases, lease=6, renew_deadline=3, retry=0.5)
    second = dlock.LeaderElection("mixed", using=aliases, lease=6, renew_deadline=3, retry=0.5)
    first.start()
    try:
        wait_until(lambda: first.is_leader, 30)
        second.start()
        record = first.leader()
        assert record is not None
        assert (record.identity, record.term) == (first.identity, first.term)
        # (since and expires may come from different databases, whose clocks differ)
        assert record.since is not None and record.renewed < record.expires
        first.stop()
        wait_until(lambda: second.is_leader, 30)
        assert second.term > record.term
        assert second.leader().term == second.term
    finally:
        first.stop()
        second.stop()
