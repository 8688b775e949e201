"""The testing kit (``django_dlock.testing``), tested with its own helpers on every
database: assertions, another holder, the three faults that make a held lock lost,
reset, its pytest fixtures, and use from a Django ``TransactionTestCase``."""

from __future__ import annotations

import logging

import pytest
from django.test import TransactionTestCase

import django_dlock as dlock
from django_dlock import notify, signals
from django_dlock import testing as kit

# the kit's pytest fixtures, as a user's conftest.py would list them
from django_dlock.testing.fixtures import _dlock_close_connections, dlock_testing  # noqa: F401

from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def test_assertions_and_another_holder(alias):
    kit.assert_not_locked("report", using=alias)
    with kit.held_elsewhere("report", using=alias) as other:
        kit.assert_locked("report", using=alias)
        with pytest.raises(AssertionError, match=r"lock:report is locked in .* by .*thread="):
            kit.assert_not_locked("report", using=alias)
        # this thread is another holder: it cannot take the key
        assert dlock.lock("report", using=alias).acquire(timeout=0) is False
        assert other.name == "lock:report"
    kit.assert_not_locked("report", using=alias)
    with pytest.raises(AssertionError, match="lock:report is not locked"):
        kit.assert_locked("report", using=alias)


def test_a_semaphore_is_locked_when_every_permit_is_held(alias):
    sem = dlock.semaphore("exports", permits=2, using=alias)
    with kit.held_elsewhere(sem):
        kit.assert_not_locked(sem)  # a permit is still free
        with sem:
            kit.assert_locked(sem)
            with pytest.raises(AssertionError, match="#0 by .*#1 by"):
                kit.assert_not_locked(sem)


def test_expire_makes_a_held_lease_lost(alias, caplog):
    losses: list[dlock.LockLost] = []
    lk = dlock.lock("import", using=alias, ttl=60, on_lost=losses.append)
    with pytest.raises(dlock.LockLost, match="expired"), lk:
        assert kit.expire(lk) == 1
        assert lk.owned() is False
    assert len(losses) == 1
    # logged once at WARNING, its facts as the record's attributes
    lost = [r for r in caplog.records if r.getMessage().startswith("django-dlock: lost")]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING
    assert lost[0].lock_name == "lock:import" and "expired" in lost[0].lock_reason
    assert kit.expire(lk) == 0  # nothing held: nothing to end


def test_force_release_is_an_operators_release(alias, caplog):
    seen: list[str] = []

    def receiver(sender, name, source, **kwargs):
        seen.append(f"{name} {source}")

    signals.lock_force_released.connect(receiver)
    try:
        lk = dlock.lock("nightly", using=alias, ttl=60)
        assert lk.acquire(timeout=0)
        assert kit.force_release(lk) == 1
        with pytest.raises(dlock.LockLost):
            lk.extend()
        with pytest.raises(dlock.LockNotOwned):
            lk.release()
    finally:
        signals.lock_force_released.disconnect(receiver)
    assert seen == ["lock:nightly test"]
    forced = [r for r in caplog.records if hasattr(r, "lock_source")]
    assert len(forced) == 1 and forced[0].levelno == logging.WARNING
    assert (forced[0].lock_name, forced[0].lock_source) == ("lock:nightly", "test")


def test_end_session_makes_an_advisory_lock_lost(alias):
    if alias == "sqlite":
        pytest.skip("SQLite has no advisory locks")
    losses: list[dlock.LockLost] = []
    lk = dlock.lock("advisory-job", using=alias, strategy="advisory", on_lost=losses.append)
    assert lk.acquire(timeout=0)
    with pytest.raises(dlock.DLockError, match="ends leases"):
        kit.expire(lk)
    kit.end_session(lk)
    wait_until(lambda: lk.lost and bool(losses), timeout=30)
    with pytest.raises(dlock.LockLost):
        lk.release()
    with pytest.raises(dlock.DLockError, match="no advisory session"):
        kit.end_session(lk)


def test_reset_deletes_rows_and_tickets(alias):
    from django_dlock.models import Lock as LockRow

    with dlock.lock("left-behind", using=alias):
        pass
    assert LockRow.objects.using(alias).filter(name="lock:left-behind").exists()
    kit.reset(alias)
    assert not LockRow.objects.using(alias).exists()


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_a_test_that_opens_a_listener(dlock_testing):  # noqa: F811 (the fixture)
    """(With the next test: the kit's fixture closes it after this test.)"""
    assert dlock_testing is kit
    with dlock_testing.held_elsewhere("woken"):
        assert dlock.lock("woken", timeout=0.2).acquire() is False  # waited: listened
    assert notify._listeners


@pytest.mark.django_db(transaction=True, databases=["default"])
def test_the_kit_closed_the_previous_tests_listener():
    assert notify._listeners == {}


class DjangoTestCaseUse(TransactionTestCase):
    """The kit from a Django test case (locks commit: a transactional test case)."""

    databases = {"default"}

    def test_held_elsewhere_and_assertions(self) -> None:
        self.addCleanup(kit.reset)
        with kit.held_elsewhere("invoice:1"):
            kit.assert_locked("invoice:1")
        kit.assert_not_locked("invoice:1")
