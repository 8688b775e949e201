"""Deadlock detection between lease waiters, with real processes, on all three databases.

Each member of a cycle takes its first key, says so in a file, waits until
every member holds its first key, then asks for the next member's key with
``timeout=None``: without detection they would wait forever. Exactly one
(the last to begin waiting) must get ``LockDeadlock``, and the others their
lock. The members report in files what they got; nothing is inferred from
clocks, but the bound the feature promises (told within 2 s) is checked.
"""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path

import pytest
from django.test import override_settings

import django_dlock as dlock
from django_dlock.strategies.lease import deadlock
from django_dlock.strategies.lease.deadlock import Graph, Ticket, cycles, victim_cycle

from . import procs
from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def _member(alias: str, mine: str, wanted: str, ready: str, members: int, out: str) -> None:
    """Hold ``mine``, wait until all members hold theirs, then wait for ``wanted``."""
    flags = Path(ready)
    result: dict[str, object] = {"key": mine}
    with dlock.lock(mine, using=alias, ttl=300, timeout=30):  # (outlives a wait that hangs)
        (flags / mine).touch()
        deadline = time.monotonic() + 60
        while len(list(flags.iterdir())) < members and time.monotonic() < deadline:
            time.sleep(0.01)
        started = time.monotonic()
        try:
            with dlock.lock(wanted, using=alias, ttl=300, timeout=None):
                result["got"] = wanted
        except dlock.LockDeadlock as exc:
            result["deadlock"] = {
                "after": time.monotonic() - started,
                "keys": list(exc.keys),
                "holders": list(exc.holders),
                "message": str(exc),
                "timeout": isinstance(exc, dlock.LockTimeout),
            }
    Path(out).write_text(json.dumps(result))


def _cycle(alias: str, tmp_path: Path, size: int) -> list[dict]:
    keys = [f"cycle{size}-{i}" for i in range(size)]
    ready = tmp_path / "ready"
    ready.mkdir()
    outs = [tmp_path / f"out{i}.json" for i in range(size)]
    started = [
        procs.start(_member, alias, keys[i], keys[(i + 1) % size], str(ready), size, str(outs[i]))
        for i in range(size)
    ]
    for proc in started:
        proc.join(60)
    for proc in started:
        if proc.is_alive():
            proc.kill()
            raise AssertionError("a member of the cycle still waits: no deadlock was reported")
        assert proc.exitcode == 0
    return [json.loads(out.read_text()) for out in outs]


@pytest.mark.slow
def test_two_processes_in_opposite_orders(alias, tmp_path):
    results = _cycle(alias, tmp_path, 2)
    told = [r for r in results if "deadlock" in r]
    assert len(told) == 1, results
    (loser,) = told
    (winner,) = [r for r in results if "deadlock" not in r]
    assert winner["got"] == loser["key"]  # it got the loser's key once the loser left
    error = loser["deadlock"]
    assert error["after"] < 2.0, error  # the bound the feature promises
    assert error["timeout"]  # a LockTimeout: existing handlers keep working
    names = {f"lock:{r['key']}" for r in results}
    assert set(error["keys"]) == names
    assert len(error["holders"]) == 2 and all("pid=" in h for h in error["holders"])


@pytest.mark.slow
def test_a_cycle_of_three_processes(alias, tmp_path):
    results = _cycle(alias, tmp_path, 3)
    told = [r for r in results if "deadlock" in r]
    assert len(told) == 1, results
    assert len(told[0]["deadlock"]["keys"]) == 3
    assert all("got" in r for r in results if "deadlock" not in r)


# -- no false deadlock: many processes, four keys, always taken in one order ---------


def _contender(alias: str, seconds: float, seed: int, out: str) -> None:
    """Take ascending subsets of four keys, nested, until ``seconds`` have passed."""
    rng = random.Random(seed)
    keys = [f"order-{i}" for i in range(4)]
    rounds = deadlocks = 0
    end = time.monotonic() + seconds
    with override_settings(DLOCK_DEADLOCK_TIMEOUT=0.2):  # look often: more chances to err
        while time.monotonic() < end:
            chosen = sorted(rng.sample(keys, rng.randint(1, 4)))
            try:
                _nested(alias, chosen, rng)
            except dlock.LockDeadlock:
                deadlocks += 1
            rounds += 1
    Path(out).write_text(
        json.dumps({"rounds": rounds, "deadlocks": deadlocks, "checks": deadlock.stats.checks})
    )


def _nested(alias: str, keys: list[str], rng: random.Random) -> None:
    if not keys:
        time.sleep(rng.uniform(0, 0.01))
        return
    with dlock.lock(keys[0], using=alias, ttl=60, timeout=None, retry_interval=0.02):
        _nested(alias, keys[1:], rng)


