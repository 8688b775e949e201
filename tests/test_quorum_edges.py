"""Quorum locks at their edges: a slow database, a silent one, one server
under two names, a new database of a quorum, and why a holding was lost.

Runs on the quorum databases ``q1``, ``q2`` and ``q3`` of the test server
(see tests/test_quorum.py). A database is made slow with a trigger that
sleeps, or silent by a transaction that keeps the key's row locked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections

import django_dlock as dlock
from django_dlock.checks import check_quorum_tables
from django_dlock.signals import lock_lost
from django_dlock.strategies import quorum
from django_dlock.strategies.quorum import rounds as workers

from .helpers import row, wait_until
from .test_quorum import QUORUM, bring_up, eventually, take_down

DATABASES = ["default", *QUORUM]


@pytest.fixture(autouse=True)
def _close_workers() -> Iterator[None]:
    yield
    quorum.close_all()


# -- the caller's timeout holds in every round ----------------------------------

_SLOW_RAISE = """
CREATE OR REPLACE FUNCTION dlock_test_slow_raise() RETURNS trigger AS $$
BEGIN
    PERFORM pg_sleep(6);
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER dlock_test_slow_raise BEFORE UPDATE ON django_dlock_lock
    FOR EACH ROW WHEN (OLD.token = NEW.token AND NEW.fence > OLD.fence)
    EXECUTE FUNCTION dlock_test_slow_raise();
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_the_round_that_raises_the_fence_ends_at_the_callers_timeout():
    # The databases' fencing numbers all differ (q1 10**12, q2 10**11, q3 its
    # sequence): whichever two answer first, one must be raised to the
    # other's number, on q2 or q3, and there that update is slow (6 s).
    for alias, fence in (("q1", 10**12), ("q2", 10**11)):
        with connections[alias].cursor() as cur:
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, "
                "expire_at) VALUES ('lock:q-slow', '', '', %s, now(), now())",
                [fence],
            )
    for alias in ("q2", "q3"):
        with connections[alias].cursor() as cur:
            cur.execute(_SLOW_RAISE)
    try:
        lk = dlock.lock("q-slow", using=QUORUM, ttl=30)
        started = time.monotonic()
        acquired = lk.acquire(timeout=1)
        elapsed = time.monotonic() - started
        if acquired:
            lk.release()
    finally:
        quorum.close_all()  # waits for the slow updates
        for alias in ("q2", "q3"):
            with connections[alias].cursor() as cur:
                cur.execute("DROP TRIGGER dlock_test_slow_raise ON django_dlock_lock")
                cur.execute("DROP FUNCTION dlock_test_slow_raise()")
    # no majority at one fencing number within the timeout: not acquired,
    # and the caller was not kept until the slow databases answered (6 s)
    assert acquired is False
    assert elapsed < 4, f"acquire(timeout=1) returned after {elapsed:.1f} s"


# -- a silent database gets no backlog ------------------------------------------


def _free(alias: str, name: str) -> bool:
    found = row(alias, name)
    return found is None or found[0] == ""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_silent_database_gets_no_backlog_and_no_late_statements():
    lk = dlock.lock("q-silent", using=QUORUM, ttl=30)
    lk.acquire()
    lk.release()
    # release() returns once a majority released; a database whose acquire
    # was still running is released when it answers: wait for all three
    assert eventually(lambda: all(_free(alias, "lock:q-silent") for alias in QUORUM))
    # q3 stops answering for this key: its row stays locked by another session
    blocker = connections["q3"].copy("q3")
    blocker.connect()
    blocker.set_autocommit(False)
    with blocker.cursor() as cur:
        cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = 'lock:q-silent' FOR UPDATE")
    try:
        for _ in range(40):  # q1 and q2 make every majority
            assert lk.acquire(timeout=5) is True
            lk.release()
        queued = workers._pools["q3"]._work_queue.qsize()
        assert queued <= workers.WORKERS_PER_ALIAS, f"{queued} statements queued for q3"
    finally:
        blocker.rollback()
        blocker.close()


# -- one server under two names -------------------------------------------------


