"""The lease strategy, the same suite on PostgreSQL, SQLite and MariaDB."""

from __future__ import annotations

import contextlib
import datetime as dt
import time

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import django_dlock as dlock
from django_dlock import signals
from django_dlock.cleanup import delete_free
from django_dlock.models import Lock as LockRow

from .helpers import expire_now, in_thread, row, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def try_once(key, alias, **options):
    """In another thread: try once, release if acquired; return whether acquired."""

    def attempt():
        lk = dlock.lock(key, using=alias, **options)
        if lk.acquire(timeout=0):
            lk.release()
            return True
        return False

    return in_thread(attempt)


def test_expired_lease_is_taken_over_with_a_higher_fence(alias):
    first = dlock.lock("lease", using=alias, ttl=30)
    first.acquire()
    old_fence = first.fence
    expire_now(alias, "lock:lease")
    taken = {}

    def takeover():
        lk = dlock.lock("lease", using=alias, ttl=30)
        assert lk.acquire(timeout=0)
        taken["fence"], taken["token"] = lk.fence, lk.token
        # leave it held by this thread's token

    in_thread(takeover)
    assert taken["fence"] > old_fence
    # The old holder's release and extend change nothing and say so.
    with pytest.raises(dlock.LockLost):
        first.extend()
    with pytest.raises(dlock.LockNotOwned):
        first.release()
    assert row(alias, "lock:lease") == (taken["token"], taken["fence"])


def test_release_and_extend_by_a_non_owner(alias):
    lk = dlock.lock("mine", using=alias)
    lk.acquire()
    before = row(alias, "lock:mine")
    with pytest.raises(dlock.LockNotOwned):
        in_thread(lk.release)
    with pytest.raises(dlock.LockNotOwned):
        in_thread(lk.extend)
    assert row(alias, "lock:mine") == before
    lk.release()
    with pytest.raises(dlock.LockNotOwned):
        lk.release()


def test_extend_moves_expiry_on_the_database_clock(alias):
    lk = dlock.lock("ext", using=alias, ttl=2)
    lk.acquire()
    before = LockRow.objects.using(alias).get(name="lock:ext").expire_at
    lk.extend(3600)
    after = LockRow.objects.using(alias).get(name="lock:ext").expire_at
    assert after - before > dt.timedelta(minutes=50)
    lk.release()


def test_app_clock_off_by_an_hour_changes_nothing(alias, monkeypatch):
    for offset in (dt.timedelta(hours=1), dt.timedelta(hours=-1)):
        real_now, real_time = timezone.now, time.time
        monkeypatch.setattr(timezone, "now", lambda real_now=real_now, o=offset: real_now() + o)
        monkeypatch.setattr(
            time, "time", lambda real_time=real_time, o=offset: real_time() + o.total_seconds()
        )
        lk = dlock.lock("skew", using=alias, ttl=60)
        lk.acquire()
        assert try_once("skew", alias) is False  # not judged expired
        expire_now(alias, "lock:skew")
        assert try_once("skew", alias) is True  # judged expired
        with pytest.raises(dlock.LockLost):
            lk.release()
        monkeypatch.undo()


def test_fencing_strictly_increases_across_release_takeover_and_cleanup(alias):
    fences = []
    lk = dlock.lock("fenced", using=alias, ttl=30)
    for i in range(1000):
        with lk:
            fences.append(lk.fence)
        if i % 250 == 125:
            assert delete_free(alias) >= 1  # the row and its history are gone
            assert not LockRow.objects.using(alias).filter(name="lock:fenced").exists()
        if i % 250 == 200:

            def take():
                with dlock.lock("fenced", using=alias) as other:
                    return other.fence

            fences.append(in_thread(take))
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), (
        "fences must strictly increase"
    )
    assert len(fences) == 1004


def test_renewal_keeps_the_lease(alias):
    # A renewal must reach the database within about two thirds of the ttl: 2 s
    # leaves room for a loaded machine (0.6 s did not: a stalled round trip lost it).
    lk = dlock.lock("renewed", using=alias, ttl=2.0, renew=True)
    with lk:
        holding = lk._holdings()[0]
        wait_until(lambda: holding.renewer.renewals >= 4 or lk.lost)  # > 2 ttl
        assert not lk.lost
        assert try_once("renewed", alias) is False
    assert try_once("renewed", alias) is True


