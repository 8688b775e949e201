"""LeaderElection in one process: threads and asyncio (see test_runworker for processes)."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction

import django_dlock as dlock
from django_dlock import signals
from django_dlock.identity import worker
from django_dlock.leader import Leadership, current_leadership

from .helpers import expire_now, in_thread, row, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

FAST = {"lease": 2.0, "renew_deadline": 1.5, "retry": 0.4}


def election(
    alias: str, name: str = "sched", events: list | None = None, **options
) -> dlock.LeaderElection:
    """An election with fast timings that records its callbacks in ``events``."""
    log = events if events is not None else []
    ident = options.pop("identity", None)
    settings = {**FAST, **options}
    made = dlock.LeaderElection(name, using=alias, identity=ident, **settings)
    me = made.identity
    made.on_started_leading = lambda term: log.append((me, "started", term))
    made.on_stopped_leading = lambda: log.append((me, "stopped"))
    made.on_new_leader = lambda identity: log.append((me, "new", identity))
    return made


def steal(alias: str, name: str) -> None:
    """Give the lease row to someone else (what a force-release plus a take-over does)."""
    with connections[alias].cursor() as cur:
        cur.execute("UPDATE django_dlock_lock SET token = 'stolen' WHERE name = %s", [name])
        assert cur.rowcount == 1


@pytest.fixture
def changes():
    seen: list[dict] = []

    def receiver(sender, **kwargs):
        seen.append(kwargs)

    signals.leader_changed.connect(receiver)
    yield seen
    signals.leader_changed.disconnect(receiver)


# -- validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("timings", "message"),
    [
        (
            {"lease": 10, "renew_deadline": 10, "retry": 2},
            r"lease \(10 s\) must be greater than renew_deadline",
        ),
        ({"lease": 5, "renew_deadline": 8, "retry": 2}, "must be greater than renew_deadline"),
        (
            {"lease": 15, "renew_deadline": 2.4, "retry": 2},
            r"renew_deadline \(2.4 s\) must be greater than retry \* 1.2",
        ),
        (
            {"lease": 15, "renew_deadline": 10, "retry": 0},
            "retry must be a finite number of seconds > 0",
        ),
        ({"lease": -1, "renew_deadline": 10, "retry": 2}, "lease must be"),
        ({"lease": "15", "renew_deadline": 10, "retry": 2}, "lease must be a number"),
        ({"lease": float("nan"), "renew_deadline": 10, "retry": 2}, "lease must be"),
        ({"lease": 15, "renew_deadline": True, "retry": 2}, "renew_deadline must be a number"),
    ],
)
def test_timings_are_validated_like_kubernetes(timings, message):
    with pytest.raises(ValueError, match=message):
        dlock.LeaderElection("bad", **timings)


def test_defaults_are_valid():
    made = dlock.LeaderElection("defaults")
    assert (made.lease, made.renew_deadline, made.retry) == (15.0, 10.0, 2.0)
    assert made.key.name == "leader:defaults"


def test_bad_strategy_name_alias_and_identity(alias):
    with pytest.raises(dlock.StrategyNotSupported, match="choose one of lease, advisory"):
        dlock.LeaderElection("x", strategy="row")
    with pytest.raises(dlock.StrategyNotSupported, match="nonsense"):
        dlock.LeaderElection("x", strategy="nonsense")
    with pytest.raises(ValueError, match="unknown database alias"):
        dlock.LeaderElection("x", using="nope")
    with pytest.raises(dlock.InvalidLockKey):
        dlock.LeaderElection("")
    with pytest.raises(ValueError, match="identity"):
        dlock.LeaderElection("x", identity=" ")
    if alias != "default":
        with pytest.raises(dlock.StrategyNotSupported, match="PostgreSQL"):
            dlock.LeaderElection("x", strategy="advisory", using=alias)


# -- one leader, callbacks, terms ------------------------------------------------------


def test_one_leader_then_graceful_handover(alias, changes):
    events: list = []
    a = election(alias, events=events, identity="A")
    b = election(alias, events=events, identity="B")
    with a:
        wait_until(lambda: a.is_leader)
        b.start()
        wait_until(lambda: ("B", "new", "A") in events)
        assert a.is_leader and not b.is_leader and b.term is None
        record = b.leader()
        assert record is not None
        assert (record.identity, record.term) == ("A", a.term)
        assert record.since <= record.renewed <= record.expires
        assert row(alias, "leader:sched")[1] == a.term  # the term is the lease's fence
        first = a.term
    # leaving the block released at once: B leads well before A's lease could end
    wait_until(lambda: b.is_leader)
    assert b.term > first
    assert b.leader().identity == "B"
    b.stop()
    assert b.leader() is None and not b.is_leader
    assert events.index(("A", "stopped")) < events.index(("B", "started", b_term(events)))
    assert [e for e in events if e[0] == "A"][:2] == [("A", "new", "A"), ("A", "started", first)]
    assert ("A", "stopped") in events and ("B", "stopped") in events
    assert a.stopped_reason == "stepped down"
    leaders = [(c["leader"], c["term"]) for c in changes if c["election"] is a]
    assert leaders[0] == ("A", first) and leaders[-1] == (None, None)
    assert all(c["name"] == "leader:sched" for c in changes)


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_a_step_down_wakes_the_standbys_on_postgresql():
    # Standbys that look again only every minute: only the wake-up the
    # stepping-down leader sends (NOTIFY) can make B lead within the bound.
    slow = {"lease": 120.0, "renew_deadline": 100.0, "retry": 60.0}
    events: list = []
    a = election("default", events=events, identity="A", **slow)
    b = election("default", events=events, identity="B", **slow)
    try:
        a.start()
        wait_until(lambda: a.is_leader)
        b.start()
        wait_until(lambda: ("B", "new", "A") in events)  # B's campaign failed: it waits
        a.stop()
        wait_until(lambda: b.is_leader, timeout=20)
    finally:
        b.stop()
        a.stop()


def b_term(events: list) -> int:
    return next(e[2] for e in events if e[:2] == ("B", "started"))


def test_terms_strictly_increase_across_leaderships(alias):
    terms = []
    for _ in range(3):
        for ident in ("A", "B"):
            with election(alias, identity=ident) as made:
                wait_until(lambda made=made: made.is_leader)
                terms.append(made.term)
    assert terms == sorted(terms) and len(set(terms)) == len(terms)


def test_identity_is_per_process_and_seen_from_every_thread(alias):
    with election(alias) as made:
        wait_until(lambda: made.is_leader)
        assert made.identity == worker().label
        seen = []
        thread = threading.Thread(target=lambda: seen.append((made.is_leader, made.term)))
        thread.start()
        thread.join()
        assert seen == [(True, made.term)]


def test_a_standby_takes_over_an_expired_lease(alias):
    """A leader that died without releasing: its lease runs out, a standby leads."""
    from django_dlock.keys import make_key
    from django_dlock.strategies.base import Request
    from django_dlock.strategies.lease import lease

    dead = Request(
        make_key("sched", "leader"),
        alias,
        "dead-token",
        "dead host pid=1",
        1.0,
        row="leader:sched",
    )
    dead_term = lease.try_acquire(dead)
    assert dead_term is not None
    events: list = []
    made = election(alias, events=events, identity="B")
    with made:
        wait_until(lambda: ("B", "new", "dead host pid=1") in events)
        wait_until(lambda: made.is_leader, FAST["lease"] + FAST["retry"] + 10)
        assert made.term > dead_term


# -- losing leadership ------------------------------------------------------------------


def test_taken_over_leader_stops_at_once_and_campaigns_with_a_new_term(alias):
    events: list = []
    made = election(alias, events=events, identity="A")
    with made:
        wait_until(lambda: made.is_leader)
        first = made.term
        steal(alias, "leader:sched")
        wait_until(lambda: not made.is_leader)
        assert made.stopped_reason.startswith("lost: the lease was taken over")
        wait_until(lambda: ("A", "stopped") in events)
        expire_now(alias, "leader:sched")  # the thief's lease ends
        wait_until(lambda: made.is_leader)
        assert made.term > first
    assert [e[1] for e in events if e[1] != "new"] == ["started", "stopped", "started", "stopped"]


def test_leader_that_cannot_renew_stops_before_its_lease_can_end(alias):
    """A renewal hangs (a row lock): the leader stops at renew_deadline, lease still running."""
    timings = {"lease": 5.0, "renew_deadline": 1.5, "retry": 0.4}
    events: list = []
    made = election(alias, events=events, identity="A", **timings)
    locked, unlock = threading.Event(), threading.Event()

    def block_renewals() -> None:
        try:
            with transaction.atomic(using=alias), connections[alias].cursor() as cur:
                cur.execute(
                    "UPDATE django_dlock_lock SET owner = owner WHERE name = %s", ["leader:sched"]
                )
                locked.set()
                unlock.wait(60)
        finally:
            connections.close_all()

    blocker = threading.Thread(target=block_renewals)
    with made:
        wait_until(lambda: made.is_leader)
        first = made.term
        blocker.start()
        try:
            assert locked.wait(30)
            wait_until(lambda: not made.is_leader, 30)
            # at the moment it stopped leading, its lease had time left
            _, left = lease_left(alias)
            assert left > 0
            wait_until(lambda: made.stopped_reason is not None)
            assert "could not renew within renew_deadline" in made.stopped_reason
        finally:
            unlock.set()
            blocker.join(60)
        # the hung renewal finishes, the abandoned term is released, and the
        # candidate (under a new token) leads again with a higher term
        wait_until(lambda: made.is_leader, 30)
        assert made.term > first


def lease_left(alias: str) -> tuple[str, float]:
    from django_dlock.dbclock import seconds_until_sql

    connection = connections[alias]
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT token, {seconds_until_sql(connection, 'expire_at')} "
            "FROM django_dlock_lock WHERE name = %s",
            ["leader:sched"],
        )
        token, left = cur.fetchone()
    return token, float(left)


# -- run(target) ----------------------------------------------------------------------------


def test_run_stops_the_target_when_leadership_is_lost_and_calls_it_again(alias):
    made = election(alias)
    calls: list[tuple[int, str]] = []

    def target(leadership: Leadership) -> None:
        assert current_leadership() is leadership
        calls.append((leadership.term, "start"))
        while not leadership.wait(0.02):
            pass
        calls.append((leadership.term, "end"))

    runner = threading.Thread(target=lambda: (made.run(target), connections.close_all()))
    runner.start()
    try:
        wait_until(lambda: len(calls) == 1)
        steal(alias, "leader:sched")
        wait_until(lambda: len(calls) == 2)
        assert calls[1] == (calls[0][0], "end")
        expire_now(alias, "leader:sched")
        wait_until(lambda: len(calls) == 3)
        assert calls[2][0] > calls[0][0]
    finally:
        made.stop()
        runner.join(30)
    assert not runner.is_alive()
    assert calls[-1][1] == "end" and len(calls) == 4
    assert made.leader() is None  # stopped: released
    assert current_leadership() is None


def test_graceful_stop_waits_for_the_target_then_releases(alias):
    made = election(alias)
    stages: list[str] = []

    def target(leadership: Leadership) -> None:
        stages.append("leading")
        leadership.wait()
        time.sleep(0.3)  # finishing the current piece of work, lease still ours
        stages.append(f"done, row held: {row(alias, 'leader:sched')[0] != ''}")

    runner = threading.Thread(target=lambda: (made.run(target), connections.close_all()))
    runner.start()
    wait_until(lambda: stages == ["leading"])
    made.stop()
    runner.join(30)
    assert stages == ["leading", "done, row held: True"]
    assert row(alias, "leader:sched")[0] == ""  # released after the target returned
    assert made.stopped_reason == "stepped down"


def test_run_returns_the_targets_value_and_steps_down(alias):
    made = election(alias)
    assert made.run(lambda leadership: ("done", leadership.term))[0] == "done"
    assert made.leader() is None


def test_run_raises_the_targets_error_after_stepping_down(alias):
    made = election(alias)

    def target(leadership: Leadership) -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        made.run(target)
    assert made.leader() is None and not made.is_leader


def test_leadership_check_raises_lock_lost_when_ended():
    leadership = Leadership("x", 7, "me")
    leadership.check()
    leadership._end("lost: test")
    with pytest.raises(dlock.LockLost, match="term 7"):
        leadership.check()
    assert leadership.wait(0) is True


# -- asyncio ---------------------------------------------------------------------------------


def test_arun_cancels_the_task_when_leadership_is_lost(alias):
    made = election(alias)
    seen: list[str] = []

    async def target(leadership: Leadership) -> None:
        assert current_leadership() is leadership
        seen.append(f"start {leadership.term}")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append(f"cancelled {leadership.term}")
            raise

    async def main() -> None:
        runner = asyncio.ensure_future(made.arun(target))
        await wait_async(lambda: len(seen) == 1)
        await sync_to_async(steal)(alias, "leader:sched")
        await wait_async(lambda: len(seen) == 2)
        await sync_to_async(expire_now)(alias, "leader:sched")
        await wait_async(lambda: len(seen) == 3)
        await made.astop()
        assert await runner is None
        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    first = int(seen[0].split()[1])
    assert seen[:2] == [f"start {first}", f"cancelled {first}"]
    assert seen[2].startswith("start ") and int(seen[2].split()[1]) > first
    assert seen[3].startswith("cancelled ")
    assert made.leader() is None


def test_async_with_and_aleader(alias):
    async def main() -> tuple:
        async with election(alias, identity="async-A") as made:
            await wait_async(lambda: made.is_leader)
            record = await made.aleader()
        after = await made.aleader()
        await sync_to_async(connections.close_all)()
        return record.identity, after

    assert asyncio.run(main()) == ("async-A", None)


def test_arun_returns_the_value_of_the_coroutine(alias):
    async def target(leadership: Leadership) -> int:
        return leadership.term

    async def main() -> int | None:
        result = await election(alias).arun(target)
        await sync_to_async(connections.close_all)()
        return result

    assert asyncio.run(main()) > 0


async def wait_async(predicate, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached within the bound")
        await asyncio.sleep(0.02)


# -- the advisory strategy (PostgreSQL) --------------------------------------------------------

ADVISORY = {"strategy": "advisory", "lease": 10.0, "renew_deadline": 5.0, "retry": 0.4}


@pytest.fixture
def advisory_sessions():
    yield
    from django_dlock.strategies.advisory import sessions

    sessions.close_all()


@pytest.mark.usefixtures("advisory_sessions")
def test_advisory_one_leader_record_and_graceful_handover(pg):
    events: list = []
    a = election(pg, events=events, identity="A", **ADVISORY)
    b = election(pg, events=events, identity="B", **ADVISORY)
    with a:
        wait_until(lambda: a.is_leader)
        b.start()
        wait_until(lambda: ("B", "new", "A") in events)
        record = b.leader()
        assert (record.identity, record.term) == ("A", a.term)
        assert row(pg, "leader:sched")[0].startswith("adv:")
        first = a.term
    wait_until(lambda: b.is_leader, ADVISORY["retry"] + 5)
    assert b.term > first and b.leader().identity == "B"
    b.stop()
    assert b.leader() is None
    assert not dlock.lock("sched", strategy="advisory", using=pg).locked()


@pytest.mark.usefixtures("advisory_sessions")
def test_advisory_leader_whose_session_ends_stops_and_a_standby_leads_at_once(pg):
    from django_dlock.strategies.advisory import sessions

    a = election(pg, identity="A", **ADVISORY)
    b = election(pg, identity="B", **ADVISORY)
    with a, b:
        wait_until(lambda: a.is_leader or b.is_leader)
        leader, standby = (a, b) if a.is_leader else (b, a)
        first = leader.term
        (session,) = [s for s in sessions.holding_sessions() if "leader:sched" in s.held]
        with connections[pg].cursor() as cur:
            cur.execute("SELECT pg_terminate_backend(%s)", [session.backend_pid])
        # well within the 10 s lease: the advisory lock went with the session
        wait_until(lambda: not leader.is_leader and standby.is_leader, 5)
        assert standby.term > first
        wait_until(lambda: leader.stopped_reason is not None)
        assert leader.stopped_reason.startswith("lost: ")


def test_a_take_over_that_waited_for_a_release_takes_the_row_it_freed(pg):
    """The advisory election's standby, granted the lock when the leader's
    session ends, may send its take-over of the lease row while the old
    leader's release of that row is in flight. The take-over waits for the
    row, then must take it: the release ended the lease, though it stamped
    that end after the take-over's statement began (judged by that start,
    the take-over was once refused, and the standby stepped aside for the
    old leader)."""
    from django_dlock.keys import make_key
    from django_dlock.strategies.base import Request
    from django_dlock.strategies.lease import lease

    key = make_key("sched-released", "leader")

    def request(token: str) -> Request:
        return Request(key=key, alias=pg, token=token, owner=token, ttl=10.0, row=key.name)

    assert lease.take_over(request("adv:old"), "adv:") is not None
    taken: dict[str, int | None] = {}

    def take_over() -> None:
        try:
            taken["fence"] = lease.take_over(request("adv:new"), "adv:")
        finally:
            connections.close_all()

    standby = threading.Thread(target=take_over)
    with transaction.atomic(using=pg), connections[pg].cursor() as cur:
        # the old leader's release, in flight: it holds the row until it commits
        cur.execute("SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE", [key.name])
        standby.start()

        def waits_for_the_row() -> bool:
            cur.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted "
                "AND locktype = 'transactionid' "
                "AND transactionid::text = pg_current_xact_id()::text)"
            )
            return bool(cur.fetchone()[0])

        wait_until(waits_for_the_row)
        cur.execute(
            "UPDATE django_dlock_lock SET token = '', expire_at = statement_timestamp() "
            "WHERE name = %s",
            [key.name],
        )
    standby.join(30)
    assert not standby.is_alive()
    assert taken["fence"] is not None
    assert row(pg, key.name)[0] == "adv:new"


@pytest.mark.usefixtures("advisory_sessions")
def test_mixed_strategies_never_make_two_leaders(pg, caplog):
    lease_side = election(pg, identity="lease-side")
    advisory_side = election(pg, identity="advisory-side", **ADVISORY)
    with lease_side:
        wait_until(lambda: lease_side.is_leader)
        with caplog.at_level("ERROR", logger="django_dlock"), advisory_side:
            wait_until(lambda: "must use the same strategy" in caplog.text)
            assert lease_side.is_leader and not advisory_side.is_leader


# -- signals in a real process ------------------------------------------------------------

ASYNC_SCRIPT = """
import asyncio, django
django.setup()
from django_dlock import LeaderElection

