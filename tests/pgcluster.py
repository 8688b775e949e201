"""Private PostgreSQL clusters that a test may stop, crash, replicate and promote.

Fault tests that restart PostgreSQL must never touch the shared service:
this creates a throw-away cluster with ``initdb`` in a temporary directory,
on a free port of 127.0.0.1, owned by the ``postgres`` system user when the
tests run as root (PostgreSQL refuses to run as root).

Fail-over tests build a primary and a streaming standby with PostgreSQL's
own tools (:meth:`PrivateCluster.standby`: a replication slot and
``pg_basebackup -R``), kill the primary (:meth:`PrivateCluster.kill`),
promote the standby (:meth:`PrivateCluster.promote`) and move a
:class:`Switch` (a TCP forwarder in front of both, what a virtual IP or a
DNS name is to the clients) to the new primary.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


def available() -> str | None:
    """Why private clusters cannot run here (``None``: they can)."""
    try:
        found = bindir()
    except RuntimeError as exc:
        return str(exc)
    for tool in ("initdb", "pg_ctl", "pg_basebackup"):
        if not (found / tool).exists():
            return f"{tool} not found in {found}: install the PostgreSQL server package"
    return None


def bindir() -> Path:
    """PostgreSQL's server binaries (initdb, pg_ctl, pg_dump, pgbench, ...)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise RuntimeError("initdb not found: install the PostgreSQL server package")
    return Path(initdb).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    def __init__(self, **settings: str) -> None:
        #: extra server settings (``-c name=value``), e.g. wal_writer_delay
        self.settings = settings
        self.bindir = bindir()
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="dlock-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "log"
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)

    def create(self) -> PrivateCluster:
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        return self

    def _pg_ctl(self, action: str) -> None:
        opts = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root}"
        opts += "".join(f" -c {name}={value}" for name, value in self.settings.items())
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-m",
            "fast",
            "-o",
            opts,
            action,
        )

    def start(self) -> None:
        self._pg_ctl("start")

    def restart(self) -> None:
        self._pg_ctl("restart")

    def crash_and_restart(self) -> None:
        """Stop like a crash (``-m immediate``: no checkpoint, no WAL flush), then start."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")
        self.start()

    def destroy(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    # -- queries ---------------------------------------------------------------

    def sql(self, query: str, *params: Any, dbname: str = "postgres") -> list[tuple[Any, ...]]:
        """Run one statement on this cluster (autocommit); its rows (if any)."""
        import psycopg

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            user="postgres",
            dbname=dbname,
            autocommit=True,
            connect_timeout=10,
        ) as conn:
            cur = conn.execute(query, params or None)
            return list(cur.fetchall()) if cur.description else []

    def wait_for(self, query: str, *params: Any, timeout: float = 60.0) -> None:
        """Poll until ``query`` returns a true first column."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.sql(query, *params)
            if rows and rows[0][0]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for: {query}")
            time.sleep(0.05)

    # -- replication and fail-over ----------------------------------------------

    def standby(self, slot: str = "standby1") -> PrivateCluster:
        """A streaming standby of this cluster, started and streaming.

        A physical replication slot keeps the WAL the standby still needs;
        ``pg_basebackup -R`` copies the data directory and writes
        ``standby.signal`` and ``primary_conninfo``. Replication is
        asynchronous until :meth:`make_synchronous`.
        """
        self.sql("SELECT pg_create_physical_replication_slot(%s)", slot)
        standby = PrivateCluster(**self.settings)
        if standby._as_postgres:
            shutil.chown(standby.root, "postgres", "postgres")
        standby._run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-D",
            str(standby.data),
            "-R",
            "-S",
            slot,
            "-X",
            "stream",
            "--checkpoint=fast",  # not spread over minutes: the tests wait for it
            "--no-sync",
        )
        standby.start()
        self.wait_for("SELECT count(*) > 0 FROM pg_stat_replication WHERE state = 'streaming'")
        return standby

    def make_synchronous(self) -> None:
        """Every commit waits until a standby has flushed it (``synchronous_commit = on``)."""
        self.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
        self.sql("ALTER SYSTEM SET synchronous_commit = 'on'")
        self.sql("SELECT pg_reload_conf()")
        self.wait_for("SELECT count(*) > 0 FROM pg_stat_replication WHERE sync_state = 'sync'")

    def caught_up(self, standby: PrivateCluster, timeout: float = 60.0) -> None:
        """Wait until ``standby`` has replayed everything this primary has written."""
        (lsn,) = self.sql("SELECT pg_current_wal_lsn()::text")[0]
        standby.wait_for("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", lsn, timeout=timeout)

    def cut_off(self) -> None:
        """On a standby: stop receiving WAL (its primary's later commits never arrive)."""
        self.sql("ALTER SYSTEM SET primary_conninfo = ''")
        self.sql("SELECT pg_reload_conf()")
        self.wait_for("SELECT count(*) = 0 FROM pg_stat_wal_receiver")

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once, like a machine that dies.

        Nothing is flushed or sent to the standby any more; the clients'
        connections drop.
        """
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        # Every child of the postmaster is a session of its own (setsid), so
        # no group signal reaches them all: freeze the postmaster (no new
        # children), kill its children, then the postmaster.
        os.kill(pid, signal.SIGSTOP)
        for child in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _accepts(self.port):
            if time.monotonic() > deadline:
                raise TimeoutError("the killed primary still accepts connections")
            time.sleep(0.05)

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: a server that stops answering
        (a frozen VM, a stalled disk). Connections stay open; nothing comes back."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        for child in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)

    def thaw(self) -> None:
        """Undo :meth:`freeze`: the server answers again."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        for child in _children(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGCONT)
        os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        """A clean, fast shutdown: a standby connected to it gets all of its WAL first."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "fast", "stop")

    def promote(self) -> None:
        """On a standby: become a primary (a new timeline), and wait until it accepts writes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "promote")
        self.wait_for("SELECT NOT pg_is_in_recovery()")

    def timeline(self) -> int:
        """The timeline this primary writes WAL on (1 + the promotions in its history)."""
        (name,) = self.sql("SELECT pg_walfile_name(pg_current_wal_lsn())")[0]
        return int(name[:8], 16)

    @contextlib.contextmanager
    def attached(
        self, alias: str, name: str = "dlock_private", port: int | None = None
    ) -> Iterator[None]:
        """A migrated database on this cluster, as the Django alias ``alias``.

        ``port``: where Django connects instead of the cluster's own port
        (a :class:`Switch` in front of it).
        """
        from django.core.management import call_command
        from django.db import connections

        from django_dlock import notify

        self.create_database(name)
        connections.settings[alias] = self.database_settings(
            connections.settings["default"], name, port
        )
        try:
            call_command("migrate", database=alias, verbosity=0)
            yield
        finally:
            listener = notify._listeners.pop(alias, None)
            if listener is not None:
                listener.stop()
            connections[alias].close()
            del connections[alias]
            del connections.settings[alias]

    def database_settings(
        self, template: dict[str, Any], name: str, port: int | None = None
    ) -> dict[str, Any]:
        settings = dict(template)
        settings.update(HOST="127.0.0.1", PORT=str(port or self.port), USER="postgres", NAME=name)
        settings["TEST"] = {**template.get("TEST", {}), "NAME": name}
        return settings

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after ")"
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Switch:
    """A TCP forwarder on a free port of 127.0.0.1: the address clients use.

    What a virtual IP or a DNS name is to an operator: the clients keep one
    address, and :meth:`point_to` moves it to another server (the promoted
    standby). Connections that were open are cut, as they are when the old
    server dies.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._open: set[socket.socket] = set()
        self._mutex = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="pg-switch", daemon=True).start()

    def point_to(self, target: int) -> None:
        with self._mutex:
            self.target = target
            dropped = list(self._open)
            self._open.clear()
        for sock in dropped:
            _drop(sock)

    def close(self) -> None:
        self._closed = True
        self.point_to(0)
        _drop(self._listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                _drop(client)
                continue
            server.settimeout(None)
            with self._mutex:
                self._open.update((client, server))
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._mutex:
                self._open.discard(src)
                self._open.discard(dst)
            _drop(src)
            _drop(dst)


def _drop(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


def attached_cluster(alias: str) -> Callable[..., Any]:
    """A module-scoped fixture: a private cluster (fsync off) with a migrated
    database as the Django alias ``alias``, destroyed after the module.

    Module scope: the alias must exist before the test case starts (Django 6
    refuses connections to an alias that appears during a test). Use as
    ``cluster = attached_cluster("name")`` at a test module's top level.
    """

    @pytest.fixture(scope="module")
    def cluster(django_db_blocker: Any) -> Iterator[PrivateCluster]:
        made = PrivateCluster(fsync="off").create()
        try:
            with django_db_blocker.unblock(), made.attached(alias):
                yield made
        finally:
            made.destroy()

    return cluster
