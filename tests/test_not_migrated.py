"""A database where ``migrate`` was not run for django-dlock: every entry
point says so by name (``NotMigrated``, ``dlock.W070``, a command error
with exit status 1), never with the driver's "relation does not exist"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.core.checks import run_checks
from django.core.management import CommandError, call_command
from django.db import connections

import django_dlock as dlock

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


@pytest.fixture
def unmigrated(alias: str) -> Iterator[str]:
    """``alias`` without django-dlock's lock table (put back afterwards)."""
    with connections[alias].cursor() as cur:
        cur.execute("ALTER TABLE django_dlock_lock RENAME TO django_dlock_lock_away")
    try:
        yield alias
    finally:
        connections.close_all()
        with connections[alias].cursor() as cur:
            cur.execute("ALTER TABLE django_dlock_lock_away RENAME TO django_dlock_lock")


def _hint(alias: str) -> str:
    option = "" if alias == "default" else f" --database {alias}"
    return f"python manage.py migrate django_dlock{option}"


def test_a_lock_says_run_migrate(unmigrated):
    lk = dlock.lock("nm", using=unmigrated)
    with pytest.raises(dlock.NotMigrated, match=_hint(unmigrated)) as raised:
        lk.acquire(timeout=0)
    assert raised.value.__cause__ is not None  # the driver's error, chained
    with pytest.raises(dlock.NotMigrated), dlock.lock("nm", using=unmigrated, timeout=2):
        pass


def test_check_database_warns(unmigrated):
    found = [m for m in run_checks(databases=[unmigrated]) if m.id == "dlock.W070"]
    assert len(found) == 1
    assert _hint(unmigrated) in (found[0].hint or "")


def test_check_database_is_quiet_once_migrated(alias):
    assert [m for m in run_checks(databases=[alias]) if m.id == "dlock.W070"] == []


def test_runworker_exits_with_status_1(unmigrated):
    with pytest.raises(CommandError, match=_hint(unmigrated)) as raised:
        call_command("dlock_runworker", "--job", "os.getcwd", "--using", unmigrated, verbosity=0)
    assert raised.value.returncode == 1


@pytest.mark.parametrize(
    "command",
    [
        ["dlock_list"],
        ["dlock_show", "nm"],
        ["dlock_release", "nm", "--yes"],
        ["dlock_cleanup"],
    ],
    ids=lambda c: c[0],
)
def test_commands_say_run_migrate(unmigrated, command):
    with pytest.raises(CommandError, match=_hint(unmigrated)) as raised:
        call_command(*command, "--using", unmigrated, verbosity=0)
    assert raised.value.returncode == 1


#: (what migrations 0007 and 0009 added, renamed away, and back)
_BEHIND = {
    "column": (
        "ALTER TABLE django_dlock_lock RENAME COLUMN queued TO queued_away",
        "ALTER TABLE django_dlock_lock RENAME COLUMN queued_away TO queued",
    ),
    "function": (
        "ALTER FUNCTION django_dlock_queued(text, bigint) RENAME TO dlock_queued_away",
        "ALTER FUNCTION dlock_queued_away(text, bigint) RENAME TO django_dlock_queued",
    ),
    "fence function": (
        "ALTER FUNCTION django_dlock_next_fence() RENAME TO dlock_next_fence_away",
        "ALTER FUNCTION dlock_next_fence_away() RENAME TO django_dlock_next_fence",
    ),
    "ahead function": (
        "ALTER FUNCTION django_dlock_ahead(text, bigint) RENAME TO dlock_ahead_away",
        "ALTER FUNCTION dlock_ahead_away(text, bigint) RENAME TO django_dlock_ahead",
    ),
}


@pytest.mark.parametrize("missing", sorted(_BEHIND))
def test_a_database_migrated_to_an_earlier_version_says_run_migrate(pg, missing):
    """PostgreSQL behind migration 0007 or 0009 (no ``queued`` column, or a function missing):
    a lock says to migrate, not "column (function) does not exist"."""
    away, back = _BEHIND[missing]
    with connections[pg].cursor() as cur:
        cur.execute(away)
    try:
        with pytest.raises(dlock.NotMigrated, match=_hint(pg)):
            dlock.lock("nm-behind", using=pg).acquire(timeout=0)
    finally:
        connections.close_all()
        with connections[pg].cursor() as cur:
            cur.execute(back)


def test_migrate_does_not_warn_about_the_tables_it_creates(unmigrated):
    """`migrate` runs its database's checks first: dlock.W070 ("tables
    missing, run migrate") printed by that very command misled readers."""
    import io

    out, err = io.StringIO(), io.StringIO()
    call_command(
        "migrate", "django_dlock", database=unmigrated, skip_checks=False, stdout=out, stderr=err
    )
    assert "W070" not in out.getvalue() + err.getvalue()
    # ``check`` still says it (the table is still away: migrate found nothing to do)
    assert [m.id for m in run_checks(databases=[unmigrated]) if m.id == "dlock.W070"] == [
        "dlock.W070"
    ]
