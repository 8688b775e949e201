"""4. Leader failover: how long until a standby leads after the leader dies.

Three ``manage.py dlock_runworker`` processes campaign in one election. The leader
is killed (SIGKILL: a crash) or stopped (SIGTERM: it steps down), and the
time from the signal to another worker's ``became leader`` line is measured
(median of several). A replacement worker keeps three in the race.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
TIMING = {"lease": 4.0, "renew_deadline": 3.0, "retry": 0.5}


def noop() -> None:
    """The job of the benchmark's workers: leadership is what is measured."""


class _Worker:
    def __init__(self, strategy: str, election: str) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.benchmarks.settings",
            "PYTHONPATH": ROOT,
            "PYTHONUNBUFFERED": "1",
        }
        cmd = [
            sys.executable, "-m", "django", "dlock_runworker",
            "--job", "tests.benchmarks.failover.noop", "--interval", "60",
            "--election", election, "--strategy", strategy,
            "--lease", str(TIMING["lease"]), "--renew-deadline", str(TIMING["renew_deadline"]),
            "--retry", str(TIMING["retry"]),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT
        )
        self.led_at: float | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("became leader"):
                self.led_at = time.monotonic()
            if line.startswith(("became leader", "standing by")):
                self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@dataclass
class Failover:
    strategy: str
    signal: str
    median_s: float
    samples: list[float]


def measure(strategy: str, signum: int, kills: int = 5) -> Failover:
    election = f"bench-{strategy}-{signum}-{os.getpid()}"
    workers = [_Worker(strategy, election) for _ in range(3)]
    samples: list[float] = []
    try:
        for worker in workers:
            worker.ready.wait(60)
        while len(samples) < kills:
            leader = _wait_for_leader(workers)
            others = [w for w in workers if w is not leader]
            for worker in others:
                worker.led_at = None
            sent = time.monotonic()
            leader.proc.send_signal(signum)
            end = sent + TIMING["lease"] + 30
            while time.monotonic() < end and not any(w.led_at for w in others):
                time.sleep(0.005)
            new = next((w for w in others if w.led_at), None)
            if new is None:
                raise RuntimeError(f"no standby took over ({strategy}, signal {signum})")
            samples.append(new.led_at - sent)  # type: ignore[operator]
            leader.stop()
            workers = [*others, _Worker(strategy, election)]
            workers[-1].ready.wait(60)
    finally:
        for worker in workers:
            worker.stop()
    return Failover(strategy, signal.Signals(signum).name, statistics.median(samples), samples)


def _wait_for_leader(workers: list[_Worker], timeout: float = 60) -> _Worker:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        leaders = [w for w in workers if w.led_at is not None and w.proc.poll() is None]
        if leaders:
            return max(leaders, key=lambda w: w.led_at or 0.0)
        time.sleep(0.01)
    raise RuntimeError("no worker became leader")


def run(kills: int = 5) -> list[Failover]:
    return [
        measure(strategy, signum, kills)
        for strategy in ("lease", "advisory")
        for signum in (signal.SIGKILL, signal.SIGTERM)
    ]


# -- what happens to the leader: one table per database and strategy ---------------------------
#
#     python -m tests.benchmarks.failover --using default --using mysql --using sqlite
#
# Runs three ``dlock_runworker`` processes per (database, strategy) on the test settings
# (``tests.settings`` as the tests' child processes use it: the ``test_dlock*``
# databases, created and migrated here if missing) and, for each event, measures the
# seconds from the event to another worker's "became leader" line (median, min-max).
# "keeps leading" means no other worker led within three leases.

FAST = {"lease": 2.0, "renew_deadline": 1.5, "retry": 0.4}
#: a regular expression that keeps the GIL for seconds (catastrophic backtracking)
GIL_SIZE = int(os.environ.get("FAILOVER_GIL_SIZE", "27"))


def maybe_hold_gil() -> None:
    """The job of the table's workers: holds the GIL for seconds once the flag file appears."""
    import re

    flag = os.environ["FAILOVER_GIL_FLAG"]
    try:
        os.remove(flag)  # one run only takes the flag
    except FileNotFoundError:
        return
    re.match(r"(a+)+$", "a" * GIL_SIZE + "b")