async def target(leadership):
    print("leading", leadership.term, flush=True)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        print("cancelled", flush=True)
        raise

election = LeaderElection("async-signal", lease=2, renew_deadline=1.5, retry=0.4)
print("result", asyncio.run(election.arun(target)), flush=True)
print("leader after", election.leader(), election.stopped_reason, flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_arun_steps_down_on_a_signal_and_returns(signum):
    from .test_runworker import Worker

    proc = Worker(python=[sys.executable, "-c", ASYNC_SCRIPT])
    try:
        wait_until(lambda: bool(proc.first("leading")), 60)
        proc.signal(signum)
        assert proc.wait() == 0, proc.stderr()
    finally:
        proc.kill()
    assert proc.lines()[1:] == ["cancelled", "result None", "leader after None stepped down"]


# -- a term ends at its renew deadline, on this process's clock -------------------------------


def test_a_term_ends_at_its_renew_deadline_even_before_the_election_notices():
    from django_dlock.exceptions import LockLost
    from django_dlock.leader.leadership import _now

    leadership = Leadership("deadline", 7, "me")
    leadership._valid_until = _now() + 0.3
    assert not leadership.ended
    assert leadership.wait(0.01) is False
    assert leadership.wait(30) is True  # returns at the deadline, not after 30 s
    assert leadership.ended and not leadership.stepping_down
    with pytest.raises(LockLost, match="renew deadline passed"):
        leadership.check()


def test_a_renewal_moves_the_deadline_of_the_running_term(alias):
    made = election(alias, "moving")
    with made:
        wait_until(lambda: made.is_leader, 30)
        seen = made._leadership
        assert seen is not None
        first = seen._valid_until
        wait_until(lambda: seen._valid_until > first, 10)
        assert made.is_leader and not seen.ended


def _terminate(pid: int) -> bool:
    with connections["default"].cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s)", [pid])
        return bool(cur.fetchone()[0])


def test_leader_reconnects_when_the_threads_connection_was_terminated():
    # A fail-over or a restart ends this thread's session under it; leader()
    # reconnects (as lock methods do) instead of raising OperationalError.
    with election("default", "reconnect") as candidate:
        wait_until(lambda: candidate.is_leader, 30)
        before = candidate.leader()
        assert before is not None and before.term == candidate.term
        mine = connections["default"].connection.info.backend_pid
        assert in_thread(_terminate, mine) is True
        after = candidate.leader()
        assert after is not None and after.term == before.term
        assert connections["default"].connection.info.backend_pid != mine
