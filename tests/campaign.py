"""A randomized fault campaign against real holder processes.

Run it on the test databases::

    DJANGO_SETTINGS_MODULE=tests.settings DLOCK_TEST_CHILD=1 \\
        python -m tests.campaign --seconds 120 --seed 7 [--alias default|sqlite|mysql]
        [--private-cluster]

Holder processes loop over a few keys: they take a lock (short ttl, renewed
or not, a random timeout), sometimes write a row through ``guard()`` (alone
or inside an outer ``transaction.atomic``), sometimes ``extend()`` or
``release()`` explicitly. Each records every outcome to a log of its own
(JSON lines). Meanwhile this process injects faults from a seeded random
generator: it pauses a holder (SIGSTOP) for longer than the ttl, kills one
(SIGKILL) and starts a replacement, ends a holder's database sessions
(``pg_terminate_backend``, MariaDB's ``KILL``) and, with
``--private-cluster`` (PostgreSQL only), restarts a throw-away cluster of its
own. The shared servers are never restarted.

At the end it checks, from the logs and the database:

a. false losses: a loss reported (``on_lost``, ``LockLost``, ``lk.lost``)
   while the lease row still carried the holder's token and fence, unexpired
   on the database clock (each loss is probed by a thread of the holder, on
   a connection of its own, as soon as it is reported), or a loss reported
   less than ttl after the acquire started when no fault touched that holder;
b. raw errors: an exception that is not a django-dlock error out of any
   django-dlock call (``guard()`` included);
c. guard outcomes: a guard that returned has its row, a guard that raised
   has none (a row carries a unique id written inside the guard), except
   after an error that says the outcome is unknown;
d. exclusion: the guarded rows of a key, in insertion order, never go back
   to an older fence, and one fence is one holder.

It prints a summary (counts per category, each violation with its evidence)
and exits with status 1 on any violation.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import procs

TABLE = "dlock_campaign"
#: a loss reported when the database's lease had at most this much left is
#: the holder's own clock running out first (see check())
EARLY = 0.25
#: an acquire that returns this much later than its timeout, its holder not
#: paused meanwhile, is counted (not a violation)
OVERRUN = 2.0
KEY_PREFIX = "campaign:"

# -- the holder processes ------------------------------------------------------


class _Log:
    """One JSON object per line, flushed at once (a SIGKILL loses no line but
    the one being written)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115  (open for the process)
        self._mutex = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        fields.update(ev=event, m=time.monotonic(), t=time.time())
        line = json.dumps(fields, default=repr)
        with self._mutex:
            self._file.write(line + "\n")


def _is_dlock_error(exc: BaseException) -> bool:
    from django_dlock.exceptions import DLockError

    return isinstance(exc, DLockError)


def _describe(exc: BaseException) -> dict[str, Any]:
    found: dict[str, Any] = {"exc": type(exc).__name__, "msg": str(exc)[:300]}
    if not _is_dlock_error(exc):
        found["raw"] = True
        frames = traceback.extract_tb(exc.__traceback__)
        ours = [f for f in frames if "django_dlock" in f.filename]
        if ours:
            last = ours[-1]
            found["at"] = f"{Path(last.filename).name}:{last.lineno} {last.name}"

        found["repr"] = repr(exc)[:500]
        found["tb"] = "".join(traceback.format_exception(exc))[-4000:]
    elif exc.__cause__ is not None:
        found["cause"] = repr(exc.__cause__)[:300]
    return found


class _Prober(threading.Thread):
    """Asks the database, on a connection of its own, whether a lease that was
    just reported lost is still the holder's (its token and fence, unexpired
    on the database clock)."""

    def __init__(self, alias: str, log: _Log) -> None:
        super().__init__(name="campaign-prober", daemon=True)
        self.alias = alias
        self.log = log
        self.jobs: queue.Queue[tuple[int, str, str, int | None]] = queue.Queue()

    def run(self) -> None:
        from django.db import connections

        from django_dlock import dbclock

        while True:
            loss, name, token, fence = self.jobs.get()
            for attempt in range(5):
                try:
                    conn = connections[self.alias]
                    sql = (
                        f"SELECT token, fence, {dbclock.seconds_until_sql(conn, 'expire_at')} "
                        "FROM django_dlock_lock WHERE name = %s"
                    )
                    with conn.cursor() as cur:
                        cur.execute(sql, [name])
                        row = cur.fetchone()
                except Exception as exc:
                    connections[self.alias].close()
                    if attempt == 4:
                        self.log("probe", loss=loss, error=repr(exc)[:300])
                    time.sleep(0.2)
                    continue
                if row is None:
                    self.log("probe", loss=loss, ours=False, row=None)
                else:
                    ours = row[0] == token and (fence is None or int(row[1]) == fence)
                    left = float(row[2])
                    self.log(
                        "probe", loss=loss, ours=ours and left > 0, fence=int(row[1]), left=left
                    )
                break


