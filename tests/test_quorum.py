"""Quorum locks: a lease on a majority of three real PostgreSQL databases.

The databases are ``q1``, ``q2`` and ``q3`` on the test server. A database
is made unreachable with ``ALTER DATABASE ... ALLOW_CONNECTIONS false`` and
its sessions are ended with ``pg_terminate_backend``; it comes back with
``ALLOW_CONNECTIONS true``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock.strategies import quorum

from . import procs
from .helpers import in_thread, wait_until

QUORUM = ["q1", "q2", "q3"]
DATABASES = ["default", *QUORUM]

pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@pytest.fixture(autouse=True)
def _close_workers() -> Iterator[None]:
    yield
    quorum.close_all()


@pytest.fixture
def outage() -> Iterator[None]:
    """For tests that take databases down: all are back afterwards."""
    yield
    for alias in QUORUM:
        bring_up(alias)


def _database(alias: str) -> str:
    return str(connections[alias].settings_dict["NAME"])


def take_down(alias: str) -> None:
    """Refuse new connections to ``alias``'s database and end its sessions."""
    name = _database(alias)
    connections[alias].close()
    with connections["default"].cursor() as cur:
        cur.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )


def bring_up(alias: str) -> None:
    with connections["default"].cursor() as cur:
        cur.execute(f'ALTER DATABASE "{_database(alias)}" ALLOW_CONNECTIONS true')


def rows(alias: str, name: str) -> tuple[str, int, bool] | None:
    with connections[alias].cursor() as cur:
        cur.execute(
            "SELECT token, fence, expire_at > now() FROM django_dlock_lock WHERE name = %s",
            [name],
        )
        found = cur.fetchone()
    return None if found is None else (found[0], int(found[1]), bool(found[2]))


# -- bad using= : clear errors, before any SQL (no database access allowed) ----


@pytest.mark.django_db(databases=[])
@pytest.mark.parametrize(
    ("using", "message"),
    [
        ([], "names no database"),
        (["q1", "nope", "q3"], "unknown database alias 'nope'"),
        (["q1", "q2", "q1"], "'q1' more than once"),
        (["q1", 2], r"database aliases \(strings\)"),
    ],
)
def test_bad_using_is_refused_before_any_sql(using, message):
    with pytest.raises(ValueError, match=message):
        dlock.lock("k", using=using)
    with pytest.raises(ValueError, match=message):
        dlock.TaskLock("k", using=using)


@pytest.mark.django_db(databases=[])
def test_two_aliases_of_one_database_are_refused():
    connections.settings["q1_again"] = dict(connections.settings["q1"])
    try:
        with pytest.raises(ValueError, match="'q1' and 'q1_again' are the same database"):
            dlock.lock("k", using=["q1", "q1_again", "q2"])
    finally:
        del connections.settings["q1_again"]


@pytest.mark.django_db(databases=[])
@pytest.mark.parametrize("strategy", ["advisory", "advisory_xact", "row"])
def test_other_strategies_cannot_span_databases(strategy):
    with pytest.raises(dlock.StrategyNotSupported, match="cannot span several databases"):
        dlock.lock("k", using=QUORUM, strategy=strategy)


@pytest.mark.django_db(transaction=True, databases=DATABASES)
def test_a_shared_quorum_lock_is_refused_as_a_quorum_lock():
    lk = dlock.lock("q-shared", using=QUORUM, shared=True)
    with pytest.raises(dlock.StrategyNotSupported) as refused:
        lk.acquire(timeout=1)
    message = str(refused.value)
    assert "quorum lock" in message and repr(QUORUM) in message, message
    assert "the lease strategy on" not in message, message
    assert not dlock.lock("q-shared", using=QUORUM).locked()


# -- holding a majority ---------------------------------------------------------


def test_acquire_holds_a_lease_on_every_database_and_release_frees_them():
    lk = dlock.lock("q-basic", using=QUORUM, ttl=30)
    with lk:
        assert lk.held()
        assert lk.fence is not None
        # held on a majority at least (the last database may still be answering)
        live = [row for row in (rows(a, "lock:q-basic") for a in QUORUM) if row and row[2]]
        assert len(live) >= 2
        assert len({token for token, _, _ in live}) == 1
        assert lk.locked()
        assert in_thread(lambda: dlock.lock("q-basic", using=QUORUM).acquire(timeout=0)) is False
    # released on a majority at once, on the last one when it has answered
    assert eventually(lambda: not any(rows(a, "lock:q-basic")[2] for a in QUORUM))
    assert not lk.locked()
    assert in_thread(_take_and_give_back, "q-basic") is True


def _take_and_give_back(key: str) -> bool:
    lk = dlock.lock(key, using=QUORUM, ttl=30)
    got = bool(lk.acquire(timeout=0))
    if got:
        lk.release()
    return got


def test_a_single_database_lock_sees_the_quorum_row():
    with dlock.lock("q-sep", using=QUORUM, ttl=30):
        # the single-database lock on q1 uses the same row: it is held
        assert in_thread(lambda: dlock.lock("q-sep", using="q1").acquire(timeout=0)) is False