class _TableWorker:
    def __init__(self, alias: str, strategy: str, election: str, flag: str, isolate: bool) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DLOCK_TEST_CHILD": "1",
            "PYTHONPATH": ROOT,
            "PYTHONUNBUFFERED": "1",
            "FAILOVER_GIL_FLAG": flag,
        }
        cmd = [
            sys.executable, "-m", "django", "dlock_runworker",
            "--job", "tests.benchmarks.failover.maybe_hold_gil", "--interval", "0.2",
            "--election", election, "--strategy", strategy, "--using", alias,
            "--lease", str(FAST["lease"]), "--renew-deadline", str(FAST["renew_deadline"]),
            "--retry", str(FAST["retry"]),
        ]  # fmt: skip
        if isolate:
            cmd.append("--isolate")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=open(os.environ.get("FAILOVER_STDERR", os.devnull), "a"),  # noqa: SIM115
            text=True,
            env=env,
            cwd=ROOT,
        )
        self.leading = False
        self.led_at: float | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("became leader"):
                self.leading, self.led_at = True, time.monotonic()
            elif line.startswith(("lost leadership", "stepped down")):
                self.leading = False
            if line.startswith(("became leader", "standing by")):
                self.ready.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


def _local_ports(pid: int) -> set[int]:
    """The local TCP ports of the sockets of process ``pid`` (Linux ``/proc``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _cut_connections(alias: str, pid: int) -> int:
    """End the database sessions of process ``pid`` (as if its connections were lost)."""
    from django.db import connections

    ports = sorted(_local_ports(pid))
    connection = connections[alias]
    with connection.cursor() as cur:
        if connection.vendor == "postgresql":
            cur.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE client_port = ANY(%s)",
                [ports],
            )
            return int(cur.fetchone()[0])
        cur.execute("SELECT ID, HOST FROM information_schema.PROCESSLIST")
        ended = 0
        for session, host in cur.fetchall():
            if host and host.rpartition(":")[2].isdigit() and int(host.rpartition(":")[2]) in ports:
                cur.execute(f"KILL CONNECTION {int(session)}")
                ended += 1
        return ended


def _ensure_database(alias: str) -> None:
    from django.core.management import call_command
    from django.db import connections

    connection = connections[alias]
    if connection.vendor != "sqlite":
        name = connection.settings_dict["NAME"]
        with connection._nodb_cursor() as cur:
            if connection.vendor == "postgresql":
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{name}"')
            else:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
    call_command("migrate", database=alias, verbosity=0)


def _one_leader(workers: list[_TableWorker], timeout: float = 60) -> _TableWorker:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        leading = [w for w in workers if w.leading and w.proc.poll() is None]
        if len(leading) == 1 and all(w.ready.is_set() for w in workers):
            return leading[0]
        time.sleep(0.01)
    raise RuntimeError("no single leader")


def measure_event(alias: str, strategy: str, event: str, rounds: int) -> list[float | None]:
    """Seconds from ``event`` on the leader to another worker leading, per round."""
    import tempfile

    flag = os.path.join(tempfile.mkdtemp(prefix="dlock-failover-"), "gil")
    election = f"table-{alias}-{strategy}-{event}-{os.getpid()}"
    isolate = event == "gil-isolated"
    start = [_TableWorker(alias, strategy, election, flag, isolate) for _ in range(3)]
    workers = start
    samples: list[float | None] = []
    bound = 3 * FAST["lease"]
    try:
        for _ in range(rounds):
            leader = _one_leader(workers)
            others = [w for w in workers if w is not leader]
            time.sleep(FAST["retry"] * random.random())  # any point of the renewal cycle
            for worker in others:
                worker.led_at = None
            sent = time.monotonic()
            if event in ("SIGKILL", "SIGTERM", "SIGSTOP"):
                leader.proc.send_signal(getattr(signal, event))
            elif event == "connection":
                _cut_connections(alias, leader.proc.pid)
            else:
                with open(flag, "w"):
                    pass
            while time.monotonic() < sent + bound and not any(w.led_at for w in others):
                time.sleep(0.002)
            new = next((w for w in others if w.led_at), None)
            samples.append(None if new is None else new.led_at - sent)  # type: ignore[operator]
            if event in ("SIGKILL", "SIGTERM"):
                leader.stop()
                workers = [*others, _TableWorker(alias, strategy, election, flag, isolate)]
            elif event == "SIGSTOP":
                leader.proc.send_signal(signal.SIGCONT)
            elif event.startswith("gil"):
                time.sleep(2 * FAST["lease"])  # let the held GIL go
            time.sleep(FAST["lease"])
    finally:
        for worker in workers:
            worker.stop()
    return samples


def _cell(samples: list[float | None]) -> str:
    took = sorted(s for s in samples if s is not None)
    if not took:
        return "keeps leading"
    text = f"{statistics.median(took):.3f} s ({took[0]:.3f}-{took[-1]:.3f})"
    if len(took) < len(samples):
        text += f", keeps leading {len(samples) - len(took)} of {len(samples)}"
    return text


def table(aliases: list[str], rounds: int) -> str:
    from django.db import connections

    events = ["SIGKILL", "SIGTERM", "SIGSTOP", "connection", "gil", "gil-isolated"]
    lines = [
        "| database | strategy | " + " | ".join(events) + " |",
        "| --- | --- | " + " | ".join("---" for _ in events) + " |",
    ]
    for alias in aliases:
        _ensure_database(alias)
        vendor = connections[alias].vendor
        for strategy in ("lease", "advisory") if vendor == "postgresql" else ("lease",):
            cells = []
            for event in events:
                if event == "connection" and vendor == "sqlite":
                    cells.append("n/a")
                    continue
                print(f"{alias} {strategy} {event} ...", file=sys.stderr, flush=True)
                cells.append(_cell(measure_event(alias, strategy, event, rounds)))
                print(f"  {cells[-1]}", file=sys.stderr, flush=True)
            lines.append(f"| {vendor} | `{strategy}` | " + " | ".join(cells) + " |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


# -- the database itself fails over ------------------------------------------------------------
#
#     python -m tests.benchmarks.failover --primary-killed
#
# A private primary and its streaming standby (tests/pgcluster.py), Django connected
# through a TCP switch (the virtual IP). The primary is SIGKILLed, the standby promoted at
# once (``pg_ctl promote``) and the switch moved to it, while one client tries to acquire
# a free lease in a loop: the seconds from the kill to its first acquisition on the new
# primary. An HA manager (Patroni, a provider) adds its own detection time before it
# promotes; this is the rest: promotion, reconnection and the first lease statement.


@dataclass
class PrimaryKilled:
    promote_s: float
    acquired_s: float


def measure_primary_killed() -> PrimaryKilled:
    from django.core.management import call_command
    from django.db import connections

    import django_dlock as dlock
    from tests.pgcluster import PrivateCluster, Switch

    alias = f"failover_bench_{os.getpid()}"
    primary = PrivateCluster(fsync="off").create()
    standby: PrivateCluster | None = None
    switch: Switch | None = None
    try:
        standby = primary.standby()
        switch = Switch(primary.port)
        primary.create_database("dlock_bench")
        connections.settings[alias] = primary.database_settings(
            connections.settings["default"], "dlock_bench", switch.port
        )
        call_command("migrate", database=alias, verbosity=0)
        primary.caught_up(standby)
        acquired = threading.Event()
        acquired_at: list[float] = []

        def client() -> None:
            while True:
                try:
                    lk = dlock.lock("bench-primary-killed", using=alias, ttl=30)
                    if lk.acquire(timeout=0):
                        acquired_at.append(time.monotonic())
                        lk.release()
                        acquired.set()
                        return
                except Exception:
                    connections[alias].close()
                time.sleep(0.002)

        killed = time.monotonic()
        primary.kill()
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        standby.promote()
        promoted = time.monotonic()
        switch.point_to(standby.port)
        if not acquired.wait(120):
            raise RuntimeError("no lease acquired on the new primary")
        return PrimaryKilled(promoted - killed, acquired_at[0] - killed)
    finally:
        connections[alias].close()
        del connections[alias]
        del connections.settings[alias]
        if switch is not None:
            switch.close()
        for cluster in (primary, standby):
            if cluster is not None:
                cluster.destroy()


def primary_killed_table(rounds: int) -> str:
    samples = [measure_primary_killed() for _ in range(rounds)]
    lines = [
        "| primary SIGKILLed, standby promoted at once | median s | samples s |",
        "| --- | ---: | --- |",
    ]
    for label, values in (
        ("until the standby is promoted (`pg_ctl promote -w`)", [s.promote_s for s in samples]),
        ("until a lease is acquired on the new primary", [s.acquired_s for s in samples]),
    ):
        text = ", ".join(f"{v:.3f}" for v in values)
        lines.append(f"| {label} | {statistics.median(values):.3f} | {text} |")
    return "\n".join(lines)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.failover")
    parser.add_argument("--using", action="append", help="database aliases (default: all)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--primary-killed",
        action="store_true",
        help="kill a private PostgreSQL primary and promote its standby instead",
    )
    args = parser.parse_args()
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    os.environ["DLOCK_TEST_CHILD"] = "1"
    import django

    django.setup()
    if args.primary_killed:
        print(primary_killed_table(args.rounds))
        return
    print(table(args.using or ["default", "mysql", "sqlite"], args.rounds))


if __name__ == "__main__":
    main()