@dataclass
class _Grant:
    key: str
    name: str
    token: str
    fence: int | None
    gid: int
    start: float  # monotonic: when the acquire started (the lease cannot end before start + ttl)


class _Holder:
    """One holder process: a loop of lock, work, guard, extend, release."""

    def __init__(self, alias: str, ident: str, seed: int, folder: str, keys: int, ttl: float):
        self.alias = alias
        self.ident = ident
        self.rng = random.Random(seed)
        self.folder = Path(folder)
        self.keys = [f"{KEY_PREFIX}{n}" for n in range(keys)]
        self.ttl = ttl
        self.log = _Log(str(self.folder / f"holder-{ident}.jsonl"))
        self.prober = _Prober(alias, self.log)
        self.grant: _Grant | None = None
        self.seq = 0
        self.losses = 0
        self._mutex = threading.Lock()

    # -- recording ----------------------------------------------------------

    def lost(self, via: str, error: BaseException | None) -> None:
        """A loss was reported: record it and have it probed."""
        grant = self.grant
        with self._mutex:
            self.losses += 1
            loss = self.losses
        self.log(
            "loss",
            loss=loss,
            via=via,
            gid=None if grant is None else grant.gid,
            key=None if grant is None else grant.key,
            fence=None if grant is None else grant.fence,
            msg=None if error is None else str(error)[:300],
            thread=threading.current_thread().name,
        )
        if grant is not None:
            self.prober.jobs.put((loss, grant.name, grant.token, grant.fence))

    def call(self, where: str, func: Callable[[], Any]) -> tuple[bool, Any]:
        """Run a django-dlock call; record a raw error. ``(True, result)`` or
        ``(False, exception)`` (a django-dlock error, or a raw one)."""
        from django_dlock.exceptions import LockLost

        start = time.monotonic()
        try:
            result = func()
        except Exception as exc:
            took = time.monotonic() - start
            info = _describe(exc)
            self.log("call", where=where, ok=False, took=took, gid=self._gid(), **info)
            if isinstance(exc, LockLost):
                self.lost(where, exc)
            return False, exc
        self.log("call", where=where, ok=True, took=time.monotonic() - start, gid=self._gid())
        return True, result

    def _gid(self) -> int | None:
        return None if self.grant is None else self.grant.gid

    # -- the loop -------------------------------------------------------------

    def run(self) -> None:
        import django_dlock as dlock

        self.prober.start()
        self.log("start", pid=os.getpid())
        stop = self.folder / "stop"
        gid = 0
        while not stop.exists():
            gid += 1
            key = self.rng.choice(self.keys)
            renew = self.rng.random() < 0.6
            timeout = self.rng.choice([0.0, 0.5, 2.0, 5.0])
            lk = dlock.lock(
                key,
                using=self.alias,
                ttl=self.ttl,
                renew=renew,
                timeout=timeout,
                on_lost=lambda exc: self.lost("on_lost", exc),
            )
            explicit = self.rng.random() < 0.3
            start = time.monotonic()
            # (set before the acquire: a loss may be reported the moment it returns)
            self.grant = _Grant(key, lk.name, lk.token, None, gid, start)
            self.log("acquire", gid=gid, key=key, renew=renew, timeout=timeout, explicit=explicit)
            if explicit:
                ok, got = self.call("acquire", lambda lk=lk: lk.acquire())
                granted = ok and got is True
            else:
                ok, got = self.call("enter", lk.__enter__)
                granted = ok
            if not granted:
                self.grant = None
                time.sleep(self.rng.uniform(0, 0.05))  # (no hot loop on a broken connection)
                continue
            fence = lk.fence
            self.grant.fence = fence
            self.log("grant", gid=gid, key=key, fence=fence, waited=time.monotonic() - start)
            self.hold(lk, renew)
            if explicit:
                self.call("release", lk.release)
            else:
                self.call("exit", lambda lk=lk: lk.__exit__(None, None, None))
            self.log("end", gid=gid, lost=lk.lost)
            self.grant = None
            time.sleep(self.rng.uniform(0, 0.05))
        self.log("stop")

    def hold(self, lk: Any, renew: bool) -> None:
        """The work done while holding: a few steps, each drawn at random."""
        for _ in range(self.rng.randint(1, 3)):
            step = self.rng.choice(["work", "guard", "guard", "outer", "extend", "owned"])
            if step == "work":
                # a renewed lock may be held past its ttl; a plain one within it
                limit = self.ttl * (1.5 if renew else 0.5)
                time.sleep(self.rng.uniform(0, limit))
            elif step == "guard":
                self.guard(lk, self.next_uid())
            elif step == "outer":
                self.outer(lk)
            elif step == "extend":
                self.call("extend", lk.extend)
            else:
                self.call("owned", lk.owned)

    def next_uid(self) -> str:
        self.seq += 1
        return f"{self.ident}.{self.seq}"

    def guard(self, lk: Any, uid: str) -> str:
        """Write one row through ``lk.guard()``: "returned", "raised" or "unknown"."""
        from django.db import connections

        grant = self.grant
        assert grant is not None
        mine: list[BaseException] = []
        self.log("guard", uid=uid, gid=grant.gid, fence=grant.fence)
        start = time.monotonic()
        try:
            with lk.guard():
                try:
                    with connections[self.alias].cursor() as cur:
                        cur.execute(
                            f"INSERT INTO {TABLE} (k, fence, holder, seq, uid) "
                            "VALUES (%s, %s, %s, %s, %s)",
                            [
                                grant.key,
                                grant.fence or 0,
                                self.ident,
                                int(uid.rpartition(".")[2]),
                                uid,
                            ],
                        )
                except Exception as exc:
                    mine.append(exc)
                    raise
                time.sleep(self.rng.uniform(0, self.ttl / 5))
        except Exception as exc:
            from django_dlock.exceptions import LockLost

            where = "write" if mine and exc is mine[0] else "guard"
            info = _describe(exc)
            self.log(
                "guard_end",
                uid=uid,
                gid=grant.gid,
                ok=False,
                where=where,
                took=time.monotonic() - start,
                lost=lk.lost,
                **info,
            )
            if isinstance(exc, LockLost) and lk.lost:
                self.lost("guard", exc)
            return "raised"
        self.log("guard_end", uid=uid, gid=grant.gid, ok=True, took=time.monotonic() - start)
        return "returned"

    def outer(self, lk: Any) -> None:
        """A guard inside an outer transaction (a view with ATOMIC_REQUESTS);
        sometimes an ``extend()`` in the same transaction."""
        from django.db import transaction

        uid = self.next_uid()
        self.log("outer", uid=uid, gid=self._gid())
        start = time.monotonic()
        try:
            with transaction.atomic(using=self.alias):
                outcome = self.guard(lk, uid)
                if outcome == "returned" and self.rng.random() < 0.2:
                    self.call("extend-in-outer", lk.extend)
        except Exception as exc:
            self.log(
                "outer_end",
                uid=uid,
                gid=self._gid(),
                ok=False,
                took=time.monotonic() - start,
                **_describe(exc),
            )
            return
        self.log("outer_end", uid=uid, gid=self._gid(), ok=True, took=time.monotonic() - start)


