"""The ``advisory`` strategy on MariaDB/MySQL: ``GET_LOCK`` on dedicated connections."""

from __future__ import annotations

import asyncio
import threading

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

import django_dlock as dlock
from django_dlock.keys import make_key
from django_dlock.strategies.advisory import mysql, sessions
from django_dlock.strategies.advisory.mysql import MAX_NAME_LENGTH, lock_name

from .helpers import give_back_sessions, in_thread, run_threads, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

DB = "mysql"
ADV = "advisory"


@pytest.fixture(autouse=True)
def _no_session_left_behind():
    yield
    give_back_sessions()  # every test gives back what it took


def mlock(key, **options):
    return dlock.lock(key, strategy=ADV, using=DB, **options)


def name_in_server(key) -> str:
    """The GET_LOCK name of ``key`` (as the strategy computes it)."""
    return lock_name(connections[DB].settings_dict["NAME"], make_key(key).name)


def holder_id(key) -> int | None:
    """The connection id that holds ``key`` in the server (IS_USED_LOCK)."""
    with connections[DB].cursor() as cur:
        cur.execute("SELECT IS_USED_LOCK(%s)", [name_in_server(key)])
        return cur.fetchone()[0]


def kill(connection_id: int) -> None:
    with connections[DB].cursor() as cur:
        cur.execute("KILL %s", [connection_id])


def try_once(key) -> bool:
    """In another thread: try once, release if acquired; whether it was acquired."""

    def attempt() -> bool:
        lk = mlock(key)
        if lk.acquire(timeout=0):
            lk.release()
            return True
        return False

    return in_thread(attempt)


# -- names -------------------------------------------------------------------------


ODD_KEYS = [
    "x",
    "ABC",
    "abc",
    "k" * 255,
    "k" * 254 + "j",
    "invoice:42 / 'quoted' \"double\" `back`",
    "ünïcødé ключ 鍵 🔒",
    ("order", 42),
    (1, 2),
]


def test_names_fit_64_characters_and_stay_distinct():
    names = [name_in_server(key) for key in ODD_KEYS]
    assert all(len(name) <= MAX_NAME_LENGTH for name in names)
    assert len(set(names)) == len(names)  # "ABC" and "abc" too (MySQL ignores case)
    assert len({name.lower() for name in names}) == len(names)
    assert name_in_server("invoice:42").startswith("lock:invoice:42#")
    # Per database: the same key in another database of the server is another lock.
    assert lock_name("other", "lock:x") != lock_name("dlock", "lock:x")


def test_the_documented_name_is_what_the_server_computes():
    sql = (
        "SELECT CONCAT(LEFT(REGEXP_REPLACE(%s, '[^A-Za-z0-9:._-]', '_'), 31), '#', "
        "LEFT(SHA2(CONCAT(CONVERT(DATABASE() USING utf8mb4), '/', %s), 256), 32))"
    )
    for key in ODD_KEYS:
        name = make_key(key).name
        with connections[DB].cursor() as cur:
            cur.execute(sql, [name, name])
            assert cur.fetchone()[0] == name_in_server(key), key


def test_long_and_odd_keys_lock_and_exclude():
    for key in ODD_KEYS:
        with mlock(key) as lk:
            assert lk.owned()
            assert holder_id(key) is not None
            assert try_once(key) is False
        assert holder_id(key) is None
    # Keys that differ in case only, or after the readable prefix, are held at once.
    with mlock("ABC"), mlock("k" * 255):
        assert try_once("abc") is True
        assert try_once("k" * 254 + "j") is True


# -- acquire, release, re-entrancy -------------------------------------------------


# -- timeouts ------------------------------------------------------------------------


# -- threads, tasks, processes ------------------------------------------------------


# -- loss ------------------------------------------------------------------------------


