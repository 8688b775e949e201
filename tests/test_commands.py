"""``dlock_cleanup`` and the operator commands: dlock_list, dlock_show, dlock_release."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connections
from django.utils import timezone

import django_dlock as dlock
from django_dlock import signals
from django_dlock.keys import hash64
from django_dlock.models import FenceFloor
from django_dlock.models import Lock as LockRow

from .helpers import in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ROOT = Path(__file__).resolve().parent.parent


def run(*args, **options) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO(), **options)
    return out.getvalue()


def count(alias: str) -> int:
    return LockRow.objects.using(alias).count()


def bulk_rows(alias: str, expired: int, live: int) -> None:
    """``expired`` free rows (ended an hour ago) and ``live`` held ones (an hour left)."""
    connection = connections[alias]
    if connection.vendor == "postgresql":
        with connection.cursor() as cur:
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
                "SELECT 'lock:old-' || i, '', 'gone host pid=1', i, "
                "statement_timestamp() - interval '2 hours', "
                "statement_timestamp() - interval '1 hour' FROM generate_series(1, %s) AS i",
                [expired],
            )
            cur.execute(
                "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
                "SELECT 'lock:live-' || i, md5(i::text), 'live host pid=2', i, "
                "statement_timestamp(), statement_timestamp() + interval '1 hour' "
                "FROM generate_series(1, %s) AS i",
                [live],
            )
        return
    # Elsewhere: bulk_create with a day of margin either side of now.
    now = timezone.now()
    rows = [
        LockRow(
            name=f"lock:old-{i}",
            token="",
            owner="gone host pid=1",
            fence=i,
            acquired_at=now - dt.timedelta(days=2),
            expire_at=now - dt.timedelta(days=1),
        )
        for i in range(1, expired + 1)
    ] + [
        LockRow(
            name=f"lock:live-{i}",
            token=f"t{i}",
            owner="live host pid=2",
            fence=i,
            acquired_at=now,
            expire_at=now + dt.timedelta(days=1),
        )
        for i in range(1, live + 1)
    ]
    LockRow.objects.using(alias).bulk_create(rows, batch_size=500)


def live_names(alias: str) -> set[str]:
    return set(
        LockRow.objects.using(alias)
        .filter(name__startswith="lock:live-")
        .values_list("name", flat=True)
    )


@pytest.mark.slow
def test_cleanup_200000_expired_rows_keeps_every_live_one_postgresql():
    alias = "default"
    bulk_rows(alias, expired=200_000, live=1_000)
    assert count(alias) == 201_000

    out = run("dlock_cleanup", "--dry-run", "--using", alias)
    assert "would delete 200000" in out and "nothing was deleted" in out
    assert count(alias) == 201_000

    out = run("dlock_cleanup", "--using", alias)
    assert "Deleted 200000 expired or released lease rows" in out
    # one pass over the table, in transactions of at most 10,000 rows
    batches = int(re.search(r"in (\d+) batches", out).group(1))
    assert 20 <= batches <= 30
    assert count(alias) == 1_000
    assert live_names(alias) == {f"lock:live-{i}" for i in range(1, 1_001)}


@pytest.mark.parametrize("alias", ["sqlite", "mysql"], ids=["sqlite", "mariadb"])
def test_cleanup_smaller_run(alias):
    bulk_rows(alias, expired=3_000, live=100)
    out = run("dlock_cleanup", "--dry-run", f"--using={alias}")
    assert "would delete 3000" in out
    assert count(alias) == 3_100

    out = run("dlock_cleanup", "--batch-size", "1000", "--using", alias, verbosity=2)
    assert out.count("batch ") == 3  # one progress line per batch
    assert "Deleted 3000" in out and "in 3 batches" in out
    assert count(alias) == 100
    assert live_names(alias) == {f"lock:live-{i}" for i in range(1, 101)}
    # the fencing history of the deleted rows survives in the floor
    assert FenceFloor.objects.using(alias).get(pk=1).value >= 3_000


def test_cleanup_never_deletes_a_held_lock_and_older_than(alias):
    held = dlock.lock("kept", using=alias, ttl=60)
    held.acquire()
    try:
        freed = dlock.lock("freed", using=alias)
        freed.acquire()
        freed.release()
        out = run("dlock_cleanup", "--older-than", "3600", "--using", alias)
        assert "Deleted 0" in out  # released just now: not old enough
        out = run("dlock_cleanup", "--using", alias)
        assert "Deleted 1 expired or released lease row " in out
        assert list(LockRow.objects.using(alias).values_list("name", flat=True)) == ["lock:kept"]
    finally:
        held.release()


def test_cleanup_walks_past_held_rows_between_free_ones(alias):
    """Free and held rows interleaved, batches smaller than either run of them:
    every free row goes, every held one stays (a run walks the rows by id)."""
    now = timezone.now()
    rows = [
        LockRow(
            name=f"lock:{'live' if (i // 4) % 2 else 'gone'}-{i}",
            token=f"t{i}",
            owner="host pid=1",
            fence=i,
            acquired_at=now - dt.timedelta(days=2),
            expire_at=now + dt.timedelta(days=1 if (i // 4) % 2 else -1),
        )
        for i in range(40)
    ]
    LockRow.objects.using(alias).bulk_create(rows)
    out = run("dlock_cleanup", "--batch-size", "3", "--using", alias)
    assert "Deleted 20 " in out
    assert live_names(alias) == {row.name for row in rows if row.name.startswith("lock:live-")}
    assert count(alias) == 20


def test_cleanup_progress_only_on_a_tty_by_default():
    bulk_rows("default", expired=30, live=0)
    out = run("dlock_cleanup", "--batch-size", "10")
    assert "batch " not in out  # StringIO is not a TTY
    assert "Deleted 30" in out and "in 3 batches" in out


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        (["--batch-size", "0"], {}, "--batch-size must be a whole number >= 1"),
        (["--batch-size", "-5"], {}, "--batch-size must be a whole number >= 1"),
        ([], {"batch_size": 0}, "--batch-size must be a whole number >= 1"),
        (["--older-than", "-1"], {}, "--older-than must be seconds >= 0"),
        (["--older-than", "nan"], {}, "--older-than must be seconds >= 0"),
        (["--using", "nope"], {}, "unknown database alias 'nope'"),
        (["--batch-size", "many"], {}, "invalid int value"),
    ],
)
def test_cleanup_bad_arguments(args, options, message):
    with pytest.raises(CommandError, match=message):
        run("dlock_cleanup", *args, **options)


def test_cleanup_bad_argument_exits_non_zero_from_the_command_line():
    # DLOCK_TEST_CHILD: the child uses the test databases (Django 6 model
    # checks connect to every database before the command runs).
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DLOCK_TEST_CHILD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "django", "dlock_cleanup", "--batch-size", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "--batch-size must be a whole number >= 1" in result.stderr


# -- operator commands -------------------------------------------------------------


def test_dlock_list_shows_held_leases(alias):
    lk = dlock.lock("listed", using=alias)
    lk.acquire()
    gone = dlock.lock("gone", using=alias)
    gone.acquire()
    gone.release()
    try:
        out = run("dlock_list", "--using", alias)
        assert "Held leases in" in out and "lock:listed" in out and "held" in out
        assert "lock:gone" not in out
        assert lk.token not in out and lk.token[:8] in out
        out = run("dlock_list", "--all", "--using", alias)
        assert "lock:gone" in out and "released" in out
    finally:
        lk.release()


def test_dlock_list_and_show_advisory_locks_on_postgresql():
    key = hash64("lock:adv-job")
    other = connections["default"].copy()
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", [key])
            cur.execute("SELECT pg_backend_pid()")
            pid = cur.fetchone()[0]
        out = run("dlock_list")
        assert "Advisory locks in 'default': 1" in out
        assert str(key) in out and str(pid) in out and "ExclusiveLock" in out
        out = run("dlock_show", "adv-job")
        assert re.search(rf"^advisory key +{key}$", out, re.MULTILINE)
        assert f"held ExclusiveLock by pid {pid}" in out
    finally:
        other.close()


def test_a_two_part_key_is_listed_shown_and_released_by_the_one_name_it_has():
    """getting-started: the commands take a name as dlock_list shows it."""
    lk = dlock.lock(("order", 42), ttl=60)
    assert lk.acquire(timeout=0)
    try:
        assert re.search(r"^lock\('order', 42\) +held ", run("dlock_list"), re.M)
        shown = run("dlock_show", "lock('order', 42)")
        assert re.search(r"^name +lock\('order', 42\)\nstate +held$", shown, re.M), shown
        # its advisory key is the pair of int4 keys.md gives, not a hash of the name
        assert re.search(r"^advisory key +\(1055620758, 42\)$", shown, re.M), shown
        run("dlock_release", "lock('order', 42)", "--yes")
        assert not lk.owned()
    finally:
        if lk.owned():
            lk.release()


def test_dlock_list_names_an_advisory_key_where_its_name_can_be_known():
    """Advisory keys were listed as bare numbers (hashes of their names)."""
    with dlock.lock("adv-named"):  # a lease row of that name: the key's name is known
        pass
    other = connections["default"].copy()
    try:
        with other.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:adv-named")])
            cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:adv-nameless")])
        out = run("dlock_list")
        assert re.search(rf"^{hash64('lock:adv-named')} +lock:adv-named +int8 ", out, re.M), out
        assert re.search(rf"^{hash64('lock:adv-nameless')} +- +int8 ", out, re.M), out
        assert "NAME -: a key is a hash of its lock's name" in out
    finally:
        other.close()


def _no_countdown(text: str) -> str:
    return re.sub(r"[\d.]+ s left", "<seconds> s left", text)


def test_dlock_show(alias):
    lk = dlock.lock("shown", using=alias, ttl=120)
    lk.acquire()
    try:
        out = run("dlock_show", "shown", "--using", alias)
        assert "lock:shown" in out and "held" in out
        assert re.search(rf"^fence +{lk.fence}$", out, re.MULTILINE)
        assert lk.token not in out and lk.token[:8] in out
        # the same lock by its stored name (the seconds left move on meanwhile)
        again = run("dlock_show", "lock:shown", "--using", alias)
        assert _no_countdown(again) == _no_countdown(out)
        with pytest.raises(CommandError, match="no lock named 'missing'"):
            run("dlock_show", "missing", "--using", alias)
    finally:
        lk.release()


def test_dlock_release_needs_yes_then_the_holder_sees_lock_lost(alias):
    lk = dlock.lock("stuck", using=alias, ttl=300)
    lk.acquire()
    seen = []

    def receiver(sender, **kwargs):
        seen.append(kwargs)

    signals.lock_force_released.connect(receiver)
    try:
        with pytest.raises(CommandError, match="refusing to force-release 'lock:stuck'"):
            run("dlock_release", "stuck", "--using", alias)
        assert lk.owned()
        out = run("dlock_release", "stuck", "--yes", "--using", alias)
        assert "Force-released lock:stuck" in out
        assert not lk.locked()
        # someone else can take it at once
        assert in_thread(lambda: dlock.lock("stuck", using=alias).acquire(timeout=0)) is True
        with pytest.raises(dlock.LockLost):
            lk.release()
    finally:
        signals.lock_force_released.disconnect(receiver)
    assert [s["name"] for s in seen] == ["lock:stuck"]
    assert seen[0]["source"] == "command" and seen[0]["using"] == alias
    assert seen[0]["fence"] is not None and seen[0]["user"] is None


def test_dlock_release_of_a_free_or_missing_lock():
    lk = dlock.lock("free")
    lk.acquire()
    lk.release()
    assert "already released" in run("dlock_release", "free", "--yes")
    with pytest.raises(CommandError, match="no lock named 'nothing'"):
        run("dlock_release", "nothing", "--yes")


def test_extend_after_force_release_sees_lock_lost():
    lk = dlock.lock("renewing", ttl=300)
    lk.acquire()
    run("dlock_release", "renewing", "--yes")
    with pytest.raises(dlock.LockLost):
        lk.extend()
    with pytest.raises(dlock.LockLost):
        lk.release()


# -- output: labels in one column, wording, verbosity, one message ---------------------


def value_columns(out: str) -> dict[str, int]:
    """dlock_show's ``label  value`` lines (not indented): label -> where its value starts."""
    found = {}
    for line in out.splitlines():
        match = re.match(r"^(\S+(?: \S+)*?)( {2,})\S", line)
        if match:
            found[match.group(1)] = len(match.group(1)) + len(match.group(2))
    return found