def holder_main(alias: str, ident: str, seed: int, folder: str, keys: int, ttl: float) -> None:
    """A holder process (started by :func:`procs.start`)."""
    _Holder(alias, ident, seed, folder, keys, ttl).run()


# -- the fault driver --------------------------------------------------------------


@dataclass
class _Fault:
    kind: str
    holder: str | None  # None: every holder (a server restart)
    start: float  # monotonic (system-wide: comparable with the holders' logs)
    end: float
    detail: str = ""


@dataclass
class _Campaign:
    alias: str
    seconds: float
    seed: int
    folder: Path
    holders: int
    keys: int
    ttl: float
    cluster: Any = None
    rng: random.Random = field(init=False)
    procs: dict[int, Any] = field(default_factory=dict)
    gens: dict[int, int] = field(default_factory=dict)
    faults: list[_Fault] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def vendor(self) -> str:
        from django.db import connections

        return str(connections[self.alias].vendor)

    def ident(self, slot: int) -> str:
        return f"{slot}-{self.gens[slot]}"

    def start_holder(self, slot: int) -> None:
        self.gens[slot] = self.gens.get(slot, -1) + 1
        seed = self.rng.randrange(2**32)
        self.procs[slot] = procs.start(
            holder_main, self.alias, self.ident(slot), seed, str(self.folder), self.keys, self.ttl
        )

    def kinds(self) -> list[tuple[str, float]]:
        kinds = [("stop", 3.0), ("kill", 1.0)]
        if self.vendor in ("postgresql", "mysql"):
            kinds.append(("terminate", 3.0))
        if self.cluster is not None:
            kinds.append(("restart", 0.4))
        return kinds

    def run(self) -> None:
        for slot in range(self.holders):
            self.start_holder(slot)
        time.sleep(2.0)  # (the holders set Django up)
        end = time.monotonic() + self.seconds
        kinds = self.kinds()
        while time.monotonic() < end:
            time.sleep(self.rng.uniform(0.2, 1.2))
            for slot, proc in list(self.procs.items()):
                if not proc.is_alive():  # died on its own: a finding, and a replacement
                    self.notes.append(f"holder {self.ident(slot)} exited with {proc.exitcode}")
                    self.start_holder(slot)
            kind = self.rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]
            slot = self.rng.randrange(self.holders)
            getattr(self, f"fault_{kind}")(slot)
        self.finish()

    def fault_stop(self, slot: int) -> None:
        proc = self.procs[slot]
        pause = self.ttl * self.rng.uniform(1.2, 2.5)
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(proc.pid, signal.SIGCONT)
        self.faults.append(_Fault("stop", self.ident(slot), start, time.monotonic()))

    def fault_kill(self, slot: int) -> None:
        proc = self.procs[slot]
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        self.faults.append(_Fault("kill", self.ident(slot), start, time.monotonic()))
        self.start_holder(slot)

    def fault_terminate(self, slot: int) -> None:
        """End every database session of one holder (its own, its renewers',
        its listener's)."""
        ident = self.ident(slot)
        ports = _client_ports(self.procs[slot].pid)
        start = time.monotonic()
        ended = self.sessions_end(ports)
        self.faults.append(_Fault("terminate", ident, start, time.monotonic(), str(ended)))

    def sessions_end(self, ports: set[int]) -> int:
        if not ports:
            return 0

        def end() -> int:
            from django.db import connections

            with connections[self.alias].cursor() as cur:
                if self.vendor == "postgresql":
                    cur.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND client_port = ANY(%s)",
                        [sorted(ports)],
                    )
                    return int(cur.fetchone()[0])
                cur.execute(
                    "SELECT id, host FROM information_schema.PROCESSLIST "
                    "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
                ended = 0
                for pid, host in cur.fetchall():
                    port = (host or "").rpartition(":")[2]
                    if port.isdigit() and int(port) in ports:
                        with contextlib.suppress(Exception):
                            cur.execute(f"KILL {int(pid)}")
                            ended += 1
                return ended

        return int(_retrying(self.alias, end))

    def fault_restart(self, slot: int) -> None:
        start = time.monotonic()
        self.cluster.restart()
        self.faults.append(_Fault("restart", None, start, time.monotonic()))

    def finish(self) -> None:
        (self.folder / "stop").write_text("stop")
        deadline = time.monotonic() + 2 * self.ttl + 20
        for slot, proc in self.procs.items():
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                self.notes.append(
                    f"holder {self.ident(slot)} did not stop within {2 * self.ttl + 20:.0f}s "
                    "of the end (killed)"
                )
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10)
                self.faults.append(
                    _Fault("kill", self.ident(slot), time.monotonic(), time.monotonic(), "at end")
                )
        time.sleep(0.5)


