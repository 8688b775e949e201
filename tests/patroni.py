"""A private Patroni cluster for the tests: etcd and three PostgreSQL members.

What sites run for high availability: PostgreSQL under Patroni, with etcd as
its consensus store, and clients that connect with a libpq multi-host string
(``host=a,b,c target_session_attrs=read-write``). :class:`PatroniCluster`
starts one of its own, never touching the shared PostgreSQL service:

* one etcd (Debian's ``etcd-server``, v3 API) and three Patroni members
  (Debian's ``patroni``, the newest PostgreSQL server binaries), all on free
  ports of 127.0.0.1 (the etcd client and peer ports, each member's
  PostgreSQL and REST API ports), their data in a temporary directory;
* run as the ``postgres`` system user when the tests run as root
  (PostgreSQL refuses to run as root), each in a session of its own;
* tuned to fail over fast: ``ttl`` 10 s, ``loop_wait`` 1 s, ``retry_timeout``
  4 s, ``use_pg_rewind``, replication slots, asynchronous replication with a
  ``maximum_lag_on_failover`` large enough that a standby that missed the
  last WAL may still be promoted.

Faults: :meth:`crash_node` (the machine dies: SIGKILL of Patroni and of every
PostgreSQL process), :meth:`kill_postmaster` (PostgreSQL crashes, Patroni
lives and restarts it), :meth:`stop_patroni` (a clean stop of Patroni, which
stops PostgreSQL and hands the leader key over), :meth:`freeze` /
:meth:`thaw` (SIGSTOP of the primary), :meth:`switchover` and
:meth:`failover` (Patroni's REST API, what ``patronictl`` calls), and
:meth:`async_failover_losing_wal`: the standbys stop receiving WAL, the
primary writes on, dies, and a standby that missed those writes is promoted.
:meth:`destroy` kills everything it started, also after a failed test.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .pgcluster import _children, bindir, free_port

ETCD = os.environ.get("DLOCK_TEST_ETCD", "/usr/bin/etcd")
PATRONI = os.environ.get("DLOCK_TEST_PATRONI", "/usr/bin/patroni")

#: Patroni's timings (seconds): the leader key lives ``TTL`` after its last
#: renewal; members run their loop every ``LOOP_WAIT``; a DCS or PostgreSQL
#: call is retried for ``RETRY_TIMEOUT`` (Patroni wants
#: loop_wait + 2 * retry_timeout <= ttl)
TTL, LOOP_WAIT, RETRY_TIMEOUT = 10, 1, 4


def available() -> str | None:
    """Why a Patroni cluster cannot run here (``None``: it can)."""
    for binary, package in ((ETCD, "etcd-server"), (PATRONI, "patroni")):
        if not os.access(binary, os.X_OK):
            return f"{binary} not found: install Debian's {package} package"
    try:
        found = bindir()
    except RuntimeError as exc:
        return str(exc)
    for tool in ("initdb", "pg_ctl", "pg_basebackup", "pg_rewind"):
        if not (found / tool).exists():
            return f"{tool} not found in {found}: install the PostgreSQL server package"
    return None


@dataclass
class Member:
    """One Patroni member: its PostgreSQL and REST API ports, its files."""

    name: str
    port: int
    rest_port: int
    root: Path
    process: subprocess.Popen[bytes] | None = None
    #: PostgreSQL processes frozen by :meth:`PatroniCluster.freeze`
    frozen: list[int] = field(default_factory=list)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def config(self) -> Path:
        return self.root / "patroni.yml"

    @property
    def log(self) -> Path:
        return self.root / "patroni.log"

    def postmaster(self) -> int | None:
        """The PID of this member's running postmaster (``None``: not running)."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return pid