def test_dlock_show_lines_up_every_label_postgresql():
    lk = dlock.lock("aligned", ttl=120)
    lk.acquire()
    other = connections["default"].copy()
    try:
        with other.cursor() as cur:  # the same name's advisory lock, held elsewhere
            cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:aligned")])
        out = run("dlock_show", "aligned")
    finally:
        other.close()
        lk.release()
    columns = value_columns(out)
    assert {"name", "fence", "acquired at", "waiters", "advisory key"} <= set(columns), out
    assert len(set(columns.values())) == 1, out


def test_dlock_show_lines_up_every_label_mysql():
    lease = dlock.lock("aligned", using="mysql", ttl=120)
    advisory = dlock.lock("aligned", using="mysql", strategy="advisory")
    with lease, advisory:
        out = run("dlock_show", "aligned", "--using", "mysql")
    columns = value_columns(out)
    assert {"name", "expires at", "waiters", "GET_LOCK name"} <= set(columns), out
    assert len(set(columns.values())) == 1, out


def test_dlock_release_without_yes_says_who_holds_it_once(alias):
    lk = dlock.lock("worded", using=alias, ttl=300)
    lk.acquire()
    try:
        row = LockRow.objects.using(alias).get(name="lock:worded")
        with pytest.raises(CommandError) as refused:
            run("dlock_release", "worded", "--using", alias)
    finally:
        lk.release()
    message = str(refused.value)
    expected = f"(held by {row.owner}, fence {row.fence})"
    assert (
        row.owner and message == f"refusing to force-release 'lock:worded' {expected} without --yes"
    )
    assert "held, held" not in message