def _client_ports(pid: int) -> set[int]:
    """The local TCP ports of a process's sockets (its database sessions)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[9] in inodes:
                    ports.add(int(cols[1].rpartition(":")[2], 16))
    return ports


def _retrying(alias: str, func: Callable[[], Any], tries: int = 20) -> Any:
    """``func()`` on this process's connection, reconnecting across a restart."""
    from django.db import connections

    for attempt in range(tries):
        try:
            return func()
        except Exception:
            connections[alias].close()
            if attempt == tries - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


# -- setting the database up ------------------------------------------------------


_DDL = {
    "postgresql": "CREATE TABLE {t} (id bigserial PRIMARY KEY, k varchar(100) NOT NULL, "
    "fence bigint NOT NULL, holder varchar(40) NOT NULL, seq integer NOT NULL, "
    "uid varchar(60) NOT NULL UNIQUE)",
    "mysql": "CREATE TABLE {t} (id bigint AUTO_INCREMENT PRIMARY KEY, k varchar(100) NOT NULL, "
    "fence bigint NOT NULL, holder varchar(40) NOT NULL, seq integer NOT NULL, "
    "uid varchar(60) NOT NULL UNIQUE) ENGINE=InnoDB",
    "sqlite": "CREATE TABLE {t} (id integer PRIMARY KEY AUTOINCREMENT, k varchar(100) NOT NULL, "
    "fence bigint NOT NULL, holder varchar(40) NOT NULL, seq integer NOT NULL, "
    "uid varchar(60) NOT NULL UNIQUE)",
}


