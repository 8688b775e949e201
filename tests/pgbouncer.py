"""A private PgBouncer for the tests, in front of the test PostgreSQL server.

Debian's ``pgbouncer`` package (``/usr/sbin/pgbouncer``) runs on a free
local port with its own configuration in a temporary directory. A missing
binary fails the test (never a skip): the pooling tests are the proof that
what the docs claim for PgBouncer holds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .pgcluster import free_port

BINARY = os.environ.get("DLOCK_TEST_PGBOUNCER", "/usr/sbin/pgbouncer")


class PgBouncer:
    """One PgBouncer process: ``pool_mode`` ``transaction`` or ``session``."""

    def __init__(self, pool_mode: str = "transaction", pool_size: int = 4, **extra: Any) -> None:
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.extra = extra
        self.port = 0
        self.directory: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, server_host: str, server_port: int) -> PgBouncer:
        binary = shutil.which(BINARY) or (BINARY if os.access(BINARY, os.X_OK) else None)
        if binary is None:
            raise RuntimeError(
                f"PgBouncer is not installed ({BINARY}): install Debian's pgbouncer package"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="dlock-pgbouncer-"))
        self.port = free_port()
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": self.directory / "userlist.txt",
            "pool_mode": self.pool_mode,
            "default_pool_size": self.pool_size,
            "max_client_conn": 200,
            "ignore_startup_parameters": "extra_float_digits,options",
            "query_wait_timeout": 30,
            "logfile": self.directory / "pgbouncer.log",
            "pidfile": self.directory / "pgbouncer.pid",
            **self.extra,
        }
        lines = [f"* = host={server_host} port={server_port}", "", "[pgbouncer]"]
        lines += [f"{name} = {value}" for name, value in settings.items()]
        (self.directory / "pgbouncer.ini").write_text("[databases]\n" + "\n".join(lines) + "\n")
        (self.directory / "userlist.txt").write_text('"postgres" ""\n')
        os.chmod(self.directory, 0o755)
        command = [binary, str(self.directory / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            command[1:1] = ["-u", "postgres"]
            shutil.chown(self.directory, "postgres")
        # Output to a file, never a pipe nobody reads: PgBouncer would block
        # writing its log once the pipe is full.
        with open(self.directory / "stderr.log", "wb") as stderr:
            self.process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
            )
        deadline = time.monotonic() + 30
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                return self
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = self.log()
                self.stop()
                raise RuntimeError(f"PgBouncer did not start: {log}")
            time.sleep(0.05)

    def log(self) -> str:
        path = self.directory / "pgbouncer.log" if self.directory else None
        text = path.read_text() if path and path.exists() else ""
        stderr = self.directory / "stderr.log" if self.directory else None
        if stderr is not None and stderr.exists():
            text += stderr.read_text(errors="replace")
        return text[-4000:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def attached(
    alias: str, pool_mode: str = "transaction", pool_size: int = 4, **database: Any
) -> Iterator[PgBouncer]:
    """A PgBouncer in front of the ``default`` test database, as the Django alias ``alias``.

    ``database`` overrides entries of the alias's settings (``OPTIONS``,
    ``DISABLE_SERVER_SIDE_CURSORS``...).
    """
    from django.db import connections

    from django_dlock import notify

    template = connections.settings["default"]
    bouncer = PgBouncer(pool_mode, pool_size).start(template["HOST"], int(template["PORT"]))
    settings = dict(template)
    settings.update(PORT=str(bouncer.port), TEST={**template.get("TEST", {}), "MIRROR": None})
    settings.update(database)
    connections.settings[alias] = settings
    try:
        yield bouncer
    finally:
        listener = notify._listeners.pop(alias, None)
        if listener is not None:
            listener.stop()
        with contextlib.suppress(Exception):
            connections[alias].close()
        del connections[alias]
        del connections.settings[alias]
        bouncer.stop()