def test_max_hold_stops_renewal(alias):
    lk = dlock.lock("bounded", using=alias, ttl=0.5, renew=True, max_hold=1.0)
    lk.acquire()
    # Someone waiting gets it once max_hold has run out, without a release.
    assert in_thread(lambda: dlock.lock("bounded", using=alias).acquire(timeout=30)) is True
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_lost_lock_on_takeover_while_renewing(alias):
    lost_events, signalled = [], []

    def receiver(sender, name, strategy, reason, **kwargs):
        signalled.append((name, strategy))

    signals.lock_lost.connect(receiver)
    try:
        lk = dlock.lock("victim", using=alias, ttl=1.5, renew=True, on_lost=lost_events.append)
        with pytest.raises(dlock.LockLost), lk:
            expire_now(alias, "lock:victim")
            assert try_once("victim", alias) is True  # someone else took it
            # lost is set first, then the signal and the callback run
            wait_until(lambda: lk.lost and bool(lost_events))
            assert not lk.held() and not lk.owned()  # never reported as held
        assert len(lost_events) == 1 and isinstance(lost_events[0], dlock.LockLost)
        assert signalled == [("lock:victim", "lease")]
    finally:
        signals.lock_lost.disconnect(receiver)


def test_body_exception_is_not_hidden_by_a_lost_lock(alias):
    with pytest.raises(KeyError), dlock.lock("masked", using=alias):
        expire_now(alias, "lock:masked")
        try_once("masked", alias)
        raise KeyError("body")


def test_inside_atomic_the_lock_commits_on_its_own(alias):
    with transaction.atomic(using=alias):
        lk = dlock.lock("in-atomic", using=alias)
        lk.acquire()
        # visible to others before the caller's transaction ends
        assert try_once("in-atomic", alias) is False
        lk.release()
        assert try_once("in-atomic", alias) is True
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=alias):
        dlock.lock("rolled", using=alias).acquire()
        _ = 1 / 0
    assert dlock.lock("rolled", using=alias).locked()  # not undone by the rollback
    from django_dlock.strategies.connection import close_private_connections

    close_private_connections()


def test_sql_metacharacters_and_unicode_names_are_exact(alias):
    names = ["x'; DROP TABLE django_dlock_lock; --", "ünïcødé ✓", "Case", "case", "pad", "pad "]
    held = [dlock.lock(n, using=alias) for n in names]
    for lk in held:
        assert lk.acquire(timeout=0)
    stored = set(LockRow.objects.using(alias).values_list("name", flat=True))
    assert stored == {f"lock:{n}" for n in names}
    for lk in held:
        lk.release()


def test_bad_arguments_fail_before_any_sql(alias):
    conn = connections[alias]
    with CaptureQueriesContext(conn) as queries:
        for kwargs in (
            {"ttl": 0},
            {"ttl": -1},
            {"ttl": float("nan")},
            {"ttl": float("inf")},
            {"timeout": -1},
            {"timeout": float("nan")},
            {"max_hold": 0},
            {"on_fail": "ignore"},
            {"retry_interval": -1},
            {"using": "nope"},
        ):
            with pytest.raises(ValueError):
                dlock.lock("k", using=kwargs.pop("using", alias), **kwargs)
        with pytest.raises(dlock.StrategyNotSupported):
            dlock.lock("k", using=alias, strategy="zookeeper")
        with pytest.raises(dlock.InvalidLockKey):
            dlock.lock("", using=alias)
        with pytest.raises(ValueError):
            dlock.lock("k", using=alias).acquire(timeout=-5)
        with pytest.raises(dlock.InvalidLockKey):
            dlock.lock(using=alias).acquire()
    assert len(queries) == 0