def _create_database(alias: str) -> None:
    """Create the alias's database if it is missing (a run outside pytest)."""
    from django.db import connections

    db = connections.settings[alias]
    if db["ENGINE"].endswith("postgresql"):
        import psycopg

        with psycopg.connect(
            host=db["HOST"], port=db["PORT"], user=db["USER"], dbname="postgres", autocommit=True
        ) as conn:
            if not conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]
            ).fetchone():
                conn.execute(f'CREATE DATABASE "{db["NAME"]}"')
    elif db["ENGINE"].endswith("mysql"):
        import MySQLdb

        conn = MySQLdb.connect(
            host=db["HOST"], port=int(db["PORT"]), user=db["USER"], password=db["PASSWORD"]
        )
        try:
            conn.cursor().execute(
                f"CREATE DATABASE IF NOT EXISTS `{db['NAME']}` "
                "CHARACTER SET utf8mb4 COLLATE utf8mb4_unicode_ci"
            )
        finally:
            conn.close()


def prepare(alias: str) -> None:
    """The lock tables (migrated), an empty campaign table, no lease of a campaign key."""
    from django.core.management import call_command
    from django.db import connections

    _create_database(alias)
    call_command("migrate", database=alias, verbosity=0)
    conn = connections[alias]
    with conn.cursor() as cur:
        cur.execute(f"DROP TABLE IF EXISTS {TABLE}")
        cur.execute(_DDL[conn.vendor].format(t=TABLE))
        cur.execute("DELETE FROM django_dlock_lock WHERE name LIKE %s", [f"lock:{KEY_PREFIX}%"])
    conn.close()


# -- the checks ------------------------------------------------------------------


def _read_logs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    logs = {}
    for path in sorted(folder.glob("holder-*.jsonl")):
        events = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # (the line a SIGKILL cut)
                events.append(json.loads(line))
        logs[path.stem.removeprefix("holder-")] = events
    return logs


def _unknown_outcome_errors() -> set[str]:
    """Names of django-dlock errors that say a transaction's outcome is unknown."""
    from django_dlock import exceptions

    return {
        name
        for name in dir(exceptions)
        if isinstance(getattr(exceptions, name), type)
        and any(word in name for word in ("Unknown", "Uncertain", "Indeterminate", "InDoubt"))
    }


@dataclass
class Report:
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    raw: collections.Counter[str] = field(default_factory=collections.Counter)
    passed_through: collections.Counter[str] = field(default_factory=collections.Counter)
    outer_raw: collections.Counter[str] = field(default_factory=collections.Counter)
    guard_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    call_errors: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    slowest: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def violation(self, kind: str, evidence: str) -> None:
        self.violations[kind].append(evidence)

    def raw_error(self, key: str, evidence: str) -> None:
        """A raw error: one violation each, shown once per kind (the first)."""
        if key not in self.raw:
            self.violation("raw error from a django-dlock call (first of each kind)", evidence)
        self.raw[key] += 1

    def total(self) -> int:
        return sum(len(v) for v in self.violations.values()) - len(self.raw) + self.total_raw()

    def total_raw(self) -> int:
        return sum(self.raw.values())

    def as_text(self) -> str:
        out = ["== campaign summary =="]
        out.append("counts: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())))
        out.append("faults: " + ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items())))
        out.append(
            "django-dlock errors from calls: "
            + ", ".join(f"{k}={v}" for k, v in self.call_errors.most_common())
        )
        out.append(
            "guards raised: " + ", ".join(f"{k}={v}" for k, v in self.guard_errors.most_common())
        )
        out.append(
            "slowest call per kind (s): "
            + ", ".join(f"{k}={v:.1f}" for k, v in sorted(self.slowest.items()))
        )
        if self.passed_through:
            out.append("driver errors of the campaign's own statement inside a guard (passed):")
            out.extend(f"  {n} x {msg}" for msg, n in self.passed_through.most_common())
        if self.outer_raw:
            out.append("driver errors at the end of an outer transaction (Django's atomic):")
            out.extend(f"  {n} x {msg}" for msg, n in self.outer_raw.most_common())
        if self.raw:
            out.append("raw errors from django-dlock calls, by message:")
            out.extend(f"  {n} x {msg}" for msg, n in self.raw.most_common())
        for note in self.notes:
            out.append(f"note: {note}")
        out.append(f"violations: {self.total()} (raw errors: {self.total_raw()})")
        for kind, found in sorted(self.violations.items()):
            out.append(f"-- {kind}: {len(found)}")
            out.extend(f"   {evidence}" for evidence in found[:25])
            if len(found) > 25:
                out.append(f"   ... and {len(found) - 25} more")
        return "\n".join(out)