def test_dlock_release_without_yes_of_an_expired_lease():
    LockRow.objects.create(
        name="lock:lapsed",
        token="t",
        owner="gone host pid=1",
        fence=7,
        acquired_at=timezone.now() - dt.timedelta(days=2),
        expire_at=timezone.now() - dt.timedelta(days=1),
    )
    with pytest.raises(CommandError) as refused:
        run("dlock_release", "lapsed")
    assert str(refused.value) == (
        "refusing to force-release 'lock:lapsed' (expired, last held by gone host pid=1, "
        "fence 7) without --yes"
    )


def test_one_message_for_a_name_that_names_no_lock(alias):
    for command in (["dlock_show"], ["dlock_release", "--yes"]):
        with pytest.raises(CommandError) as missing:
            run(*command, "nothing", "--using", alias)
        assert str(missing.value) == f"no lock named 'nothing' in {alias!r}"


def test_verbosity_0_prints_nothing_but_errors(alias):
    held = dlock.lock("quiet-held", using=alias, ttl=300)
    held.acquire()
    gone = dlock.lock("quiet-gone", using=alias)
    gone.acquire()
    gone.release()
    try:
        assert run("dlock_list", "--using", alias) != ""
        assert run("dlock_list", "--all", "--using", alias, verbosity=0) == ""
        assert run("dlock_show", "quiet-held", "--using", alias, verbosity=0) == ""
        assert run("dlock_release", "quiet-gone", "--yes", "--using", alias, verbosity=0) == ""
        assert "already released" in run("dlock_release", "quiet-gone", "--yes", "--using", alias)
        assert run("dlock_cleanup", "--dry-run", "--using", alias, verbosity=0) == ""
        assert "Dry run" in run("dlock_cleanup", "--dry-run", "--using", alias)
        assert run("dlock_cleanup", "--using", alias, verbosity=0) == ""
        assert not LockRow.objects.using(alias).filter(name="lock:quiet-gone").exists()
        # errors are still errors
        with pytest.raises(CommandError, match="no lock named 'nothing'"):
            run("dlock_show", "nothing", "--using", alias, verbosity=0)
        with pytest.raises(CommandError, match="without --yes"):
            run("dlock_release", "quiet-held", "--using", alias, verbosity=0)
        assert run("dlock_release", "quiet-held", "--yes", "--using", alias, verbosity=0) == ""
        assert not held.locked()
    finally:
        with contextlib.suppress(dlock.LockLost):
            held.release()