#: (processes, seconds) per database: the minute on PostgreSQL only, to keep CI short
#: (16 processes on SQLite pass too, but their start alone costs CI 20 s more)
_LOAD = {"default": (16, 60.0), "mysql": (16, 10.0), "sqlite": (8, 10.0)}


@pytest.mark.slow
def test_no_false_deadlock_when_keys_are_taken_in_one_order(alias, tmp_path):
    count, seconds = _LOAD[alias]
    outs = [tmp_path / f"out{i}.json" for i in range(count)]
    procs.run_all(
        _contender,
        [(alias, seconds, i, str(out)) for i, out in enumerate(outs)],
        timeout=seconds + 240,
    )
    results = [json.loads(out.read_text()) for out in outs]
    assert sum(r["deadlocks"] for r in results) == 0, results
    assert sum(r["checks"] for r in results) > 0  # the waiters did look (else: proves nothing)
    assert all(r["rounds"] > 0 for r in results)


# -- the graph, without a database ------------------------------------------------------


def _graph(tickets: list[tuple[int, str, str]], holders: dict[str, set[str]]) -> Graph:
    return Graph(
        tickets=[Ticket(n, name, token) for n, name, token in tickets],
        holders=holders,
        owners={t: f"owner {t}" for ts in holders.values() for t in ts},
    )


def test_only_the_youngest_waiter_of_a_cycle_is_told():
    graph = _graph([(1, "a", "B"), (2, "b", "A")], {"a": {"A"}, "b": {"B"}})
    assert victim_cycle(graph, 1) is None
    cycle = victim_cycle(graph, 2)
    assert cycle is not None and cycle.keys == ("b", "a") and cycle.victim == 2
    assert cycle.holders == ("owner B", "owner A")
    assert [c.victim for c in cycles(graph)] == [2]


def test_a_waiter_queued_behind_a_cycle_is_not_told():
    graph = _graph([(1, "a", "B"), (2, "b", "A"), (3, "a", "C")], {"a": {"A"}, "b": {"B"}})
    assert victim_cycle(graph, 3) is None
    assert victim_cycle(graph, 2) is not None


def test_many_waiters_behind_a_cycle_are_not_told():
    behind = [(n, "a", f"W{n}") for n in range(3, 2003)]
    graph = _graph([(1, "a", "B"), (2, "b", "A"), *behind], {"a": {"A"}, "b": {"B"}})
    (cycle,) = cycles(graph)
    assert cycle.victim == 2 and set(cycle.keys) == {"a", "b"}
    assert all(victim_cycle(graph, n) is None for n, _, _ in behind[::250])


def test_a_ticket_ahead_in_the_queue_is_waited_for():
    # A holds "b" and waits for "k" (held by C), B is queued behind A for "k"
    # and C waits for "b": B waits for A, who waits for C, who waits for A.
    graph = _graph([(1, "k", "A"), (2, "k", "B"), (3, "b", "C")], {"k": {"C"}, "b": {"A"}})
    cycle = victim_cycle(graph, 3)
    assert cycle is not None and set(cycle.keys) == {"k", "b"}
    assert victim_cycle(graph, 2) is None  # behind the cycle, not on it


def test_a_holder_with_a_place_that_can_be_served_is_not_stuck():
    # A keeps a place (enqueue(), ticket 1) on the free key "k" and waits for
    # "b" (ticket 2), held by B, who is queued behind A's place: a token with
    # one place that can be served counts as able to go on (which may miss a
    # deadlock through such a place, never report a false one)
    graph = _graph([(1, "k", "A"), (2, "b", "A"), (3, "k", "B")], {"b": {"B"}})
    assert victim_cycle(graph, 3) is None


def test_a_semaphore_waiter_needs_every_permit_holder_stuck():
    # permits held by A and C; A waits for "x" held by B, B waits for the semaphore
    sem = "semaphore:s"
    graph = _graph([(1, "x", "A"), (2, sem, "B")], {"x": {"B"}, sem: {"A", "C"}})
    assert victim_cycle(graph, 2) is None  # C is free: it will give a permit back
    graph = _graph([(1, "x", "A"), (2, sem, "B")], {"x": {"B"}, sem: {"A"}})
    assert victim_cycle(graph, 2) is not None


def test_a_semaphore_with_a_free_permit_blocks_no_one():
    # A holds one permit and waits for "x", held by B, who waits for the
    # semaphore: a second permit was just given back (its row is free), so B
    # is served at its next look (this was once reported as a deadlock)
    sem = "semaphore:s"
    graph = _graph([(1, "x", "A"), (2, sem, "B")], {"x": {"B"}, sem: {"A"}})
    graph.free.add(sem)
    assert victim_cycle(graph, 2) is None
    # the same with no row for the free permit yet: the looking waiter knows
    # its semaphore has two permits, and only one is held
    graph = _graph([(1, "x", "A"), (2, sem, "B")], {"x": {"B"}, sem: {"A"}})
    graph.permits[sem] = 2
    assert victim_cycle(graph, 2) is None
    graph.permits[sem] = 1
    assert victim_cycle(graph, 2) is not None