# -- refused before any SQL ------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: mlock("k", shared=True).acquire(timeout=0),
        lambda: asyncio.run(mlock("k", shared=True).aacquire(timeout=0)),
        lambda: dlock.lock("k", strategy="advisory_xact", using=DB).acquire(timeout=0),
    ],
    ids=["shared", "shared-async", "advisory_xact"],
)
def test_refused_before_any_sql(make):
    opened = len(sessions.pool(DB, mysql.MySQLPool).idle)
    with (
        CaptureQueriesContext(connections[DB]) as queries,
        pytest.raises(dlock.StrategyNotSupported, match="PostgreSQL"),
    ):
        make()
    assert len(queries) == 0
    assert len(sessions.pool(DB, mysql.MySQLPool).idle) == opened
    assert not sessions.holding_sessions()


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: mlock(""), dlock.InvalidLockKey),
        (lambda: mlock("k" * 256), dlock.InvalidLockKey),
        (lambda: mlock((2**31, 1)), dlock.InvalidLockKey),
        (lambda: mlock("k").acquire(timeout=-1), ValueError),
        (lambda: mlock("k", timeout=float("nan")), ValueError),
        (lambda: mlock("k").release(), dlock.LockNotOwned),
        (lambda: mlock("k").extend(), dlock.LockNotOwned),
    ],
    ids=["empty", "too-long", "int4-range", "timeout", "nan", "release", "extend"],
)
def test_bad_input_is_a_named_error_before_any_sql(make, error):
    with CaptureQueriesContext(connections[DB]) as queries, pytest.raises(error) as info:
        make()
    assert len(queries) == 0 and str(info.value)
    assert sessions.find(DB, mlock("k").token) is None  # no connection opened for it


def test_advisory_on_sqlite_names_both_databases_that_can():
    with pytest.raises(dlock.StrategyNotSupported, match="PostgreSQL or MySQL/MariaDB"):
        dlock.lock("k", strategy=ADV, using="sqlite").acquire(timeout=0)


# -- system checks --------------------------------------------------------------------


def test_checks_advisory_runs_on_mysql_advisory_xact_is_e013():
    from django_dlock.checks import database_messages

    assert database_messages("advisory", "x", {}, "mysql") == []
    assert [m.id for m in database_messages("advisory", "x", {}, "sqlite")] == ["dlock.E010"]
    assert [m.id for m in database_messages("advisory_xact", "x", {}, "mysql")] == ["dlock.E013"]
    assert [m.id for m in database_messages("advisory_xact", "x", {}, "sqlite")] == ["dlock.E010"]


class _LocksOnMySQL:
    def db_for_write(self, model, **hints):
        return DB if model._meta.app_label == "django_dlock" else None


def test_checks_follow_the_lock_database_of_the_router():
    from django.test.utils import override_settings

    from django_dlock.checks import check_strategy_database

    router = f"{__name__}._LocksOnMySQL"
    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory", DATABASE_ROUTERS=[router]):
        assert check_strategy_database() == []
    with override_settings(DLOCK_DEFAULT_STRATEGY="advisory_xact", DATABASE_ROUTERS=[router]):
        [message] = check_strategy_database()
        assert message.id == "dlock.E013" and "row" in (message.hint or "")


# -- operators: dlock_list, dlock_show ---------------------------------------------------


def _server(sql: str) -> list[tuple]:
    with connections[DB].cursor() as cur:
        cur.execute(sql)
        return list(cur.fetchall()) if cur.description else []


def _plugin_active() -> bool:
    return bool(
        _server(
            "SELECT 1 FROM information_schema.PLUGINS "
            "WHERE PLUGIN_NAME = 'METADATA_LOCK_INFO' AND PLUGIN_STATUS = 'ACTIVE'"
        )
    )


@pytest.fixture
def metadata_lock_info():
    """MariaDB's metadata_lock_info plugin, installed for the test if it was not."""
    installed_here = not _plugin_active()
    if installed_here:
        _server("INSTALL SONAME 'metadata_lock_info'")
    yield
    if installed_here:
        _server("UNINSTALL SONAME 'metadata_lock_info'")


def _run(*args: str) -> str:
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_dlock_list_shows_get_lock_locks_and_dlock_show_the_holder(metadata_lock_info):
    with mlock("invoice:42") as lk:
        session = sessions.find(DB, lk.token)
        assert session is not None
        out = _run("dlock_list", "--using", DB)
        assert "Advisory locks (GET_LOCK)" in out
        [line] = [ln for ln in out.splitlines() if ln.startswith(name_in_server("invoice:42"))]
        assert line.split()[1:3] == ["held", str(session.backend_pid)]
        shown = _run("dlock_show", "invoice:42", "--using", DB)
        assert name_in_server("invoice:42") in shown
        assert f"held by connection {session.backend_pid}" in shown
    out = _run("dlock_list", "--using", DB)
    assert name_in_server("invoice:42") not in out
    with pytest.raises(Exception, match="no lock named"):
        _run("dlock_show", "invoice:42", "--using", DB)