def test_verbosity_0_from_the_command_line_prints_nothing():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DLOCK_TEST_CHILD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "django", "dlock_list", "--all", "-v", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (0, ""), result.stderr


def test_dlock_show_a_semaphore_lists_its_permits_and_waiters(alias):
    from .test_semaphore import Holder, _queued

    holders = [Holder(alias, "reports", 3, ttl=60) for _ in range(3)]
    go = threading.Event()

    def wait() -> None:
        try:
            with dlock.semaphore("reports", permits=3, using=alias, timeout=30):
                go.wait(30)
        finally:
            connections.close_all()

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        wait_until(lambda: _queued(alias, "reports") == 1)
        out = run("dlock_show", "semaphore:reports", using=alias)
        assert re.search(r"^permits held +3$", out, re.M), out
        for permit in ("0", "1", "2"):
            assert re.search(rf"^  {permit} +held +\S", out, re.M), out
        assert re.search(r"^waiters +1$", out, re.M), out
        assert re.search(r"^  1 +\d+ ", out, re.M), out  # position 1 of the queue
    finally:
        for holder in holders:
            holder.release()
        go.set()
        waiter.join(30)
    with pytest.raises(CommandError, match="no lock named 'semaphore:nothing'"):
        run("dlock_show", "semaphore:nothing", using=alias)