def check(alias: str, folder: Path, faults: list[_Fault], ttl: float, notes: list[str]) -> Report:
    from django.db import connections

    report = Report(notes=list(notes))
    for fault in faults:
        report.faults[fault.kind] += 1
        if fault.kind == "terminate":
            report.faults["sessions ended"] += int(fault.detail)
    logs = _read_logs(folder)
    unknown_ok = _unknown_outcome_errors()

    def touched(holder: str, since: float, until: float) -> list[_Fault]:
        return [
            f
            for f in faults
            if (f.holder in (None, holder)) and f.start <= until + 0.1 and f.end >= since - 0.1
        ]

    expected: dict[str, tuple[str, str]] = {}  # uid -> (present/absent/unknown, evidence)
    for holder, events in logs.items():
        grants: dict[int, dict[str, Any]] = {}
        starts: dict[int, float] = {}
        losses: dict[int, dict[str, Any]] = {}
        probes: dict[int, dict[str, Any]] = {}
        guards: dict[str, dict[str, Any]] = {}
        outers: dict[str, dict[str, Any]] = {}
        steps: dict[int, list[str]] = collections.defaultdict(list)
        timeouts: dict[int, float] = {}
        for ev in events:
            kind = ev["ev"]
            if ev.get("gid") is not None and kind in ("call", "guard_end", "outer", "outer_end"):
                steps[ev["gid"]].append(_step(ev))
            if kind == "acquire":
                starts[ev["gid"]] = ev["m"]
                timeouts[ev["gid"]] = ev.get("timeout", math.inf)
                report.counts["acquires"] += 1
            elif kind == "grant":
                grants[ev["gid"]] = ev
                report.counts["grants"] += 1
            elif kind == "loss":
                losses[ev["loss"]] = ev
            elif kind == "probe":
                probes[ev["loss"]] = ev
            elif kind == "call":
                where = ev["where"]
                report.slowest[where] = max(report.slowest.get(where, 0.0), ev["took"])
                limit = timeouts.get(ev.get("gid"), math.inf) + OVERRUN
                paused = [
                    f
                    for f in touched(holder, ev["m"] - ev["took"], ev["m"])
                    if f.kind == "stop" and f.holder == holder
                ]
                if where in ("enter", "acquire") and ev["took"] > limit and not paused:
                    report.counts[f"acquires that overran their timeout by > {OVERRUN:.0f}s"] += 1
                if not ev["ok"]:
                    if ev.get("raw"):
                        report.raw_error(
                            _raw_key(where, ev),
                            f"holder {holder} {where} gid={ev.get('gid')}: {ev['repr']}\n"
                            + _indent(ev["tb"]),
                        )
                    else:
                        report.call_errors[f"{where}:{ev['exc']}"] += 1
            elif kind == "guard":
                guards[ev["uid"]] = ev
                report.counts["guards"] += 1
            elif kind == "guard_end":
                guards[ev["uid"]]["end"] = ev
                report.slowest["guard"] = max(report.slowest.get("guard", 0.0), ev["took"])
                if ev["ok"]:
                    report.counts["guards returned"] += 1
                else:
                    report.counts["guards raised"] += 1
                    report.guard_errors[f"{ev['where']}:{ev['exc']}"] += 1
                    if ev.get("raw") and ev["where"] == "guard":
                        report.raw_error(
                            _raw_key("guard", ev),
                            f"holder {holder} guard {ev['uid']}: {ev['repr']}\n"
                            + _indent(ev["tb"]),
                        )
                    elif ev.get("raw"):
                        report.passed_through[f"{ev['exc']}: {ev['msg'][:160]}"] += 1
            elif kind == "outer":
                outers[ev["uid"]] = ev
            elif kind == "outer_end":
                outers.setdefault(ev["uid"], {})["end"] = ev
                report.slowest["outer"] = max(report.slowest.get("outer", 0.0), ev["took"])
                if not ev["ok"]:
                    report.counts["outer transactions raised"] += 1
                    if ev.get("raw"):
                        report.outer_raw[f"{ev['exc']}: {ev['msg'][:160]}"] += 1
        # (c) what each guard says about its row
        for uid, g in guards.items():
            end = g.get("end")
            outer = outers.get(uid)
            if end is None:
                expected[uid] = ("unknown", "no outcome (holder killed or stopped)")
                continue
            if outer is not None:
                oend = outer.get("end")
                if oend is None:
                    expected[uid] = ("unknown", "outer transaction has no outcome")
                elif end["ok"] and oend["ok"]:
                    expected[uid] = ("present", "guard returned, outer transaction committed")
                elif end["ok"]:
                    # Django's atomic reported it, not the guard (which returned)
                    said = f"{oend['exc']}: {oend['msg'][:200]}"
                    expected[uid] = ("outer failed", f"outer transaction raised {said}")
                elif end["exc"] in unknown_ok:
                    expected[uid] = ("unknown", end["exc"])
                else:
                    said = f"{end['exc']}: {end['msg'][:200]}"
                    expected[uid] = ("absent", f"guard (in an outer transaction) raised {said}")
            elif end["ok"]:
                expected[uid] = ("present", "guard returned")
            elif end["exc"] in unknown_ok:
                expected[uid] = ("unknown", end["exc"])
            else:
                expected[uid] = ("absent", f"guard raised {end['exc']}: {end['msg'][:200]}")
        # (a) false losses
        lost_grants = set()
        false_grants = set()
        for loss, ev in losses.items():
            gid = ev.get("gid")
            if gid is None:
                continue
            lost_grants.add(gid)
            report.counts["loss reports"] += 1
            start = starts.get(gid, ev["m"])
            grant = grants.get(gid, {})
            probe = probes.get(loss)
            evidence = (
                f"holder {holder} gid={gid} key={ev.get('key')} fence={ev.get('fence')} "
                f"via={ev['via']} {ev['m'] - start:.3f}s after the acquire started "
                f"(waited {grant.get('waited', 0):.3f}s), thread {ev.get('thread')}: "
                f"{ev.get('msg')}"
            )
            if probe is None:
                report.counts["loss reports not probed"] += 1
            elif probe.get("ours") and probe["left"] <= EARLY:
                # The holder counts its lease from when the statement that
                # granted or renewed it was sent; the database from when it
                # ran: a report at the local lease end precedes the
                # database's by that much, on purpose.
                report.counts["loss reports at the local lease end"] += 1
            elif probe.get("ours"):
                false_grants.add(gid)
                report.violation(
                    "false loss (the database still had the lease)",
                    f"{evidence}; probe {probe['m'] - ev['m']:.3f}s later: still this "
                    f"holder's lease, fence {probe['fence']}, {probe['left']:.3f}s left; "
                    f"faults: {_faults_text(touched(holder, start, ev['m']))}; "
                    f"steps: {', '.join(steps[gid])}",
                )
                continue
            if ev["m"] - start < ttl - 0.05 and not touched(holder, start, ev["m"]):
                false_grants.add(gid)
                report.violation(
                    "false loss (reported within the ttl, no fault)",
                    f"{evidence}; probe: {probe}; steps: {', '.join(steps[gid])}",
                )
        report.counts["grants reported lost"] += len(lost_grants)
        report.counts["grants falsely reported lost"] += len(false_grants)

    # (c) and (d): the rows
    def rows() -> list[tuple[Any, ...]]:
        with connections[alias].cursor() as cur:
            cur.execute(f"SELECT id, k, fence, holder, uid FROM {TABLE} ORDER BY id")
            return list(cur.fetchall())

    found = _retrying(alias, rows)
    present = {row[4] for row in found}
    report.counts["rows"] = len(found)
    for uid, (want, why) in sorted(expected.items()):
        if want == "present" and uid not in present:
            report.violation("guard returned but its row is missing", f"{uid}: {why}")
        elif want == "absent" and uid in present:
            report.violation("guard reported an error but its row committed", f"{uid}: {why}")
        elif want == "absent":
            report.counts["guards failed, row absent"] += 1
        elif want == "outer failed":
            report.counts["outer transactions failed after their guard returned"] += 1
            if uid in present:
                report.counts[
                    "outer transactions failed after their guard returned, committed"
                ] += 1
        elif want == "unknown":
            report.counts["guards of unknown outcome"] += 1
            if uid in present:
                report.counts["guards of unknown outcome, committed"] += 1
    last: dict[str, tuple[int, str, str]] = {}
    for _id, key, fence, holder, uid in found:
        previous = last.get(key)
        if previous is not None:
            pfence, pholder, puid = previous
            if fence < pfence or (fence == pfence and holder != pholder):
                report.violation(
                    "exclusion",
                    f"{key}: row {uid} (fence {fence}, holder {holder}) committed after "
                    f"{puid} (fence {pfence}, holder {pholder})",
                )
        last[key] = (fence, holder, uid)
    return report


