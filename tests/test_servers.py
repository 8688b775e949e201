"""``bash scripts/test``'s first line and its databases per run (tests/servers.py).

Two runs on the same servers once shared fixed database names (they
collided), and an interrupted run left its 20 databases behind.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

from tests import servers

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_first_line_names_each_server_and_whether_it_answers(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("DLOCK_TEST_MYSQL_PORT", str(port))
    line = servers.status_line()
    assert line.startswith("scripts/test: the tests need PostgreSQL on 127.0.0.1:5432 (answers), ")
    assert f"MariaDB on 127.0.0.1:{port} (NO ANSWER)" in line
    assert "RabbitMQ on 127.0.0.1:5672 (" in line


def test_scripts_test_says_it_first_and_gives_each_run_its_own_suffix():
    script = (ROOT / "scripts" / "test").read_text()
    commands = [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    body = commands[commands.index('cd "$(dirname "$0")/.."') + 1 :]
    assert body[0].startswith("python -m tests.servers ")  # before anything is installed
    assert body[1] == 'export DLOCK_TEST_DB_SUFFIX="${DLOCK_TEST_DB_SUFFIX-_r$(date +%s)_$$}"'
    cleanup = next(
        i for i, c in enumerate(body) if c.startswith("python -m tests.servers --cleanup")
    )
    install = next(i for i, c in enumerate(body) if c.startswith("python -m pip install"))
    pytest_at = next(i for i, c in enumerate(body) if c.startswith("exec python -m pytest"))
    assert install < cleanup < pytest_at  # (the clean-up needs the drivers)
    assert servers.RUN_SUFFIX.fullmatch("_r1765100000_4242")


def _pg_create(name: str) -> None:
    with servers._pg() as connection:
        connection.execute(f'DROP DATABASE IF EXISTS "{name}"')
        connection.execute(f'CREATE DATABASE "{name}"')


def _pg_names() -> set[str]:
    with servers._pg() as connection:
        return {row[0] for row in connection.execute("SELECT datname FROM pg_database")}


def _mysql_names() -> set[str]:
    connection = servers._mysql()
    try:
        with connection.cursor() as cur:
            cur.execute("SHOW DATABASES")
            return {row[0] for row in cur.fetchall()}
    finally:
        connection.close()


def test_cleanup_drops_the_databases_of_ended_runs_only(tmp_path):
    ended, running = "_r1_1111", "_r1_2222"
    for name in (f"test_dlock{ended}_gw0", f"test_dlock_q1{ended}_gw0", f"test_dlock{running}"):
        _pg_create(name)
    connection = servers._mysql()
    with connection.cursor() as cur:
        cur.execute(f"CREATE DATABASE IF NOT EXISTS `test_dlock{ended}_gw1`")
    connection.close()
    held = servers.hold_run_lock(running)  # a run still going: its pytest holds this
    try:
        dropped = servers.cleanup()
        assert {
            f"PostgreSQL test_dlock{ended}_gw0",
            f"PostgreSQL test_dlock_q1{ended}_gw0",
            f"MariaDB test_dlock{ended}_gw1",
        } <= set(dropped)
        assert not any(running in name for name in dropped)
        assert f"test_dlock{running}" in _pg_names()
        assert not any(ended in name for name in _pg_names() | _mysql_names())
    finally:
        held.close()  # the run ends
    assert f"PostgreSQL test_dlock{running}" in servers.cleanup()
    assert f"test_dlock{running}" not in _pg_names()


def test_the_suffix_of_a_run_is_documented():
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert re.search(r"`DLOCK_TEST_DB_SUFFIX`", readme)