def test_reentry_counts_and_extend_renews_on_the_majority():
    lk = dlock.lock("q-re", using=QUORUM, ttl=30)
    with lk:
        with lk:
            assert lk.held()
        assert lk.held()
        lk.extend(60)
        assert lk.owned()
    assert not lk.locked()


def test_a_minority_contended_still_loses_to_the_majority_holder():
    # Someone else holds q1 and q2 (a majority): we get only q3, and give it back.
    other = dlock.lock("q-split", using=["q1", "q2"], ttl=30)
    assert in_thread(lambda: other.acquire(timeout=0)) is True
    assert dlock.lock("q-split", using=QUORUM).acquire(timeout=0) is False
    # q3 accepted (or will): that lease is given back as soon as it answered
    assert eventually(lambda: rows("q3", "lock:q-split") is not None)
    assert eventually(lambda: rows("q3", "lock:q-split")[2] is False)


def eventually(condition: Callable[[], bool], bound: float = 30.0) -> bool:
    """Whether ``condition`` becomes true (polled; the bound only stops a hang)."""
    end = time.monotonic() + bound
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_async_acquire_and_contention():
    async def main() -> tuple[bool, bool]:
        lk = dlock.lock("q-async", using=QUORUM, ttl=30)
        async with lk:
            other = await asyncio.to_thread(
                lambda: dlock.lock("q-async", using=QUORUM).acquire(timeout=0)
            )
            inside = await lk.aheld()
        return inside, other

    inside, other = asyncio.run(main())
    assert inside is True and other is False
    assert not dlock.lock("q-async", using=QUORUM).locked()


def test_tasklock_on_a_quorum_runs_once_per_min_hold():
    task = dlock.TaskLock("q-task", using=QUORUM, min_hold=60)
    with task as run:
        assert run
    with dlock.TaskLock("q-task", using=QUORUM, min_hold=60) as again:
        assert not again  # still within min_hold on the majority
    live = [alias for alias in QUORUM if (rows(alias, "task:q-task") or ("", 0, False))[2]]
    assert len(live) >= 2


# -- databases down --------------------------------------------------------------


def _end_sessions(alias: str) -> None:
    """End every session of ``alias``'s database; the database stays up."""
    connections[alias].close()  # the test's own connection is not the point
    with connections["default"].cursor() as cur:
        cur.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [_database(alias)],
        )


def _live(name: str) -> list[bool]:
    found = [rows(alias, name) for alias in QUORUM]
    return [row is not None and row[2] for row in found]


def test_sessions_the_server_ended_are_replaced_without_losing_a_vote():
    lk = dlock.lock("q-ended", using=QUORUM, ttl=30, timeout=10)
    with lk:  # each database's worker now keeps a connection
        pass
    wait_until(lambda: not any(_live("lock:q-ended")))  # the last release is done
    _end_sessions("q1")
    _end_sessions("q2")
    # A kept connection that the server ended fails its statement: that
    # costs q1's and q2's votes (a round without a majority).
    assert lk.acquire() is True
    wait_until(lambda: all(_live("lock:q-ended")))  # the third answer is in
    _end_sessions("q1")
    _end_sessions("q2")
    # A release that meets an ended session must still reach the database,
    # or its lease blocks the key until it runs out (30 s).
    lk.release()
    wait_until(lambda: not any(_live("lock:q-ended")))


def test_one_database_down_costs_nothing_but_its_vote(outage):
    take_down("q2")
    lk = dlock.lock("q-one-down", using=QUORUM, ttl=30)
    with lk:
        assert lk.held()
        assert in_thread(lambda: dlock.lock("q-one-down", using=QUORUM).acquire(timeout=0)) is False
    bring_up("q2")
    take_down("q1")
    # q2 is back and used again at once, without a restart: with q1 down,
    # only q2 and q3 make a majority
    with lk:
        assert rows("q2", "lock:q-one-down")[2] is True


def test_a_majority_down_is_a_named_timeout_within_the_timeout(outage):
    take_down("q1")
    take_down("q3")
    lk = dlock.lock("q-down", using=QUORUM, ttl=30, timeout=1)
    outcome: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            lk.acquire()
            outcome["error"] = None
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)  # a generous bound against a hang, not a timing assertion
    assert not thread.is_alive(), "the acquire did not return"
    error = outcome["error"]
    assert isinstance(error, dlock.QuorumUnavailable)
    assert isinstance(error, dlock.LockTimeout)
    assert "q1" in str(error) and "q3" in str(error)
    with pytest.raises(dlock.QuorumUnavailable), lk:
        pass
    # no lease was left on the one database that answered (given back by its worker)
    assert eventually(lambda: not rows("q2", "lock:q-down")[2])