def _raw_key(where: str, ev: dict[str, Any]) -> str:
    at = f" (at {ev['at']})" if ev.get("at") else ""
    return f"{where}{at}: {ev['exc']}: {ev['msg'][:160]}"


def _step(ev: dict[str, Any]) -> str:
    """One step of a holding, for the evidence of a violation."""
    name = {"call": ev.get("where"), "guard_end": "guard"}.get(ev["ev"], ev["ev"])
    if ev["ev"] == "outer":
        return "outer["
    if ev["ev"] == "outer_end":
        name = "]outer"
    if "ok" not in ev:
        return str(name)
    outcome = "ok" if ev["ok"] else ev["exc"]
    return f"{name}:{outcome}({ev['took']:.2f}s)"


def _faults_text(faults: list[_Fault]) -> str:
    return ", ".join(f"{f.kind}({f.detail})" if f.detail else f.kind for f in faults) or "none"


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[-12:])


# -- the command -------------------------------------------------------------------


@contextlib.contextmanager
def _private_cluster(wanted: bool) -> Iterator[Any]:
    """A throw-away PostgreSQL cluster for the ``default`` alias (before Django
    is set up: the holders inherit its port), or nothing."""
    if not wanted:
        yield None
        return
    from .pgcluster import PrivateCluster

    cluster = PrivateCluster(fsync="off").create()
    os.environ["DLOCK_TEST_PG_HOST"] = "127.0.0.1"
    os.environ["DLOCK_TEST_PG_PORT"] = str(cluster.port)
    os.environ["DLOCK_TEST_PG_USER"] = "postgres"
    try:
        yield cluster
    finally:
        cluster.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.campaign", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="how long faults go on")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--alias", default="default", choices=["default", "sqlite", "mysql"])
    parser.add_argument("--holders", type=int, default=4)
    parser.add_argument("--keys", type=int, default=3)
    parser.add_argument("--ttl", type=float, default=2.0)
    parser.add_argument(
        "--private-cluster",
        action="store_true",
        help="PostgreSQL: run on a throw-away cluster of its own, and restart it as a fault",
    )
    parser.add_argument("--logs", help="folder for the holders' logs (default: a new one)")
    args = parser.parse_args(argv)
    if args.private_cluster and args.alias != "default":
        parser.error("--private-cluster is for the PostgreSQL alias (default)")
    os.environ["DLOCK_TEST_CHILD"] = "1"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    folder = Path(args.logs or tempfile.mkdtemp(prefix="dlock-campaign-"))
    folder.mkdir(parents=True, exist_ok=True)
    for old in [*folder.glob("holder-*.jsonl"), folder / "stop"]:
        old.unlink(missing_ok=True)
    with _private_cluster(args.private_cluster) as cluster:
        import django

        django.setup()
        prepare(args.alias)
        campaign = _Campaign(
            args.alias, args.seconds, args.seed, folder, args.holders, args.keys, args.ttl, cluster
        )
        print(f"campaign: seed {args.seed}, {args.seconds:.0f}s on {args.alias}, logs in {folder}")
        try:
            campaign.run()
        finally:
            for proc in campaign.procs.values():
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGKILL)
        faults = [vars(fault) for fault in campaign.faults]
        (folder / "faults.json").write_text(json.dumps(faults, indent=1))
        report = check(args.alias, folder, campaign.faults, args.ttl, campaign.notes)
        from django.db import connections

        connections.close_all()
    print(report.as_text())
    (folder / "summary.txt").write_text(report.as_text())
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