def test_dlock_show_a_semaphores_permit_row(alias):
    from django_dlock import operations

    from .test_semaphore import Holder

    holder = Holder(alias, "exports", 2, ttl=60)
    try:
        permit = next(
            p.name for p in operations.find_permits(alias, "exports") if p.state == "held"
        )
        number = permit.rpartition("#")[2]
        out = run("dlock_show", permit, using=alias)
        assert re.search(rf"^name +{re.escape(permit)}$", out, re.M), out
        assert re.search(rf"^permit of +semaphore:exports \(permit {number}\)$", out, re.M), out
        assert re.search(r"^state +held$", out, re.M), out
        assert re.search(r"^waiters +0$", out, re.M), out
    finally:
        holder.release()
    with pytest.raises(CommandError, match="no lock named 'semaphore:exports#7'"):
        run("dlock_show", "semaphore:exports#7", using=alias)


def test_dlock_show_a_read_write_lock_lists_its_readers(alias):
    from .test_shared_lease import Holder

    readers = [Holder(alias, "catalog", True, ttl=60).wait() for _ in range(2)]
    upgrader = Holder(alias, "catalog", True, upgradeable=True, ttl=60).wait()
    writer = Holder(alias, "catalog", False, timeout=30)  # queued behind the readers
    try:
        wait_until(lambda: waiting(alias, "lock:catalog") == 1)
        out = run("dlock_list", "--waiting", using=alias)
        assert len(re.findall(r"^  holder  .*  fence \d+  [\d.]+ s left$", out, re.M)) == 3, out
        out = run("dlock_show", "lock:catalog", using=alias)
        assert re.search(r"^owner +readers, the last in: ", out, re.M), out
        assert re.search(r"^readers +3$", out, re.M), out
        assert len(re.findall(r"^  [0-9a-f]{16} +\S.* \d+ +\d", out, re.M)) == 2, out
        assert re.search(r"^  upgradeable +\S", out, re.M), out
    finally:
        for holder in [*readers, upgrader]:
            holder.release()
        writer.wait().release()
    out = run("dlock_show", "lock:catalog", using=alias)  # the writer left it free
    assert re.search(r"^state +released$", out, re.M), out
    assert "readers" not in out, out


def test_dlock_list_waiting_shows_who_waits_on_whom(alias):
    """A held key with three waiters: its holder, then the queue in arrival order."""
    threads = []

    def wait(i: int) -> None:
        try:
            threading.current_thread().name = f"waiter-{i}"
            with dlock.lock("tree", using=alias, timeout=30):
                pass
        finally:
            connections.close_all()

    lk = dlock.lock("tree", using=alias, ttl=60)
    assert lk.acquire(timeout=0)
    try:
        for i in range(3):
            thread = threading.Thread(target=wait, args=(i,))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=i + 1: waiting(alias, "lock:tree") == n)
        out = run("dlock_list", "--waiting", using=alias)
        assert "lock:tree: held" in out, out
        assert re.search(r"^  holder  .*thread=MainThread  fence \d+  [\d.]+ s left$", out, re.M)
        order = re.findall(r"^  (\d)\. ticket \d+  .*thread=waiter-(\d)  waiting since ", out, re.M)
        assert order == [("1", "0"), ("2", "1"), ("3", "2")], out
    finally:
        lk.release()
        for thread in threads:
            thread.join(30)


def waiting(alias: str, name: str) -> int:
    from django_dlock.models import Waiter

    return Waiter.objects.using(alias).filter(name=name).count()


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_dlock_list_waiting_names_the_blocking_backend_of_an_advisory_lock():
    from .helpers import pg_locks

    holder = dlock.lock("adv-tree", strategy="advisory")
    assert holder.acquire(timeout=0)
    pid = holder_session_pid(holder)

    def wait() -> None:
        try:
            with dlock.lock("adv-tree", strategy="advisory", timeout=30):
                pass
        finally:
            connections.close_all()

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        wait_until(lambda: len(pg_locks("adv-tree", granted=False)) == 1)
        out = run("dlock_list", "--waiting")
        assert re.search(rf"^  holder  pid {pid} ", out, re.M), out
        assert re.search(rf"^  waiting pid \d+ .* blocked by pid {pid}$", out, re.M), out
    finally:
        holder.release()
        thread.join(30)


def holder_session_pid(lk) -> int:
    from django_dlock.strategies.advisory import sessions

    found = sessions.find("default", lk.token)
    assert found is not None
    return int(found.backend_pid)
