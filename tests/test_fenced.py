"""``fenced_update``: an update a holder with an older fencing number cannot make."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from django.db import connections, models

import django_dlock as dlock
from django_dlock.exceptions import DLockError
from django_dlock.fencing import FencedQuerySet, FenceField, fenced_update

from . import procs
from .fenced_holder import stale_holder
from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


class Account(models.Model):
    """A user's model: the fence of the last write beside the data."""

    balance = models.IntegerField(default=0)
    fence = FenceField()

    objects = FencedQuerySet.as_manager()

    class Meta:
        app_label = "django_dlock"
        db_table = "dlock_test_fenced_account"


class Plain(models.Model):
    balance = models.IntegerField(default=0)

    class Meta:
        app_label = "django_dlock"
        db_table = "dlock_test_fenced_plain"


@pytest.fixture(params=["default", "sqlite", "mysql"], ids=["postgresql", "sqlite", "mariadb"])
def alias(request: pytest.FixtureRequest) -> Iterator[str]:
    using = request.param
    with connections[using].cursor() as cur:  # left by an interrupted run
        for model in (Account, Plain):
            cur.execute(f"DROP TABLE IF EXISTS {model._meta.db_table}")
    with connections[using].schema_editor() as editor:
        for model in (Account, Plain):
            editor.create_model(model)
    Account.objects.using(using).create(pk=1)
    yield using
    with connections[using].schema_editor() as editor:
        editor.delete_model(Account)
        editor.delete_model(Plain)


def _row(alias: str) -> tuple[int, int]:
    found = Account.objects.using(alias).get(pk=1)
    return found.balance, found.fence


def test_a_write_with_the_holders_fence_is_made_and_keeps_the_fence(alias):
    rows = Account.objects.using(alias).filter(pk=1)
    with dlock.lock("fenced:write", using=alias) as lk:
        assert fenced_update(rows, lk, balance=10) == 1
        assert _row(alias) == (10, lk.fence)
        assert rows.fenced_update(lk, balance=11) == 1  # the same holder, again
    assert _row(alias)[0] == 11


def test_an_older_fence_is_refused_and_changes_nothing(alias):
    rows = Account.objects.using(alias).filter(pk=1)
    assert fenced_update(rows, 7, balance=70) == 1
    with pytest.raises(dlock.StaleFence, match="fence 6 is stale"):
        fenced_update(rows, 6, balance=60)
    assert _row(alias) == (70, 7)
    assert issubclass(dlock.StaleFence, dlock.LockLost)


def test_rows_with_an_older_fence_are_updated_and_newer_ones_reported(alias):
    Account.objects.using(alias).create(pk=2, fence=9)
    rows = Account.objects.using(alias).filter(pk__in=[1, 2])
    with pytest.raises(dlock.StaleFence, match="1 row"):
        fenced_update(rows, 5, balance=50)
    assert _row(alias) == (50, 5)
    assert Account.objects.using(alias).get(pk=2).balance == 0


def test_a_lock_without_a_fence_and_a_model_without_a_fence_field_are_named(alias):
    rows = Account.objects.using(alias).filter(pk=1)
    with pytest.raises(DLockError, match="no fencing number"):
        fenced_update(rows, dlock.lock("fenced:not-held", using=alias), balance=1)
    with pytest.raises(DLockError, match="has no FenceField"):
        fenced_update(Plain.objects.using(alias).all(), 3, balance=1)
    with pytest.raises(DLockError, match="not True"):
        fenced_update(rows, True, balance=1)
    assert _row(alias) == (0, 0)


@pytest.mark.slow
def test_a_holder_paused_past_its_lease_cannot_overwrite_its_successor(alias, tmp_path):
    proc = procs.start(stale_holder, alias, str(tmp_path))
    wait_until(lambda: (tmp_path / "fence").exists(), timeout=60)
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        # its lease runs out; the successor takes the lock and writes
        with dlock.lock("fenced:paused", using=alias, ttl=30, timeout=30) as lk:
            assert lk.fence > int((tmp_path / "fence").read_text())
            fenced_update(Account.objects.using(alias).filter(pk=1), lk, balance=100)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        (tmp_path / "go").write_text("go")
    proc.join(60)
    assert proc.exitcode == 0
    assert (tmp_path / "outcome").read_text() == "StaleFence"
    assert _row(alias)[0] == 100  # the successor's write stands
