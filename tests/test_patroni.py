"""Leases on a real Patroni cluster (etcd, three PostgreSQL members) through faults.

One cluster for the module (:mod:`tests.patroni`), reached the way sites
reach one: a libpq multi-host string (``host=a,b,c
target_session_attrs=read-write connect_timeout=2``) as a Django alias.
Holder processes (real OS processes, three) take leases on a few keys in a
loop, each grant recorded to a file of its own; meanwhile the faults come
one after another:

* a node crash: SIGKILL of the leader's Patroni and of all its PostgreSQL
  processes, a standby promoted once the leader key runs out; the node comes
  back and rejoins (rewound);
* a crash of PostgreSQL alone (SIGKILL of the postmaster): Patroni restarts it;
* two switchovers back to back (the second promoted standby may not have
  followed the newest timeline yet: PostgreSQL may name its timeline with
  an ID that was already used);
* an asynchronous fail-over where the promoted standby missed the old
  primary's last WAL: the standbys receive nothing while the primary grants
  on, then the primary's node crashes;
* a clean stop of Patroni on the leader.

Then, from the records: no two holders of a key at once (a holder whose
release said the lease was lost is the one case the fencing number is there
for: counted, not an overlap), no lease granted twice, fencing numbers that
never repeat or go backwards per key, the next grant after each fault within
Patroni's ttl + 5 s, and no error out of a lock call that is not one of
django-dlock's named errors. The test module prints what it measured (per
fault: the time from the fault to the next grant).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import statistics
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from . import patroni, procs
from .patroni import TTL, Member, PatroniCluster

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        patroni.available() is not None,
        reason=f"no Patroni cluster here: {patroni.available()}",
    ),
]

ALIAS = "patroni"
DATABASE = "dlock_patroni"
KEYS = [f"ha:{n}" for n in range(6)]
HOLDERS = 3
#: the holders' lease: longer than a hold by far, short enough that a lease
#: whose release could not reach the database frees its key soon
LEASE_TTL = 5.0
HOLD = 0.02
#: the bound the next grant after a fault must meet
NEXT_GRANT_BOUND = TTL + 5.0
#: a lock call that takes longer than this is a hang
HANG = 60.0
#: how many times the faults are run (one round in CI: about 80 s for the
#: module; more to measure, e.g. DLOCK_TEST_PATRONI_ROUNDS=5)
ROUNDS = int(os.environ.get("DLOCK_TEST_PATRONI_ROUNDS", "1"))


# -- the holder processes ------------------------------------------------------


def _holder(
    settings: dict[str, Any], log_path: str, go_path: str, stop_path: str, seed: int
) -> None:
    """Once ``go_path`` exists, take leases on KEYS until ``stop_path`` exists;
    one JSON line per event."""
    import faulthandler

    from django.db import Error, connections

    import django_dlock as dlock

    connections.settings[ALIAS] = settings
    rng = random.Random(seed)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115  (for the process)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)

    def write(event: str, **fields: Any) -> None:
        fields.update(ev=event, pid=os.getpid())
        log.write(json.dumps(fields, default=repr) + "\n")

    def raw(where: str, exc: BaseException) -> None:
        write(
            "raw",
            where=where,
            exc=type(exc).__name__,
            msg=str(exc)[:300],
            tb="".join(traceback.format_exception(exc))[-3000:],
        )

    def probe(key: str) -> dict[str, Any]:
        """The lease row as the database has it (not a lock call: a Django query)."""
        try:
            with connections[ALIAS].cursor() as cur:
                cur.execute(
                    "SELECT token, fence, extract(epoch from acquired_at), inet_server_port(), "
                    "('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int "
                    "FROM django_dlock_lock WHERE name = %s",
                    [f"lock:{key}"],
                )
                row = cur.fetchone()
        except Error as exc:
            connections[ALIAS].close()
            return {"probe": type(exc).__name__}
        if row is None:
            return {"probe": "no row"}
        return {
            "row_token": row[0],
            "row_fence": row[1],
            "db_at": float(row[2]),
            "port": row[3],
            "timeline": row[4],
        }

    while not os.path.exists(go_path):
        time.sleep(0.05)
    while not os.path.exists(stop_path):
        key = rng.choice(KEYS)
        lk = dlock.lock(key, using=ALIAS, ttl=LEASE_TTL)
        t0 = time.time()
        try:
            got = lk.acquire(timeout=1.0)
        except dlock.DLockError as exc:
            write("refused", key=key, t0=t0, t=time.time(), exc=type(exc).__name__)
            time.sleep(0.05)
            continue
        except Exception as exc:
            raw("acquire", exc)
            time.sleep(0.05)
            continue
        t1 = time.time()
        if not got:
            write("timeout", key=key, t0=t0, t=t1)
            continue
        fence, token = lk.fence, lk.token
        seen = probe(key)
        time.sleep(HOLD)
        t2 = time.time()
        try:
            lk.release()
            outcome = "released"
        except dlock.LockLost:
            outcome = "lost"
        except dlock.DLockError as exc:
            outcome = type(exc).__name__
        except Exception as exc:
            raw("release", exc)
            outcome = "raw"
        write(
            "grant",
            key=key,
            fence=fence,
            token=token,
            t0=t0,
            t1=t1,
            t2=t2,
            t3=time.time(),
            outcome=outcome,
            **seen,
        )
    log.close()


def _records(directory: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(directory.glob("holder-*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
    return found


# -- the campaign ----------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    #: time.time() when the fault was injected
    at: float
    #: the leader before, and the leader once the cluster had one again
    before: str
    after: str = ""
    #: the PostgreSQL port of the old leader, when the leader changed (a grant
    #: there after ``at`` was served before the fault took effect)
    old_port: int | None = None
    timeline: int | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    #: seconds from ``at`` to the next grant (None: none came)
    next_grant: float | None = None


@dataclass
class Campaign:
    grants: list[dict[str, Any]]
    events: list[dict[str, Any]]
    faults: list[Fault]
    cluster_start: float
    wall: float
    hangs: list[str]
    load: tuple[float, float, float]
    #: (what, seconds since the module's start)
    phases: list[tuple[str, float]]


def _next_grant(directory: Path, fault: Fault) -> float | None:
    times = [
        g["t1"]
        for g in _records(directory)
        if g["ev"] == "grant"
        and g["t1"] > fault.at
        and g.get("port") is not None
        and g.get("port") != fault.old_port
    ]
    return min(times) - fault.at if times else None


class Faults:
    """The faults, one after another, each waited out until the holders are granted again."""

    def __init__(self, cluster: PatroniCluster, directory: Path, phase: Any) -> None:
        self.cluster = cluster
        self.directory = directory
        self.done: list[Fault] = []
        self.phase = phase

    def _begin(self, kind: str, leader: Member) -> Fault:
        self.phase(f"{kind}: injected")
        return Fault(kind, time.time(), leader.name)

    def _end(self, fault: Fault, leader: Member) -> None:
        fault.after = leader.name
        if fault.after != fault.before:
            fault.old_port = self.cluster.member(fault.before).port
        fault.timeline = self.cluster.timeline()
        self.done.append(fault)
        self.phase(f"{fault.kind}: new leader")
        # the holders are granted again (on the new leader) before the next fault
        deadline = time.monotonic() + NEXT_GRANT_BOUND + 30
        while fault.next_grant is None and time.monotonic() < deadline:
            time.sleep(0.2)
            fault.next_grant = _next_grant(self.directory, fault)
        self.phase(f"{fault.kind}: granted again")

    def healthy(self, standbys: int | None = None) -> Member:
        """A leader, and ``standbys`` members streaming from it (``None``: every
        member whose Patroni runs). One that does not come is re-initialized,
        as an operator would (``patronictl reinit``)."""
        try:
            return self.cluster.wait_healthy(timeout=20, standbys=standbys)
        except TimeoutError:
            self.phase(f"re-initialized {self.cluster.reinitialize_stragglers()}")
            return self.cluster.wait_healthy(timeout=90, standbys=standbys)
        finally:
            self.phase("healthy")

    def node_crash(self) -> None:
        leader = self.healthy(standbys=1)
        self.cluster.crash_node(leader)
        fault = self._begin("node crash", leader)
        new = self.cluster.wait_leader(timeout=TTL + 60, other_than=leader)
        self.cluster.start_patroni(leader)  # the machine comes back
        self._end(fault, new)

    def postmaster_kill(self) -> None:
        leader = self.healthy(standbys=0)
        self.cluster.kill_postmaster(leader)
        fault = self._begin("postmaster SIGKILL", leader)
        self._end(fault, self.cluster.wait_leader(timeout=TTL + 60))

    def two_switchovers(self) -> None:
        leader = self.healthy(standbys=2)
        first, second = [m for m in self.cluster.members if m is not leader][:2]
        fault = self._begin("switchover", leader)
        self.cluster.switchover(leader, first)
        # at once, while the third member may still follow the old timeline
        fault2 = self._begin("switchover (back to back)", first)
        self.cluster.switchover(first, second)
        self._end(fault, first)
        self._end(fault2, second)

    def async_failover_missing_wal(self) -> None:
        leader = self.healthy(standbys=1)
        with self.cluster.wal_withheld(leader):
            withheld = time.time()
            # the holders are granted on the primary, nothing reaches the standbys
            while time.time() < withheld + 1.5:
                time.sleep(0.1)
            written = self.cluster.lsn(leader)
            self.cluster.crash_node(leader)
            fault = self._begin("async failover, last WAL lost", leader)
        new = self.cluster.wait_leader(timeout=TTL + 60, other_than=leader)
        fault.notes = {
            # at least: the primary wrote on after it was asked its position
            "wal_bytes_lost": written - self.cluster.fork_lsn(new),
            "grants_while_withheld": sum(
                1
                for g in _records(self.directory)
                if g["ev"] == "grant" and withheld <= g["t1"] <= fault.at
            ),
        }
        self.cluster.start_patroni(leader)
        self._end(fault, new)

    def patroni_stop(self) -> None:
        leader = self.healthy(standbys=1)
        fault = self._begin("Patroni stopped", leader)
        self.cluster.stop_patroni(leader)
        new = self.cluster.wait_leader(timeout=TTL + 60, other_than=leader)
        self.cluster.start_patroni(leader)
        self._end(fault, new)


def _run_campaign(tmp: Path, django_db_blocker: Any) -> Campaign:
    began = time.monotonic()
    cluster = PatroniCluster()
    children: list[Any] = []
    hangs: list[str] = []
    phases: list[tuple[str, float]] = []

    def phase(what: str) -> None:
        phases.append((what, round(time.monotonic() - began, 1)))

    try:
        from django.db import connections

        # The holders start (a fresh interpreter, Django) while the cluster does.
        settings = cluster.database_settings(connections.settings["default"], DATABASE)
        go, stop = tmp / "go", tmp / "stop"
        children = [
            procs.start(_holder, settings, str(tmp / f"holder-{n}.jsonl"), str(go), str(stop), n)
            for n in range(HOLDERS)
        ]
        cluster.start()
        phase("cluster started")
        with django_db_blocker.unblock(), cluster.attached(ALIAS, DATABASE):
            phase("migrated")
            go.touch()
            deadline = time.monotonic() + 60
            while len({g["pid"] for g in _records(tmp) if g["ev"] == "grant"}) < HOLDERS:
                assert time.monotonic() < deadline, f"holders granted nothing: {_records(tmp)}"
                time.sleep(0.1)
            phase("holders granted")
            faults = Faults(cluster, tmp, phase)
            try:
                for _ in range(ROUNDS):
                    faults.two_switchovers()
                    faults.postmaster_kill()
                    faults.node_crash()
                    faults.async_failover_missing_wal()
                    faults.patroni_stop()
            except BaseException:
                print(cluster.logs())
                raise
            stop.touch()
            phase("faults done")
            for child in children:
                child.join(HANG)
                if child.is_alive():
                    os.kill(child.pid, signal.SIGUSR1)  # its threads' stacks, to its log
                    time.sleep(0.5)
                    hangs.append(f"holder {child.pid} did not stop within {HANG} s")
        records = _records(tmp)
        return Campaign(
            grants=[r for r in records if r["ev"] == "grant"],
            events=[r for r in records if r["ev"] != "grant"],
            faults=faults.done,
            cluster_start=cluster.start_seconds,
            wall=time.monotonic() - began,
            hangs=hangs,
            load=os.getloadavg(),
            phases=phases,
        )
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
                child.join(10)
        cluster.destroy()


def _report(campaign: Campaign) -> dict[str, Any]:
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for fault in campaign.faults:
        if fault.next_grant is not None:
            by_kind[fault.kind].append(fault.next_grant)
    outcomes = collections.Counter(g["outcome"] for g in campaign.grants)
    refused = collections.Counter(e.get("exc", e["ev"]) for e in campaign.events)
    import django_dlock

    return {
        "django_dlock": str(Path(django_dlock.__file__).parent),
        "cluster start (s)": round(campaign.cluster_start, 1),
        "module wall time (s)": round(campaign.wall, 1),
        "load average (1, 5, 15 min)": campaign.load,
        "grants": len(campaign.grants),
        "release outcomes": dict(outcomes),
        "other events": dict(refused),
        "faults": len(campaign.faults),
        "next grant after the fault (s), max / median": {
            kind: (round(max(times), 2), round(statistics.median(times), 2))
            for kind, times in by_kind.items()
        },
        "phases (s since start)": campaign.phases,
        "per fault": [
            {
                "kind": f.kind,
                "leader": f"{f.before} -> {f.after}",
                "timeline": f.timeline,
                "next grant (s)": None if f.next_grant is None else round(f.next_grant, 2),
                **f.notes,
            }
            for f in campaign.faults
        ],
    }


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory, django_db_blocker: Any) -> Campaign:
    tmp = tmp_path_factory.mktemp("patroni")
    done = _run_campaign(tmp, django_db_blocker)
    report = json.dumps(_report(done), indent=1)
    print(f"\nPatroni campaign:\n{report}")
    target = os.environ.get("DLOCK_TEST_PATRONI_REPORT")
    if target:
        Path(target).write_text(report)
    return done


# -- the checks ------------------------------------------------------------------


def test_every_fault_was_injected_and_holders_were_granted(campaign):
    assert [f.kind for f in campaign.faults] == ROUNDS * [
        "switchover",
        "switchover (back to back)",
        "postmaster SIGKILL",
        "node crash",
        "async failover, last WAL lost",
        "Patroni stopped",
    ]
    assert all(
        f.after and f.after != f.before for f in campaign.faults if f.kind != "postmaster SIGKILL"
    )
    assert len(campaign.grants) > 100
    for fault in campaign.faults:
        if fault.kind.startswith("async"):
            lost = fault.notes
            assert lost["wal_bytes_lost"] > 0 and lost["grants_while_withheld"] > 0, lost


def test_no_raw_driver_errors_and_no_hangs(campaign):
    raw = [e for e in campaign.events if e["ev"] == "raw"]
    assert not campaign.hangs, campaign.hangs
    assert not raw, "\n\n".join(f"{e['where']}: {e['exc']}: {e['msg']}\n{e['tb']}" for e in raw)
    outcomes = {g["outcome"] for g in campaign.grants}
    assert outcomes <= {"released", "lost", "DatabaseUnavailable"}, outcomes


def _by_key(grants: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    keys: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for grant in sorted(grants, key=lambda g: g["t1"]):
        keys[grant["key"]].append(grant)
    return keys


def test_no_two_holders_of_a_key_at_once(campaign):
    """A holder's critical section is from acquire() returning to release() being
    called (one clock: every process runs on this machine). A holder whose
    release said ``LockLost`` did not hold its lease to the end (an
    asynchronous fail-over lost it): those are what fencing numbers are for,
    counted apart."""
    overlaps, with_lost = _overlaps(campaign.grants)
    print(f"\noverlaps with a holder that learnt it had lost its lease: {len(with_lost)}")
    assert not overlaps, overlaps[:20]


def test_no_lease_granted_twice(campaign):
    """One lease row (key, token, the database's acquired_at) is one grant."""
    twice, read_back = _granted_twice(campaign.grants)
    assert read_back, "no grant could be read back from the database"
    assert not twice, twice[:20]


def test_fences_never_repeat_or_go_backwards(campaign):
    """Per key, in the order of the grants, every fencing number is above the
    key's previous ones. (Also counted: numbers handed out twice, any key.)

    The message groups the bad grants by the fault they came after, with the
    timeline and port of the member that granted them."""
    lines = _fence_problems(campaign.grants, campaign.faults)
    print("\nfences: " + "\n".join(lines or ["every number above its key's previous one"]))
    assert not lines, "\n".join(lines)


def test_the_checks_find_what_they_look_for():
    """The checks above, on records made up to break each of them."""

    def grant(key: str, fence: int, t1: float, t2: float, **more: Any) -> dict[str, Any]:
        found = {"key": key, "fence": fence, "t1": t1, "t2": t2, "pid": 1, "outcome": "released"}
        found.update(token="a", row_token="a", row_fence=fence, db_at=t1, port=5, timeline=1)
        return {**found, **more}

    fine = [grant("k", 1, 0.0, 1.0), grant("k", 2, 1.0, 2.0), grant("j", 3, 0.5, 3.0)]
    assert _overlaps(fine) == ([], [])
    assert _granted_twice(fine) == ([], 3)
    assert _fence_problems(fine, []) == []
    # two holders at once; the same with a holder that learnt it lost its lease
    assert len(_overlaps([*fine, grant("k", 4, 1.5, 2.5)])[0]) == 1
    assert _overlaps([*fine, grant("k", 4, 1.5, 2.5, outcome="lost")])[0] == []
    # one lease row reported by two grants
    assert len(_granted_twice([*fine, grant("k", 5, 5.0, 5.1, db_at=0.0)])[0]) == 1
    # a number below the key's previous one, and one issued twice (two keys)
    fault = Fault("switchover", 2.5, "pg1")
    problems = _fence_problems([*fine, grant("k", 2, 3.0, 3.5), grant("i", 3, 4.0, 5.0)], [fault])
    assert problems[0].startswith("1 grants got a number not above"), problems
    assert "2 numbers were issued more than once" in problems[0], problems
    assert problems[1].startswith("after 'switchover': 1 grants, keys ['k']"), problems


def test_next_grant_after_each_fault_within_ttl_plus_5_s(campaign):
    late = {f.kind: f.next_grant for f in campaign.faults}
    assert all(t is not None and t <= NEXT_GRANT_BOUND for t in late.values()), (
        f"bound {NEXT_GRANT_BOUND} s",
        late,
    )


def _brief(grant: dict[str, Any]) -> str:
    return (
        f"pid {grant['pid']} fence {grant['fence']} [{grant['t1']:.3f}, {grant['t2']:.3f}] "
        f"{grant['outcome']} port {grant.get('port')}"
    )


def _after(faults: list[Fault], grant: dict[str, Any]) -> str:
    """The last fault injected before ``grant``."""
    before = [f.kind for f in faults if f.at <= grant["t1"]]
    return before[-1] if before else "(no fault yet)"


def _fence(grant: dict[str, Any]) -> str:
    """A grant's fencing number, where it came from (timeline, port) and when."""
    return (
        f"{grant['fence']} (timeline {grant.get('timeline')}, port {grant.get('port')}, "
        f"t={grant['t1']:.1f})"
    )


def _overlaps(grants: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    """Pairs of grants of one key whose critical sections overlap: those where
    both held their lease to the end, and those where one learnt it had not."""
    overlaps, with_lost = [], []
    for key, found in _by_key(grants).items():
        for i, earlier in enumerate(found):
            for later in found[i + 1 :]:
                if later["t1"] >= earlier["t2"]:
                    break
                pair = (key, _brief(earlier), _brief(later))
                if "lost" in (earlier["outcome"], later["outcome"]):
                    with_lost.append(pair)
                else:
                    overlaps.append(pair)
    return overlaps, with_lost


def _granted_twice(grants: list[dict[str, Any]]) -> tuple[list[Any], int]:
    """Grants that report a lease row (key, token, acquired_at on the database
    clock) another grant reported already; and how many could be read back."""
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    twice = []
    for grant in grants:
        if "db_at" not in grant or grant["row_token"] != grant["token"]:
            continue
        if grant["row_fence"] != grant["fence"]:
            continue
        identity = (grant["key"], grant["token"], grant["db_at"])
        if identity in seen:
            twice.append((_brief(seen[identity]), _brief(grant)))
        seen[identity] = grant
    return twice, len(grants) - sum(1 for g in grants if "db_at" not in g)


def _fence_problems(grants: list[dict[str, Any]], faults: list[Fault]) -> list[str]:
    """What is wrong with the fencing numbers (nothing: an empty list)."""
    bad: dict[str, list[str]] = collections.defaultdict(list)
    keys: dict[str, set[str]] = collections.defaultdict(set)
    for key, found in _by_key(grants).items():
        highest: dict[str, Any] | None = None
        for grant in found:
            if highest is not None and grant["fence"] <= highest["fence"]:
                what = "repeats" if grant["fence"] == highest["fence"] else "is below"
                fault = _after(faults, grant)
                keys[fault].add(key)
                bad[fault].append(
                    f"{key}: {_fence(grant)} {what} {_fence(highest)}, "
                    f"granted {grant['t1'] - highest['t1']:.1f} s before"
                )
            if highest is None or grant["fence"] > highest["fence"]:
                highest = grant
    issued = collections.Counter(g["fence"] for g in grants)
    twice = sorted(f for f, n in issued.items() if n > 1)
    if not bad and not twice:
        return []
    lines = [
        f"{sum(map(len, bad.values()))} grants got a number not above their key's "
        f"previous one; {len(twice)} numbers were issued more than once (any key)"
    ]
    for fault, found in bad.items():
        lines.append(
            f"after '{fault}': {len(found)} grants, keys {sorted(keys[fault])}, e.g.\n    "
            + "\n    ".join(found[:4])
        )
    if twice:
        lines.append(f"numbers issued twice: {twice[:10]}")
    return lines