def test_dlock_list_says_what_it_cannot_show():
    from django_dlock import operations as override

    if override.user_locks(DB).source == "performance_schema.metadata_locks":
        with mlock("shown"):  # a server that records user locks shows them there
            assert name_in_server("shown") in _run("dlock_list", "--using", DB)
        return
    reinstall = _plugin_active()
    if reinstall:
        _server("UNINSTALL SONAME 'metadata_lock_info'")
    try:
        with mlock("hidden"):
            out = _run("dlock_list", "--using", DB)
            assert "cannot list them" in out and "IS_USED_LOCK" in out
            assert "hidden" not in out
            # one key can still be looked up
            assert "held by connection" in _run("dlock_show", "hidden", "--using", DB)
    finally:
        if reinstall:
            _server("INSTALL SONAME 'metadata_lock_info'")


def test_mysql_w003_is_the_lock_name_column_and_silencing_it_is_enough():
    # What docs/mysql.md says: Django warns about the unique varchar(300) on
    # MySQL/MariaDB; with utf8mb4 it is 1,200 bytes, within InnoDB's 3,072.
    from django.core import checks
    from django.test.utils import override_settings

    from django_dlock.models import Lock as LockRow

    found = [m for m in checks.run_checks(databases=[DB]) if m.id == "mysql.W003"]
    assert [m.obj for m in found] == [LockRow._meta.get_field("name")]
    with override_settings(SILENCED_SYSTEM_CHECKS=["mysql.W003"]):
        found = [m for m in checks.run_checks(databases=[DB]) if m.id == "mysql.W003"]
        assert found and all(m.is_silenced() for m in found)
    with connections[DB].cursor() as cur:
        cur.execute(
            "SELECT CHARACTER_SET_NAME, CHARACTER_MAXIMUM_LENGTH FROM information_schema.COLUMNS "
            "WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s AND COLUMN_NAME = 'name'",
            [LockRow._meta.db_table],
        )
        assert cur.fetchone() == ("utf8mb4", 300)


def test_admin_advisory_page_lists_get_lock_locks(metadata_lock_info):
    from django.contrib.auth.models import User
    from django.test import Client
    from django.test.utils import override_settings
    from django.urls import reverse

    client = Client()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    with override_settings(DATABASE_ROUTERS=[f"{__name__}._LocksOnMySQL"]), mlock("nightly") as lk:
        session = sessions.find(DB, lk.token)
        assert session is not None
        listing = client.get(reverse("admin:django_dlock_lock_changelist")).content.decode()
        assert "Advisory locks (MySQL/MariaDB)" in listing
        page = client.get(reverse("admin:django_dlock_lock_advisory")).content.decode()
        assert "information_schema.METADATA_LOCK_INFO" in page
        assert name_in_server("nightly") in page and str(session.backend_pid) in page


def test_a_deadlock_the_server_detects_ends_one_wait(caplog):
    # Two holders nest two keys in opposite orders: the server ends one wait
    # (a warning says why), the other goes on.
    barrier = threading.Barrier(2)
    outcome: dict[str, str] = {}

    def nest(first: str, second: str) -> None:
        with mlock(first):
            barrier.wait(30)
            try:
                with mlock(second, timeout=60):
                    outcome[first] = "both"
            except dlock.LockTimeout:
                outcome[first] = "gave up"

    with caplog.at_level("WARNING", logger="django_dlock"):
        run_threads(nest, [("dl-a", "dl-b"), ("dl-b", "dl-a")])
    assert sorted(outcome.values()) == ["both", "gave up"]
    assert "deadlock" in caplog.text


def test_a_pooled_connection_killed_while_idle_is_replaced():
    lk = mlock("pooled")
    with lk:
        session = sessions.find(DB, lk.token)
        assert session is not None
    pool = sessions.pool(DB, mysql.MySQLPool)
    assert session in pool.idle  # given back to the pool, holding nothing
    kill(session.backend_pid)
    wait_until(lambda: session.backend_pid not in [r[0] for r in _server("SHOW PROCESSLIST")])
    with lk:  # the dead one is found out and a new connection takes the lock
        assert lk.owned()
        assert holder_id("pooled") != session.backend_pid
