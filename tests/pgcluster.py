"""A private PostgreSQL cluster that a test may stop and restart.

Fault tests that restart PostgreSQL must never touch the shared service:
this creates a throw-away cluster with ``initdb`` in a temporary directory,
on a free port of 127.0.0.1, owned by the ``postgres`` system user when the
tests run as root (PostgreSQL refuses to run as root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb is None:
        raise RuntimeError("initdb not found: install the PostgreSQL server package")
    return Path(initdb).parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    def __init__(self, **settings: str) -> None:
        #: extra server settings (``-c name=value``), e.g. wal_writer_delay
        self.settings = settings
        self.bindir = _bindir()
        self.port = _free_port()
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
        with contextlib.suppress(subprocess.CalledProcessError):
            self._pg_ctl("stop")
        shutil.rmtree(self.root, ignore_errors=True)

    @contextlib.contextmanager
    def attached(self, alias: str, name: str = "dlock_private") -> Iterator[None]:
        """A migrated database on this cluster, as the Django alias ``alias``."""
        from django.core.management import call_command
        from django.db import connections

        from django_dlock import notify

        self.create_database(name)
        connections.settings[alias] = self.database_settings(connections.settings["default"], name)
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

    def database_settings(self, template: dict, name: str) -> dict:
        settings = dict(template)
        settings.update(HOST="127.0.0.1", PORT=str(self.port), USER="postgres", NAME=name)
        settings["TEST"] = {**template.get("TEST", {}), "NAME": name}
        return settings

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