@pytest.fixture(scope="module")
def q1_by_name(django_db_blocker) -> Iterator[str]:
    # Module scope: the alias must exist before the test case starts.
    settings = dict(connections.settings["q1"])
    settings["HOST"] = "localhost" if settings["HOST"] != "localhost" else "127.0.0.1"
    connections.settings["q1_by_name"] = settings
    try:
        yield "q1_by_name"
    finally:
        with django_db_blocker.unblock():
            connections["q1_by_name"].close()
        del connections.settings["q1_by_name"]


@pytest.mark.django_db(transaction=True, databases=[*DATABASES, "q1_by_name"])
def test_one_server_under_two_host_names_is_refused(q1_by_name, outage):
    # q2 is down: the only majority left is the one server under its two
    # names, which must never be granted. (With q2 up, q1 and q2 may answer
    # first and make an honest majority before the twin has connected.)
    using = ["q1", q1_by_name, "q2"]
    take_down("q2")
    lk = dlock.lock("q-twice", using=using, ttl=30)  # the settings differ: not seen yet
    with pytest.raises(ImproperlyConfigured, match="counts one database twice"):
        lk.acquire(timeout=10)  # (never granted: refused, or a timeout if it were not)
    assert not lk.held()
    # no lease is left behind
    assert eventually(lambda: live("q1", "lock:q-twice") == 0)
    # the lock declared this quorum: `check --database` names the twins
    ids = [message.id for message in check_quorum_tables(databases=using)]
    assert ids == ["dlock.E062"]


def live(alias: str, name: str) -> int:
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM django_dlock_lock "
            "WHERE name = %s AND token <> '' AND expire_at > now()",
            [name],
        )
        return int(cur.fetchone()[0])


@pytest.mark.django_db(databases=[*DATABASES, "q1_by_name"])
def test_check_e062_one_server_under_two_host_names(settings, q1_by_name):
    settings.DLOCK_QUORUMS = [["q1", q1_by_name, "q2"], QUORUM]
    messages = check_quorum_tables(databases=[*QUORUM, q1_by_name])
    e062 = [m for m in messages if m.id == "dlock.E062"]
    assert len(e062) == 1
    assert "'q1'" in e062[0].msg and f"'{q1_by_name}'" in e062[0].msg


# -- a new database of a quorum can be migrated -----------------------------------


@pytest.fixture(scope="module")
def fresh(django_db_blocker) -> Iterator[str]:
    """A new, empty database on the test server, as the alias ``fresh``."""
    settings = dict(connections.settings["q1"])
    name = f"{settings['NAME']}_fresh"
    settings["NAME"] = name
    with django_db_blocker.unblock(), connections["default"].cursor() as cur:
        cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
        cur.execute(f'CREATE DATABASE "{name}"')
    connections.settings["fresh"] = settings
    try:
        yield "fresh"
    finally:
        with django_db_blocker.unblock():
            connections["fresh"].close()
            del connections.settings["fresh"]
            with connections["default"].cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.django_db(transaction=True, databases=[*DATABASES, "fresh"])
def test_a_new_database_of_a_quorum_can_be_migrated(settings, fresh):
    settings.DLOCK_QUORUMS = [["q1", "q2", fresh]]
    before = [m.id for m in check_quorum_tables(databases=[fresh])]
    assert before == ["dlock.W061"]  # a warning: migrate itself must still run
    call_command("migrate", "django_dlock", database=fresh, verbosity=0)
    assert check_quorum_tables(databases=[fresh]) == []
    with dlock.lock("q-fresh", using=["q1", "q2", fresh], ttl=30) as lk:
        assert lk.held()
    call_command("migrate", database=fresh, verbosity=0)  # the test's teardown flushes it


# -- why a holding was lost ------------------------------------------------------------


@pytest.fixture
def outage() -> Iterator[None]:
    yield
    for alias in QUORUM:
        bring_up(alias)