def test_fences_increase_across_changing_majorities(outage):
    """Holders whose majorities differ still get strictly increasing fences.

    q3's fencing sequence is far ahead of the others: a holder on {q2, q3}
    gets a big number; the next holder on {q1, q2} would get small numbers
    from both, were q2 not raised to the big number by the holder before.
    """
    with connections["q3"].cursor() as cur:
        cur.execute("SELECT setval('django_dlock_fence', 100000)")
    fences = []
    for down in ("q3", "q1", "q3", "q2", "q1", "q3"):
        take_down(down)
        with dlock.lock("q-fence", using=QUORUM, ttl=30) as lk:
            fences.append(lk.fence)
        bring_up(down)
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), fences
    assert max(fences) > 100000


# -- many processes, one database going down and coming back -------------------

PROCESSES, ITERATIONS = 5, 200


def _worker(counter_path: str, log_path: str, iterations: int) -> None:
    counter = procs.FileCounter(counter_path)
    lk = dlock.lock("q-counter", using=QUORUM, ttl=20, timeout=120, retry_interval=0.005)
    with open(log_path, "w") as log:
        for _ in range(iterations):
            with lk:
                value = counter.increment(pause=0.0002)
                log.write(f"{value} {lk.fence}\n")
                log.flush()
    quorum.close_all()


def _progress(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError), open(path) as f:
            total += sum(1 for line in f if line.strip())
    return total


@pytest.mark.slow
def test_processes_exclude_each_other_while_a_database_goes_down_and_back(tmp_path, outage):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    logs = [str(tmp_path / f"log{n}") for n in range(PROCESSES)]
    workers = [procs.start(_worker, counter.path, log, ITERATIONS) for log in logs]
    total = PROCESSES * ITERATIONS
    bound = time.monotonic() + 600  # against a hang only
    while _progress(logs) < total // 4 and time.monotonic() < bound:
        time.sleep(0.05)
    take_down("q2")
    while _progress(logs) < total // 2 and time.monotonic() < bound:
        time.sleep(0.05)
    bring_up("q2")
    while _progress(logs) < 3 * total // 4 and time.monotonic() < bound:
        time.sleep(0.05)
    take_down("q1")  # another database this time, after q2 came back
    for proc in workers:
        proc.join(max(1.0, bound - time.monotonic()))
    bring_up("q1")
    for proc in workers:
        if proc.is_alive():
            proc.kill()
            raise AssertionError("a worker did not finish")
        assert proc.exitcode == 0
    assert counter.read() == total  # no lost update: no two holders at once
    seen: list[tuple[int, int]] = []
    for path in logs:
        with open(path) as f:
            seen.extend(tuple(map(int, line.split())) for line in f if line.strip())
    assert sorted(v for v, _ in seen) == list(range(1, total + 1))
    fences = [fence for _, fence in sorted(seen)]
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False))


# -- system checks ------------------------------------------------------------------


@pytest.mark.django_db(databases=DATABASES)
def test_checks_report_bad_and_even_quorums_and_pass_good_ones(settings):
    from django_dlock.checks import check_quorums

    settings.DLOCK_QUORUMS = [["q1", "q2", "q3"], ["q1", "q2"], ["q1", "q1", "q2"]]
    ids = [message.id for message in check_quorums(databases=QUORUM)]
    assert ids.count("dlock.W060") == 1  # ["q1", "q2"]: even
    assert ids.count("dlock.E060") == 1  # q1 twice
    assert "dlock.W061" not in ids  # every database has the lock table


def test_with_lock_takes_a_quorum_and_refuses_a_bad_one():
    from django_dlock.decorators import with_lock

    @with_lock("q-job:{n}", using=QUORUM, ttl=30)
    def job(n: int) -> bool:
        return bool(dlock.lock(f"q-job:{n}", using=QUORUM).held())

    assert job(1) is True
    assert not dlock.lock("q-job:1", using=QUORUM).locked()
    with pytest.raises(ValueError, match="more than once"):
        with_lock("q-job:{n}", using=["q1", "q1"])


def test_check_w061_a_database_of_a_quorum_without_the_lock_table(settings):
    from django.core.checks import Tags

    from django_dlock.checks import check_quorum_tables, check_quorums

    settings.DLOCK_QUORUMS = [QUORUM]
    with connections["q3"].cursor() as cur:
        cur.execute("ALTER TABLE django_dlock_lock RENAME TO django_dlock_lock_away")
    try:
        messages = check_quorum_tables(databases=QUORUM)
        # the static check never connects (Django 6 hands it every alias)
        static = check_quorums(databases=QUORUM)
    finally:
        with connections["q3"].cursor() as cur:
            cur.execute("ALTER TABLE django_dlock_lock_away RENAME TO django_dlock_lock")
    w061 = [m for m in messages if m.id == "dlock.W061"]
    assert len(w061) == 1 and "'q3'" in w061[0].msg
    assert "dlock.W061" not in [m.id for m in static]
    # only `check --database` runs it: Django runs database checks only then
    assert Tags.database in check_quorum_tables.tags  # type: ignore[attr-defined]


@pytest.mark.django_db(databases=[])
def test_quorum_checks_run_with_django_checks(settings):
    from django.core import checks

    settings.DLOCK_QUORUMS = [["q1", "q2"]]
    # databases=[]: Django 6 runs the database checks of every alias by default
    assert "dlock.W060" in [m.id for m in checks.run_checks(databases=[])]