def test_works_with_the_debug_cursor(alias):
    # DEBUG = True makes Django log every statement with its parameters
    # interpolated: literal % signs in our SQL must survive that.
    connection = connections[alias]
    connection.force_debug_cursor = True
    try:
        lk = dlock.lock("debug", using=alias)
        with lk:
            lk.extend(10)
            assert lk.owned() and lk.locked()
        assert delete_free(alias) == 1
        assert any("django_dlock_lock" in q["sql"] for q in connection.queries)
    finally:
        connection.force_debug_cursor = False


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_fences_keep_increasing_when_switching_back_from_fast_durability():
    from django.test import override_settings

    with override_settings(DLOCK_LEASE_SYNCHRONOUS_COMMIT=False), dlock.lock("switch") as lk:
        fast_fence = lk.fence  # follows the database clock: far above the sequence
    assert delete_free("default") >= 1  # durable mode again; the row and its history go
    with dlock.lock("switch") as lk:
        assert lk.fence > fast_fence


def _prepared_lock_statements() -> int:
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%django_dlock_lock%"],
        )
        return int(cur.fetchone()[0])


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_lease_statements_are_prepared_on_postgresql_but_not_behind_pgbouncer():
    connection = connections["default"]
    connection.close()
    with dlock.lock("prepared"):
        pass
    assert _prepared_lock_statements() >= 2  # acquire and release, parsed once per session
    assert connection.connection.prepare_threshold is None  # Django's own queries: unchanged

    connection.close()
    before = connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS", False)
    connection.settings_dict["DISABLE_SERVER_SIDE_CURSORS"] = True  # Django's PgBouncer flag
    try:
        with dlock.lock("prepared"):
            pass
        assert _prepared_lock_statements() == 0
    finally:
        connection.settings_dict["DISABLE_SERVER_SIDE_CURSORS"] = before
        connection.close()


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_lease_statements_dropped_from_the_session_are_prepared_again():
    # the application may DEALLOCATE ALL or DISCARD ALL on Django's connection
    connection = connections["default"]
    with dlock.lock("prepared-again") as lk:
        assert lk.fence is not None
    for reset in ("DEALLOCATE ALL", "DISCARD ALL"):
        with connection.cursor() as cur:
            cur.execute(reset)
        assert _prepared_lock_statements() == 0
        with dlock.lock("prepared-again") as lk:
            assert lk.owned()
        assert not dlock.lock("prepared-again").locked()
        assert _prepared_lock_statements() >= 2


@pytest.mark.django_db(transaction=True, databases=["default"])
@pytest.mark.parametrize("begun", [False, True])
def test_a_lock_statement_in_the_callers_transaction_is_part_of_it(begun):
    # Django has opened the transaction (autocommit off); the server has
    # begun it only after a first statement. Either way a lock statement on
    # that connection (advisory_xact and row run theirs there) is part of it,
    # and a rollback undoes it.
    from django.db import transaction

    from django_dlock.strategies.connection import execute

    connection = connections["default"]
    insert = (
        "INSERT INTO django_dlock_waiter (name, token, owner, enqueued_at, expire_at) "
        "VALUES (%s, '', '', now(), now())"
    )
    with dlock.lock("in-transaction"):  # (what the connection is, asked once: a query)
        pass
    with transaction.atomic():
        if begun:
            with connection.cursor() as cur:
                cur.execute("SELECT 1")
        execute(connection, insert, ["lock:in-transaction"])
        transaction.set_rollback(True)
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM django_dlock_waiter WHERE name = 'lock:in-transaction'")
        assert cur.fetchone()[0] == 0


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_lock_statements_in_a_transaction_survive_a_savepoint_rolled_back():
    # psycopg deallocates the session's prepared statements when it sees a
    # rollback (also to a savepoint): a lock statement later in the same
    # transaction must not find its statement gone, which would abort it
    from django.db import transaction

    with transaction.atomic():
        for attempt in range(3):
            with dlock.lock(f"savepoint-{attempt}", strategy="advisory_xact") as lk:
                assert lk.owned()
            with contextlib.suppress(ValueError), transaction.atomic():
                with connections["default"].cursor() as cur:
                    cur.execute("SELECT 1")
                raise ValueError("rolled back to the savepoint")
        with dlock.lock("savepoint-row", strategy="row") as lk:
            assert lk.owned()