@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_holding_lost_to_unreachable_databases_says_so(outage):
    reasons: list[str] = []

    def lost(sender, name, strategy, reason, **kwargs):
        reasons.append(reason)

    lock_lost.connect(lost)
    try:
        lk = dlock.lock("q-unreachable", using=QUORUM, ttl=1)
        lk.acquire()
        take_down("q1")
        take_down("q2")
        time.sleep(1.1)  # past the validity: the silent databases no longer count
        assert lk.owned() is False
        with pytest.raises(dlock.LockLost, match="could not be reached"):
            lk.release()
    finally:
        lock_lost.disconnect(lost)
    assert reasons and "could not be reached" in reasons[0]
    assert "q1" in reasons[0] and "q2" in reasons[0]


@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_holding_taken_away_on_a_majority_says_so():
    lk = dlock.lock("q-taken", using=QUORUM, ttl=30)
    lk.acquire()

    def leased(alias: str) -> bool:
        with connections[alias].cursor() as cur:
            cur.execute("SELECT token FROM django_dlock_lock WHERE name = 'lock:q-taken'")
            found = cur.fetchone()
        return found is not None and found[0] != ""

    # acquire() returns once a majority has the lease; the third database's
    # statement may still be on its way: take it away only once all three have it
    wait_until(lambda: all(leased(alias) for alias in ("q1", "q2", "q3")))
    for alias in ("q1", "q2"):
        with connections[alias].cursor() as cur:
            cur.execute("UPDATE django_dlock_lock SET token = '' WHERE name = 'lock:q-taken'")
    assert lk.owned() is False
    with pytest.raises(dlock.LockLost, match="no longer has its lease"):
        lk.release()


# -- two-phase acquire on a quorum -------------------------------------------------------


@pytest.mark.django_db(databases=[])
def test_enqueue_on_a_quorum_lock_says_quorum_locks_cannot():
    lk = dlock.lock("q-enqueue", using=QUORUM)
    with pytest.raises(dlock.StrategyNotSupported, match="not supported on a quorum lock"):
        lk.enqueue()


# -- a database that stalls is given up at the caller's deadline ----------------

#: the advisory key a stalled fence raise waits for (held by the test)
_STALL_KEY = 424242

_STALLING_RAISE = f"""
CREATE OR REPLACE FUNCTION dlock_test_stalling_raise() RETURNS trigger AS $$
BEGIN
    PERFORM pg_advisory_xact_lock({_STALL_KEY});
    RETURN NEW;
END $$ LANGUAGE plpgsql;
CREATE TRIGGER dlock_test_stalling_raise BEFORE UPDATE ON django_dlock_lock
    FOR EACH ROW WHEN (OLD.token = NEW.token AND NEW.fence > OLD.fence)
    EXECUTE FUNCTION dlock_test_stalling_raise();
"""


@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_database_stalling_in_the_fence_raise_is_given_up_at_the_deadline():
    # Three different fencing numbers (q1 10**12, q2 10**11, q3 its
    # sequence): whichever two answer first, the lower is raised, on q2 or
    # q3, and there the raise stalls (its row locked) until the test lets
    # it go: one database (two, if all three answered the first round
    # together) stalls in the fence-raise round.
    name = "lock:q-stall"
    for alias, fence in (("q1", 10**12), ("q2", 10**11)):
        with connections[alias].cursor() as cur:
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, "
                "expire_at) VALUES (%s, '', '', %s, now(), now())",
                [name, fence],
            )
    stallers = {}
    for alias in ("q2", "q3"):
        with connections[alias].cursor() as cur:
            cur.execute(_STALLING_RAISE)
        staller = stallers[alias] = connections[alias].copy(alias)
        staller.connect()
        with staller.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", [_STALL_KEY])
    try:
        lk = dlock.lock("q-stall", using=QUORUM, ttl=30)
        started = time.monotonic()
        acquired = lk.acquire(timeout=1)
        elapsed = time.monotonic() - started
        # the stalled raise is still there: the caller did not wait for it
        assert eventually(lambda: _stalled(stallers) >= 1)
    finally:
        for staller in stallers.values():
            staller.close()  # lets the stalled raise go
        for alias in ("q2", "q3"):
            with connections[alias].cursor() as cur:
                cur.execute("DROP TRIGGER dlock_test_stalling_raise ON django_dlock_lock")
                cur.execute("DROP FUNCTION dlock_test_stalling_raise()")
    assert acquired is False
    assert elapsed < 1 + 0.5, f"acquire(timeout=1) returned after {elapsed:.2f} s"
    # the leases taken in that round are given back, the stalled database's
    # too once it answers: none is left to run out (ttl 30 s)
    assert eventually(lambda: all(_free(alias, name) for alias in QUORUM), bound=15)