class PatroniCluster:
    """etcd and ``size`` Patroni members on private ports (see the module docstring)."""

    def __init__(self, size: int = 3, scope: str = "dlock") -> None:
        self.scope = scope
        self.bindir = bindir()
        self.root = Path(tempfile.mkdtemp(prefix="dlock-patroni-"))
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self.etcd_port, self.etcd_peer_port = free_port(), free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.members = [
            Member(f"pg{n}", free_port(), free_port(), self.root / f"pg{n}")
            for n in range(1, size + 1)
        ]
        #: seconds from start() to a leader and every standby streaming
        self.start_seconds = 0.0

    # -- start and stop ---------------------------------------------------------

    def start(self, timeout: float = 120.0) -> PatroniCluster:
        began = time.monotonic()
        try:
            self._start_etcd(timeout)
            for member in self.members:
                self._write_config(member)
                self.start_patroni(member)
            self.wait_healthy(timeout)
        except BaseException:
            self.destroy()
            raise
        self.start_seconds = time.monotonic() - began
        return self

    def _start_etcd(self, timeout: float) -> None:
        data = self.root / "etcd"
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        command = [
            ETCD,
            "--name=dlock",
            f"--data-dir={data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=dlock={peer}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token=dlock-{os.getpid()}",
            "--log-level=warn",
        ]
        with open(self.root / "etcd.log", "wb") as log:
            self.etcd = subprocess.Popen(
                command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while True:
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(f"{client}/health", timeout=2) as answer,
            ):
                if json.loads(answer.read()).get("health") == "true":
                    return
            if self.etcd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {self._tail(self.root / 'etcd.log')}")
            time.sleep(0.05)

    def _write_config(self, member: Member) -> None:
        member.root.mkdir()
        address = f"127.0.0.1:{member.port}"
        config: dict[str, Any] = {
            "scope": self.scope,
            "name": member.name,
            "log": {"level": "INFO"},
            "restapi": {
                "listen": f"127.0.0.1:{member.rest_port}",
                "connect_address": f"127.0.0.1:{member.rest_port}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL,
                    "loop_wait": LOOP_WAIT,
                    "retry_timeout": RETRY_TIMEOUT,
                    # a standby that missed the last WAL may still be promoted
                    "maximum_lag_on_failover": 1 << 30,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "128MB",
                            # fsync off: the tests crash processes, never the machine
                            # (full_page_writes stays on: pg_rewind needs it)
                            "fsync": "off",
                            "max_connections": 100,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": address,
                "connect_address": address,
                "data_dir": str(member.data),
                "bin_dir": str(self.bindir),
                "pgpass": str(member.root / "pgpass"),
                # a member that cannot be rewound (e.g. its timeline ID was
                # used by another member too) is copied afresh from the leader
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
                "authentication": {
                    "superuser": {"username": "postgres"},
                    "replication": {"username": "postgres"},
                    "rewind": {"username": "postgres"},
                },
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "parameters": {"unix_socket_directories": str(member.root)},
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False},
        }
        # JSON is YAML: no YAML writer needed
        member.config.write_text(json.dumps(config, indent=1))
        if self._as_postgres:
            shutil.chown(member.root, "postgres", "postgres")
            shutil.chown(member.config, "postgres", "postgres")

    def start_patroni(self, member: Member) -> None:
        """Start (or start again) Patroni on ``member``; it starts PostgreSQL."""
        kwargs: dict[str, Any] = {}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "PATRONI"))}
        if self._as_postgres:
            kwargs.update(user="postgres", group="postgres", extra_groups=[])
            env.update(HOME=str(member.root), USER="postgres", LOGNAME="postgres")
        with open(member.log, "ab") as log:
            member.process = subprocess.Popen(
                [PATRONI, str(member.config)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=member.root,
                env=env,
                **kwargs,
            )

    def destroy(self) -> None:
        """Kill every process this cluster started, remove its files."""
        for member in self.members:
            for pid in member.frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            self._kill_patroni(member)
            self._kill_postgres(member)
        if self.etcd is not None and self.etcd.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.etcd.pid, signal.SIGKILL)
            self.etcd.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    def _kill_patroni(self, member: Member) -> None:
        process = member.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        member.process = None

    def _kill_postgres(self, member: Member) -> None:
        """SIGKILL the postmaster and every one of its children at once.

        Each child of the postmaster runs in the postmaster's session, not
        Patroni's: freeze the postmaster (no new children), kill its
        children, then the postmaster.
        """
        pid = member.postmaster()
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        for child in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)

    # -- state --------------------------------------------------------------------

    def _rest(
        self, member: Member, path: str, body: dict[str, Any] | None = None, timeout: float = 5
    ) -> tuple[int, str]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{member.rest_port}{path}",
            data=json.dumps(body).encode() if body is not None else None,
            method="POST" if body is not None else "GET",
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def state(self) -> list[dict[str, Any]]:
        """The members as Patroni's REST API lists them (``GET /cluster``)."""
        for member in self.members:
            if member.process is None or member.process.poll() is not None:
                continue
            with contextlib.suppress(OSError, ValueError):
                status, text = self._rest(member, "/cluster", timeout=2)
                if status == 200:
                    return list(json.loads(text)["members"])
        return []

    def member(self, name: str) -> Member:
        return next(m for m in self.members if m.name == name)

    def leader(self) -> Member | None:
        """The member that holds the leader key and runs as primary (``None``: no leader)."""
        for found in self.state():
            if found["role"] == "leader" and found["state"] == "running":
                return self.member(found["name"])
        return None

    def timeline(self) -> int | None:
        """The timeline the leader writes WAL on (``None``: no leader answers)."""
        leader = self.leader()
        if leader is None:
            return None
        try:
            (name,) = self.sql(leader, "SELECT pg_walfile_name(pg_current_wal_lsn())", timeout=2)[0]
        except Exception:
            return None
        return int(name[:8], 16)

    def wait_for(self, what: str, test: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            found = test()
            if found:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"Patroni cluster: timed out waiting for {what}: {self.state()}")
            time.sleep(0.1)

    def wait_leader(self, timeout: float = 60.0, other_than: Member | None = None) -> Member:
        def found() -> Member | None:
            leader = self.leader()
            if leader is None or leader is other_than:
                return None
            return leader if self._writable(leader) else None

        return self.wait_for("a leader that accepts writes", found, timeout)  # type: ignore[no-any-return]

    def wait_healthy(self, timeout: float = 120.0, standbys: int | None = None) -> Member:
        """Wait for a leader and ``standbys`` members streaming from it (``None``:
        every member whose Patroni runs)."""
        self.wait_leader(timeout)
        found: list[Member] = []

        def streaming() -> bool:
            # (Patroni 3.0 calls a streaming standby "running": ask the primary too)
            current = self.leader()
            if current is None:
                return False
            running = {m.name for m in self.members if m.process is not None} - {current.name}
            try:
                rows = self.sql(
                    current,
                    "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'",
                    timeout=2,
                )
            except Exception:
                return False
            ready = {s["name"] for s in self.state() if s["state"] == "running"}
            streamed = running & {str(name) for (name,) in rows} & ready
            found[:] = [current]
            if standbys is None:
                return running <= streamed
            return len(streamed) >= standbys

        self.wait_for("standbys streaming", streaming, timeout)
        return found[0]

    def reinitialize_stragglers(self) -> list[str]:
        """Re-initialize (``patronictl reinit``: a fresh copy of the leader) every
        member whose Patroni runs but whose PostgreSQL does not stream from the
        leader, e.g. one that cannot follow a timeline whose ID it used itself."""
        leader = self.leader()
        if leader is None:
            return []
        try:
            rows = self.sql(
                leader,
                "SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'",
                timeout=2,
            )
        except Exception:
            return []
        streaming = {str(name) for (name,) in rows}
        done = []
        for member in self.members:
            if member is leader or member.process is None or member.name in streaming:
                continue
            with contextlib.suppress(OSError):
                self._rest(member, "/reinitialize", {"force": True}, timeout=10)
                done.append(member.name)
        return done

    def _writable(self, member: Member) -> bool:
        try:
            rows = self.sql(member, "SELECT NOT pg_is_in_recovery()", timeout=2)
        except Exception:
            return False
        return bool(rows and rows[0][0])

    def sql(
        self, member: Member, query: str, *params: Any, dbname: str = "postgres", timeout: int = 5
    ) -> list[tuple[Any, ...]]:
        """One statement on ``member`` (autocommit); its rows (if any)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=member.port,
            user="postgres",
            dbname=dbname,
            autocommit=True,
            connect_timeout=timeout,
        ) as conn:
            cur = conn.execute(query, params or None)
            return list(cur.fetchall()) if cur.description else []

    # -- what the clients use -----------------------------------------------------

    @property
    def hosts(self) -> str:
        return ",".join("127.0.0.1" for _ in self.members)

    @property
    def ports(self) -> str:
        return ",".join(str(m.port) for m in self.members)

    def dsn(self, dbname: str = "postgres", connect_timeout: int = 2) -> str:
        """The libpq multi-host string: every member, the one that accepts writes."""
        return (
            f"host={self.hosts} port={self.ports} user=postgres dbname={dbname} "
            f"target_session_attrs=read-write connect_timeout={connect_timeout}"
        )

    def database_settings(
        self, template: dict[str, Any], name: str, connect_timeout: int = 2
    ) -> dict[str, Any]:
        """Django settings of a database on this cluster, through the multi-host string."""
        settings = dict(template)
        settings.update(HOST=self.hosts, PORT=self.ports, USER="postgres", NAME=name)
        settings["OPTIONS"] = {
            **template.get("OPTIONS", {}),
            "target_session_attrs": "read-write",
            "connect_timeout": connect_timeout,
        }
        settings["TEST"] = {**template.get("TEST", {}), "NAME": name, "MIRROR": None}
        return settings

    @contextlib.contextmanager
    def attached(self, alias: str, name: str) -> Iterator[dict[str, Any]]:
        """A migrated database on this cluster as the Django alias ``alias``; its settings."""
        from django.core.management import call_command
        from django.db import connections

        from django_dlock import notify

        leader = self.wait_leader()
        self.sql(leader, f'CREATE DATABASE "{name}"')
        settings = self.database_settings(connections.settings["default"], name)
        connections.settings[alias] = settings
        try:
            call_command("migrate", database=alias, verbosity=0)
            connections[alias].close()
            yield settings
        finally:
            listener = notify._listeners.pop(alias, None)
            if listener is not None:
                listener.stop()
            with contextlib.suppress(Exception):
                connections[alias].close()
            del connections[alias]
            del connections.settings[alias]

    # -- faults -------------------------------------------------------------------

    def crash_node(self, member: Member) -> None:
        """The machine dies: SIGKILL of its Patroni and of every PostgreSQL process.

        Its leader key (if any) stays in etcd until it runs out (``TTL``);
        then a standby is promoted. :meth:`start_patroni` brings the member
        back (it rejoins as a standby, rewound if it must).
        """
        self._kill_patroni(member)
        self._kill_postgres(member)

    def kill_postmaster(self, member: Member) -> None:
        """PostgreSQL crashes (SIGKILL of the postmaster alone); Patroni lives.

        The backends end when they see their postmaster gone; Patroni
        starts PostgreSQL again on the same member (it keeps the leader key).
        """
        pid = member.postmaster()
        assert pid is not None, f"{member.name}: PostgreSQL is not running"
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)

    def stop_patroni(self, member: Member, timeout: float = 60.0) -> None:
        """A clean stop of Patroni (SIGTERM): it stops PostgreSQL (fast mode) and
        gives up the leader key, and a standby is promoted at once."""
        process = member.process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        process.wait(timeout)
        member.process = None

    def freeze(self, member: Member) -> None:
        """SIGSTOP the postmaster and every backend: a primary that stops answering.

        Patroni itself runs on: its queries hang, its leader key runs out,
        a standby is promoted. :meth:`thaw` lets it run again (Patroni
        demotes it)."""
        pid = member.postmaster()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        member.frozen = [pid]
        for child in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)
                member.frozen.append(child)

    def thaw(self, member: Member) -> None:
        for pid in reversed(member.frozen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        member.frozen = []

    def switchover(self, leader: Member, candidate: Member, timeout: float = 60.0) -> None:
        """A planned switchover (``patronictl switchover --leader --candidate --force``):
        returns once ``candidate`` is the primary and accepts writes."""
        status, text = self._rest(
            leader,
            "/switchover",
            {"leader": leader.name, "candidate": candidate.name},
            timeout=timeout,
        )
        if status != 200:
            raise RuntimeError(f"switchover {leader.name} -> {candidate.name}: {status} {text}")
        self.wait_for(
            f"{candidate.name} to lead",
            lambda: self.leader() is candidate and self._writable(candidate),
            timeout,
        )

    def failover(self, candidate: Member, timeout: float = 60.0) -> None:
        """A manual fail-over to ``candidate`` (``patronictl failover --candidate``),
        also when there is no leader."""
        status, text = self._rest(
            candidate, "/failover", {"candidate": candidate.name}, timeout=timeout
        )
        if status != 200:
            raise RuntimeError(f"failover to {candidate.name}: {status} {text}")
        self.wait_for(
            f"{candidate.name} to lead",
            lambda: self.leader() is candidate and self._writable(candidate),
            timeout,
        )

    @contextlib.contextmanager
    def wal_withheld(self, primary: Member) -> Iterator[None]:
        """Within the block no standby receives WAL from ``primary``: its
        ``pg_hba.conf`` refuses replication connections (a standby that
        connects late gets nothing either), and its WAL senders are SIGSTOPped.
        Replication is asynchronous: commits do not wait for them."""
        hba = primary.data / "pg_hba.conf"
        rules = hba.read_text()
        hba.write_text("host replication all 127.0.0.1/32 reject\n" + rules)
        self.sql(primary, "SELECT pg_reload_conf()")
        senders = [
            int(pid)
            for (pid,) in self.sql(
                primary, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'"
            )
        ]
        for pid in senders:
            os.kill(pid, signal.SIGSTOP)
        primary.frozen.extend(senders)
        try:
            yield
        finally:
            for pid in senders:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            primary.frozen = [p for p in primary.frozen if p not in senders]
            with contextlib.suppress(OSError):
                hba.write_text(rules)
            with contextlib.suppress(Exception):
                self.sql(primary, "SELECT pg_reload_conf()", timeout=2)

    def fork_lsn(self, primary: Member) -> int:
        """Where ``primary``'s timeline forked off its parent (its history file)."""
        (name,) = self.sql(primary, "SELECT pg_walfile_name(pg_current_wal_lsn())")[0]
        history = self.sql(primary, "SELECT pg_read_file(%s)", f"pg_wal/{name[:8]}.history")
        last = history[0][0].strip().splitlines()[-1].split()
        high, low = last[1].split("/")
        return (int(high, 16) << 32) + int(low, 16)

    def lsn(self, member: Member, received: bool = False) -> int:
        """``member``'s current WAL position (a standby: replayed, or ``received``)."""
        query = (
            "SELECT (CASE WHEN pg_is_in_recovery() THEN "
            + ("pg_last_wal_receive_lsn()" if received else "pg_last_wal_replay_lsn()")
            + " ELSE pg_current_wal_lsn() END - '0/0')::bigint"
        )
        return int(self.sql(member, query)[0][0] or 0)

    def logs(self) -> str:
        """The end of every member's Patroni log and of etcd's (for a failed test)."""
        parts = [f"--- etcd\n{self._tail(self.root / 'etcd.log')}"]
        for member in self.members:
            parts.append(f"--- {member.name}\n{self._tail(member.log)}")
        return "\n".join(parts)

    @staticmethod
    def _tail(path: Path, size: int = 3000) -> str:
        try:
            return path.read_text(errors="replace")[-size:]
        except OSError:
            return ""


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rpartition(")")[2].split()[0] == "Z":  # dead, not yet reaped
            return
        time.sleep(0.02)
    raise TimeoutError(f"process {pid} did not end")