def test_no_cycle_in_one_order():
    graph = _graph([(1, "a", "B"), (2, "b", "C"), (3, "a", "C")], {"a": {"A"}, "b": {"B"}})
    assert cycles(graph) == []
    assert all(victim_cycle(graph, n) is None for n in (1, 2, 3))


def test_detection_runs_only_in_waiters_past_the_bound(alias):
    before = deadlock.stats.checks
    lk = dlock.lock("uncontended", using=alias)
    for _ in range(20):
        with lk:
            pass
    assert deadlock.stats.checks == before  # nothing on an uncontended lock
    got: list[bool] = []
    with (
        dlock.lock("briefly-held", using=alias, ttl=30),
        override_settings(DLOCK_DEADLOCK_TIMEOUT=0.1),
    ):
        waiter = threading.Thread(
            target=lambda: got.append(dlock.lock("briefly-held", using=alias).acquire(timeout=0.6))
        )
        waiter.start()
        waiter.join()
    assert got == [False]
    assert deadlock.stats.checks > before


# -- PostgreSQL's own detection: advisory locks -------------------------------------------


def _opposite_threads(take) -> list[object]:
    """Two threads take "a" then "b" and "b" then "a" through ``take(first,
    second, barrier)``; what each got (a key, or the error)."""
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def run(index: int, first: str, second: str) -> None:
        try:
            results[index] = take(first, second, barrier)
        except Exception as exc:
            results[index] = exc
        finally:
            from django.db import connections

            connections.close_all()

    threads = [
        threading.Thread(target=run, args=(0, "adv-a", "adv-b")),
        threading.Thread(target=run, args=(1, "adv-b", "adv-a")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "still waiting: no deadlock"
    return results


def _told_once(results: list[object]) -> dlock.LockDeadlock:
    errors = [r for r in results if isinstance(r, dlock.LockDeadlock)]
    assert len(errors) == 1, results
    assert [r for r in results if not isinstance(r, Exception)] != [], results
    (error,) = errors
    assert isinstance(error, dlock.LockTimeout)
    assert "deadlock" in str(error) and error.keys and error.keys[0].startswith("lock:adv-")
    assert len(error.holders) == 2  # the two backends of the cycle
    return error


@pytest.mark.django_db(transaction=True)
def test_an_advisory_deadlock_is_a_lock_deadlock():
    def take(first: str, second: str, barrier: threading.Barrier) -> str:
        with dlock.lock(first, strategy="advisory", timeout=30):
            barrier.wait(30)
            with dlock.lock(second, strategy="advisory", timeout=None):
                return second

    _told_once(_opposite_threads(take))


@pytest.mark.django_db(transaction=True)
def test_an_advisory_xact_deadlock_is_a_lock_deadlock():
    from django.db import transaction

    def take(first: str, second: str, barrier: threading.Barrier) -> str:
        with transaction.atomic():
            dlock.lock(first, strategy="advisory_xact").acquire(timeout=30)
            barrier.wait(30)
            dlock.lock(second, strategy="advisory_xact").acquire(timeout=None)
            return second

    _told_once(_opposite_threads(take))


# -- who waits on whom shows a cycle as such ---------------------------------------------


@pytest.mark.slow
def test_who_waits_on_whom_shows_a_cycle(alias, settings, client):
    from io import StringIO

    from django.core.management import call_command

    settings.DLOCK_DEADLOCK_TIMEOUT = 3600.0  # nobody is told while we look
    barrier = threading.Barrier(3)
    outcomes: list[object] = []

    def member(first: str, second: str) -> None:
        from django.db import connections

        try:
            with dlock.lock(first, using=alias, ttl=60, timeout=10):
                barrier.wait(30)
                outcomes.append(dlock.lock(second, using=alias).acquire(timeout=4))
        except Exception as exc:
            outcomes.append(exc)
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=member, args=("shown-a", "shown-b")),
        threading.Thread(target=member, args=("shown-b", "shown-a")),
    ]
    for thread in threads:
        thread.start()
    barrier.wait(30)
    from django_dlock import operations

    wait_until(lambda: len(operations.deadlocks(alias)) == 1, timeout=30)
    out = StringIO()
    call_command("dlock_list", "--waiting", "--using", alias, stdout=out)
    page = ""
    if alias == "default":  # (the admin shows the lock database's)
        from django.contrib.auth import get_user_model

        client.force_login(get_user_model().objects.create_superuser("root", "r@example.com"))
        page = client.get("/admin/django_dlock/lock/waiting/").content.decode()
    for thread in threads:
        thread.join(60)
    # nobody was told: a timeout, then the other got its key (or timed out too)
    assert sorted(outcomes, key=str) in ([False, False], [False, True]), outcomes
    listed = out.getvalue()
    assert listed.count("IN A DEADLOCK") == 2, listed
    assert f"Deadlocks in {alias!r}: 1" in listed
    assert "holds lock:shown-a, waits for lock:shown-b" in listed
    assert "holds lock:shown-b, waits for lock:shown-a" in listed
    assert "the youngest waiter, gives up with LockDeadlock" in listed
    if alias == "default":
        assert "dlock-deadlock-1" in page and page.count("dlock-cycle-step") == 2, page
        assert page.count("in a deadlock") == 2


