"""The ``advisory`` strategy on MariaDB/MySQL: ``GET_LOCK`` on dedicated connections."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext

import django_dlock as dlock
from django_dlock import signals
from django_dlock.keys import make_key
from django_dlock.strategies.advisory import mysql, sessions
from django_dlock.strategies.advisory.mysql import MAX_NAME_LENGTH, lock_name
from django_dlock.strategies.connection import close_private_connections

from . import procs
from .helpers import in_thread, run_threads, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

DB = "mysql"
ADV = "advisory"


@pytest.fixture(autouse=True)
def _no_session_left_behind():
    yield
    gc.collect()
    wait_until(lambda: not sessions.holding_sessions(), timeout=30)
    sessions.close_all()
    close_private_connections()


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


def waiting(key) -> int:
    """How many connections wait in GET_LOCK for ``key`` now."""
    with connections[DB].cursor() as cur:
        cur.execute(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST "
            "WHERE COMMAND = 'Query' AND INFO LIKE %s AND ID <> CONNECTION_ID()",
            [f"SELECT GET_LOCK('{name_in_server(key)}'%"],
        )
        return int(cur.fetchone()[0])


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


class HeldElsewhere:
    """A lock held by a thread of its own until :meth:`release`."""

    def __init__(self, key) -> None:
        self._acquired = threading.Event()
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(key,))
        self._thread.start()
        assert self._acquired.wait(30)

    def _run(self, key) -> None:
        try:
            with mlock(key):
                self._acquired.set()
                self._go.wait(120)
        finally:
            connections.close_all()

    def release(self) -> None:
        self._go.set()
        self._thread.join(60)
        assert not self._thread.is_alive()


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


def test_acquire_release_and_state():
    lk = mlock("state")
    assert not lk.locked()
    assert lk.acquire(timeout=0)
    session = sessions.find(DB, lk.token)
    assert isinstance(session, mysql.MySQLSession)
    assert holder_id("state") == session.backend_pid
    assert lk.held() and lk.owned() and lk.locked() and lk.fence is None
    assert try_once("state") is False
    lk.release()
    assert holder_id("state") is None
    assert not lk.held() and not lk.owned() and not lk.locked()
    with pytest.raises(dlock.LockNotOwned):
        lk.release()


def test_reentrancy_counts_in_django_dlock_and_releases_once():
    lk = mlock("again")
    for _ in range(3):
        assert lk.acquire(timeout=0)
    # The server holds it once (GET_LOCK ran once): two releases keep it,
    # the third frees it for everyone.
    lk.release()
    lk.release()
    assert holder_id("again") is not None and try_once("again") is False
    lk.release()
    assert holder_id("again") is None
    assert try_once("again") is True
    with pytest.raises(dlock.LockReentrantError), mlock("again"):
        mlock("again", reentrant=False).acquire(timeout=0)


def test_two_holders_in_one_process_never_share_a_connection():
    ids: dict[str, int] = {}
    barrier = threading.Barrier(2)

    def hold(key: str) -> None:
        with mlock(key) as lk:
            session = sessions.find(DB, lk.token)
            assert session is not None
            ids[key] = session.backend_pid
            barrier.wait(30)  # both hold at once

    run_threads(hold, [("one",), ("two",)])
    assert ids["one"] != ids["two"]

    async def main() -> tuple[bool, bool]:
        first = mlock("tasks")
        await first.aacquire()
        other = await asyncio.create_task(mlock("tasks").aacquire(timeout=0))
        reentered = await mlock("tasks").aacquire(timeout=0)  # the same task
        await mlock("tasks").arelease()
        await first.arelease()
        return other, reentered

    assert asyncio.run(main()) == (False, True)


def test_many_keys_all_or_none():
    with mlock("b"):
        assert in_thread(lambda: mlock(["a", "b", "c"]).acquire(timeout=0)) is False
        assert holder_id("a") is None and holder_id("c") is None
    with mlock(["a", "b", "c"]) as lk:
        assert lk.owned()
        assert len({holder_id(k) for k in "abc"}) == 1  # one connection per holder


# -- timeouts ------------------------------------------------------------------------


def test_timeouts_zero_and_seconds_give_up_and_leave_nothing():
    holder = HeldElsewhere("busy")
    try:
        owner = holder_id("busy")
        assert in_thread(lambda: mlock("busy").acquire(timeout=0)) is False
        assert in_thread(lambda: mlock("busy").acquire(timeout=0.3)) is False
        with pytest.raises(dlock.LockTimeout):
            in_thread(lambda: mlock("busy", timeout=0.2).__enter__())
        assert holder_id("busy") == owner and waiting("busy") == 0
    finally:
        holder.release()
    assert try_once("busy") is True


def test_timeout_none_waits_until_released():
    holder = HeldElsewhere("forever")
    result: dict[str, bool] = {}

    def waiter() -> None:
        lk = mlock("forever", timeout=None)
        with lk:
            result["held"] = lk.owned()
        connections.close_all()

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_until(lambda: waiting("forever") == 1)
    holder.release()
    thread.join(60)
    assert result == {"held": True}


def test_a_bounded_wait_gets_the_lock_at_release():
    holder = HeldElsewhere("handover")
    box: dict[str, bool] = {}
    thread = threading.Thread(target=lambda: box.update(got=mlock("handover").acquire(timeout=60)))
    thread.start()
    wait_until(lambda: waiting("handover") == 1)
    holder.release()
    thread.join(60)
    assert box == {"got": True}
    # the thread ended holding it: its connection is closed, which frees it
    gc.collect()
    wait_until(lambda: holder_id("handover") is None, timeout=30)


# -- threads, tasks, processes ------------------------------------------------------


def _counting_worker(counter_path: str, iterations: int) -> None:
    counter = procs.FileCounter(counter_path)
    lk = mlock("counter", timeout=120)
    for _ in range(iterations):
        with lk:
            counter.increment(pause=0.0002)


def test_threads_exclude_each_other(tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    run_threads(_counting_worker, [(counter.path, 40)] * 6)
    assert counter.read() == 240


def test_processes_exclude_each_other(tmp_path):
    counter = procs.FileCounter(str(tmp_path / "counter"))
    counter.reset()
    procs.run_all(_counting_worker, [(counter.path, 50)] * 4)
    assert counter.read() == 200


def test_asyncio_tasks_exclude_each_other():
    state = {"counter": 0, "inside": 0, "overlaps": 0}

    async def task() -> None:
        for _ in range(8):
            async with mlock("acounter", timeout=60):
                state["inside"] += 1
                state["overlaps"] += state["inside"] > 1
                value = state["counter"]
                await asyncio.sleep(0)  # let every other task run here
                state["counter"] = value + 1
                state["inside"] -= 1

    async def main() -> None:
        await asyncio.gather(*(task() for _ in range(6)))

    asyncio.run(main())
    assert state == {"counter": 48, "inside": 0, "overlaps": 0}


def test_async_wait_does_not_block_the_event_loop_and_cancels_in_the_server():
    holder = HeldElsewhere("await")

    async def hold(timeout) -> bool:
        async with mlock("await", timeout=timeout) as lk:
            return lk.held()

    async def main() -> None:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        cancelled = asyncio.create_task(hold(None))
        await asyncio.to_thread(wait_until, lambda: waiting("await") == 1)
        during = ticks
        await asyncio.sleep(0.2)
        assert ticks > during  # the loop kept running while the task waited
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        # KILL QUERY ended the wait in the server
        await asyncio.to_thread(wait_until, lambda: waiting("await") == 0)
        waiter = asyncio.create_task(hold(60))
        await asyncio.to_thread(wait_until, lambda: waiting("await") == 1)
        await asyncio.to_thread(holder.release)
        assert await asyncio.wait_for(waiter, 60) is True
        stop.set()
        await ticking

    asyncio.run(main())
    assert try_once("await") is True


# -- loss ------------------------------------------------------------------------------


def test_killed_connection_is_reported_lost_and_frees_the_lock():
    lost: list[dlock.LockLost] = []
    signalled: list[tuple[str, str]] = []

    def receiver(sender, name, strategy, reason, **kwargs):
        signalled.append((name, strategy))

    signals.lock_lost.connect(receiver)
    try:
        lk = mlock("victim", on_lost=lost.append)
        lk.acquire()
        kill(holder_id("victim"))
        # The server freed it at once: another holder gets it.
        assert try_once("victim") is True
        # The watcher notices the closed connection without a statement of ours.
        wait_until(lambda: lk.lost, timeout=30)
        assert len(lost) == 1 and isinstance(lost[0], dlock.LockLost)
        assert signalled == [("lock:victim", "advisory")]
        assert not lk.held() and not lk.owned()
        with pytest.raises(dlock.LockLost):
            lk.release()
        with lk:  # the same holder starts again on a new connection
            assert lk.owned()
    finally:
        signals.lock_lost.disconnect(receiver)


def test_loss_found_when_leaving_the_block_without_the_watcher():
    lk = mlock("quiet")
    with pytest.raises(dlock.LockLost), lk:
        session = sessions.find(DB, lk.token)
        assert session is not None
        with session.mutex:  # keep the watcher away, as if it had not looked yet
            kill(session.backend_pid)
            wait_until(lambda: holder_id("quiet") is None)
    assert try_once("quiet") is True


def test_release_behind_our_back_is_never_ignored():
    lk = mlock("unlocked")
    lk.acquire()
    session = sessions.find(DB, lk.token)
    assert isinstance(session, mysql.MySQLSession)
    with session.mutex, session.link.raw.cursor() as cur:
        cur.execute("SELECT RELEASE_ALL_LOCKS()")
    assert not lk.owned()
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_a_switched_server_connection_is_refused():
    keep = mlock("kept")
    keep.acquire()
    session = sessions.find(DB, keep.token)
    assert session is not None
    session.backend_pid = -1  # as if a proxy had moved us to another connection
    with pytest.raises(dlock.DLockError, match="proxy"):
        mlock("next").acquire(timeout=0)
    assert keep.lost
    with pytest.raises(dlock.LockLost):
        keep.release()
    assert try_once("kept") is True and try_once("next") is True


def test_a_thread_that_ends_holding_frees_its_locks():
    in_thread(lambda: mlock("leaked").acquire())
    gc.collect()
    wait_until(lambda: holder_id("leaked") is None, timeout=30)
    assert try_once("leaked") is True


def _hold_forever(ready_path: str) -> None:
    mlock("crash").acquire()
    with open(ready_path, "w") as f:
        f.write(str(os.getpid()))
    threading.Event().wait(600)


def test_sigkill_of_the_holder_process_frees_the_lock_at_once(tmp_path):
    ready = tmp_path / "ready"
    proc = procs.start(_hold_forever, str(ready))
    try:
        wait_until(ready.exists, timeout=60)
        assert mlock("crash").locked() and try_once("crash") is False
        box: dict[str, bool] = {}

        def waiter() -> None:
            lk = mlock("crash")
            box["got"] = lk.acquire(timeout=60)
            if box["got"]:
                lk.release()
            connections.close_all()

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until(lambda: waiting("crash") == 1)
        os.kill(proc.pid, signal.SIGKILL)
        thread.join(60)
        assert box == {"got": True}
    finally:
        proc.kill()
        proc.join(10)


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