def _stalled(stallers: dict) -> int:
    """Fence raises waiting for the stalling trigger's advisory lock."""
    count = 0
    for staller in stallers.values():
        with staller.cursor() as cur:
            cur.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND objid = %s AND database = (SELECT oid FROM pg_database "
                "WHERE datname = current_database())",
                [_STALL_KEY],
            )
            count += int(cur.fetchone()[0])
    return count


# -- a process that releases and exits at once ----------------------------------

_RELEASE_AND_EXIT = """
import django

django.setup()
import django_dlock as dlock

lk = dlock.lock("q-exit", using=["q1", "q2", "q3"], ttl=30)
assert lk.acquire(timeout=20)
lk.release()
print("released", flush=True)
"""


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_process_that_releases_and_exits_leaves_no_lease_behind():
    # q3 answers late: its row is locked by another session while a child
    # process acquires (q1 and q2 grant), releases and exits at once. The
    # row is let go only once the child is on its way out: q3's acquire then
    # takes the lease, which must be given back before the process exits.
    name = "lock:q-exit"
    with connections["q3"].cursor() as cur:
        cur.execute(
            "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, "
            "expire_at) VALUES (%s, '', '', 1, now(), now())",
            [name],
        )
    blocker = connections["q3"].copy("q3")
    blocker.connect()
    blocker.set_autocommit(False)
    with blocker.cursor() as cur:
        cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE", [name])
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DLOCK_TEST_CHILD": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", _RELEASE_AND_EXIT],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "released"
        time.sleep(0.5)  # the child's main thread has ended: it is exiting
    finally:
        blocker.rollback()
        blocker.close()
    try:
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, stderr
    assert "cannot schedule new futures" not in stderr
    assert "Traceback" not in stderr, stderr
    # every database's lease was released before the child exited: none
    # waits to run out (ttl 30 s)
    assert [alias for alias in QUORUM if not _free(alias, name)] == []


@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_later_round_ends_at_the_callers_timeout():
    # The first round is refused at once (q1 and q2 are another's); the
    # second starts half a second later, when q1's lease has run out: q1
    # accepts, q2 refuses and q3 stays silent (its row is locked), so that
    # round waits for an answer until its end, which is the caller's
    # deadline, not a second after the round began.
    name = "lock:q-later"
    for alias, seconds in (("q1", 0.25), ("q2", 60)):
        with connections[alias].cursor() as cur:
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, "
                "expire_at) VALUES (%s, 'another', 'another', 1, now(), "
                "now() + make_interval(secs => %s))",
                [name, seconds],
            )
    with connections["q3"].cursor() as cur:
        cur.execute(
            "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, "
            "expire_at) VALUES (%s, '', '', 1, now(), now())",
            [name],
        )
    blocker = connections["q3"].copy("q3")
    blocker.connect()
    blocker.set_autocommit(False)
    with blocker.cursor() as cur:
        cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE", [name])
    try:
        lk = dlock.lock("q-later", using=QUORUM, ttl=30, retry_interval=lambda attempt: 0.5)
        started = time.monotonic()
        acquired = lk.acquire(timeout=1)
        elapsed = time.monotonic() - started
    finally:
        blocker.rollback()
        blocker.close()
    assert acquired is False
    assert elapsed < 1 + 0.5, f"acquire(timeout=1) returned after {elapsed:.2f} s"
    # what the rounds took is given back (q3's late answers too)
    assert eventually(lambda: _free("q1", name) and _free("q3", name), bound=15)
    assert row("q2", name) == ("another", 1)