def test_dlock_list_marks_a_lease_held_long(alias, settings):
    from io import StringIO

    from django.core.management import call_command

    settings.DLOCK_LONG_HOLD = 0.5
    with dlock.lock("listed-long", using=alias, ttl=60):
        wait_until(lambda: "held (long)" in _listed(call_command, alias, StringIO()), timeout=30)
    settings.DLOCK_LONG_HOLD = None
    with dlock.lock("listed-long", using=alias, ttl=60):
        time.sleep(0.6)
        assert "held (long)" not in _listed(call_command, alias, StringIO())


def _listed(call_command, alias: str, out) -> str:
    call_command("dlock_list", "--using", alias, stdout=out)
    return out.getvalue()


# -- read-write locks and semaphores: cycles through readers and permits -------------------


def _two_threads(alias: str, first_of, second_of) -> list[object]:
    """Thread 0 enters ``first_of(0)`` then ``second_of(0)``; thread 1 likewise,
    each once both hold their first lock. What each got (True, or the error)."""
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def run(index: int) -> None:
        from django.db import connections

        try:
            with first_of(index):
                barrier.wait(30)
                with second_of(index):
                    results[index] = True
        except Exception as exc:
            results[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "still waiting: no deadlock"
    return results


def test_a_cycle_through_the_readers_of_a_read_write_lock(alias):
    # thread 0 reads "report" and waits for "ledger"; thread 1 holds "ledger"
    # and waits to write "report", which waits for every reader
    def first(i: int) -> dlock.Lock:
        if i == 0:
            return dlock.lock("report", using=alias, shared=True, ttl=300)
        return dlock.lock("ledger", using=alias, ttl=300)

    def second(i: int) -> dlock.Lock:
        if i == 0:
            return dlock.lock("ledger", using=alias, ttl=300, timeout=None)
        return dlock.lock("report", using=alias, ttl=300, timeout=None)

    results = _two_threads(alias, first, second)
    assert sorted(type(r).__name__ for r in results) == ["LockDeadlock", "bool"], results


def test_a_cycle_through_the_permits_of_a_semaphore(alias):
    # the one permit of "exports" is thread 0's, which waits for "ledger";
    # thread 1 holds "ledger" and waits for a permit
    def first(i: int):
        if i == 0:
            return dlock.semaphore("exports", permits=1, using=alias, ttl=300)
        return dlock.lock("ledger", using=alias, ttl=300)

    def second(i: int):
        if i == 0:
            return dlock.lock("ledger", using=alias, ttl=300, timeout=None)
        return dlock.semaphore("exports", permits=1, using=alias, ttl=300, timeout=None)

    results = _two_threads(alias, first, second)
    assert sorted(type(r).__name__ for r in results) == ["LockDeadlock", "bool"], results


@pytest.mark.slow
def test_no_deadlock_while_a_permit_is_held_by_someone_free(alias):
    # two permits: one thread 0's (which waits for "ledger"), the other this
    # test's, which will give it back: thread 1 is not deadlocked, only waits
    outside = dlock.semaphore("exports2", permits=2, using=alias, ttl=300)
    outside.acquire()

    def first(i: int):
        if i == 0:
            return dlock.semaphore("exports2", permits=2, using=alias, ttl=300)
        return dlock.lock("ledger2", using=alias, ttl=300)

    def second(i: int):
        if i == 0:
            return dlock.lock("ledger2", using=alias, ttl=300, timeout=None)
        return dlock.semaphore("exports2", permits=2, using=alias, ttl=300, timeout=20)

    results: list[object] = []
    both = threading.Thread(target=lambda: results.extend(_two_threads(alias, first, second)))
    both.start()
    time.sleep(2.5)  # thread 1 waits past DLOCK_DEADLOCK_TIMEOUT, twice
    outside.release()
    both.join(90)
    # thread 1 got a permit once this test gave its own back, then thread 0 "ledger2"
    assert results == [True, True], results
