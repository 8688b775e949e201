"""docs/coming-from.md: each difference from redis-py, python-redis-lock,
django-pglock and django-mysql that the page claims, checked against our API."""

from __future__ import annotations

import asyncio
import math
from io import StringIO

import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.db import connections

import django_dlock as dlock
from django_dlock.identity import current_holder

from .helpers import expire_now, in_thread, wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def seconds_left(alias: str, name: str) -> float:
    """Seconds until the lease ends, on the database clock."""
    from django_dlock import operations as override

    lease = override.find_lease(alias, name)
    assert lease is not None
    return float(lease.seconds_left)


# -- redis-py ------------------------------------------------------------------


def test_timeout_is_the_wait_and_ttl_the_lease(alias):
    """redis-py: ``timeout`` is the lease, ``blocking_timeout`` the wait.
    Ours: ``ttl`` is the lease, ``timeout`` the wait."""
    holder = dlock.lock("cf-wait", using=alias, ttl=300)
    holder.acquire()
    try:
        waiting = dlock.lock("cf-wait", using=alias, timeout=0.2, retry_interval=0.02)
        with pytest.raises(dlock.LockTimeout):
            in_thread(waiting.__enter__)
        assert 290 < seconds_left(alias, "lock:cf-wait") <= 300
    finally:
        holder.release()


def test_every_lease_has_a_ttl(alias):
    """redis-py and python-redis-lock: no timeout/expire means held forever. Ours: never."""
    assert dlock.lock("cf-ttl", using=alias, ttl=None).ttl == 60.0  # DLOCK_DEFAULT_TTL
    for forever in (math.inf, 0, -1):
        with pytest.raises(ValueError, match="ttl must be a finite number of seconds > 0"):
            dlock.lock("cf-ttl", using=alias, ttl=forever)


def test_extend_sets_the_remaining_time(alias):
    """redis-py's ``extend(t)`` adds t (unless ``replace_ttl=True``). Ours sets it."""
    lk = dlock.lock("cf-extend", using=alias, ttl=300)
    with lk:
        lk.extend(10)
        assert seconds_left(alias, "lock:cf-extend") <= 10  # not 310
        lk.extend(200)
        assert 190 < seconds_left(alias, "lock:cf-extend") <= 200


def test_reentrant_per_holder_and_opt_out(alias):
    """redis-py and python-redis-lock: a second acquire by the owner blocks or raises.
    Ours counts it (released on the last exit); ``reentrant=False`` refuses."""
    lk = dlock.lock("cf-reentry", using=alias)
    with lk:
        with lk:
            assert lk.held()
        assert lk.held()  # still held: one level left
    assert not lk.locked()
    strict = dlock.lock("cf-reentry", using=alias, reentrant=False)
    with strict, pytest.raises(dlock.LockReentrantError):
        strict.acquire()


def test_release_of_a_lease_taken_over_raises_lock_lost(alias):
    """redis-py raises LockNotOwnedError; python-redis-lock NotAcquired. Ours: LockLost."""
    lk = dlock.lock("cf-lost", using=alias, ttl=300)
    lk.acquire()
    expire_now(alias, "lock:cf-lost")
    assert in_thread(lambda: dlock.lock("cf-lost", using=alias).acquire(timeout=0)) is True
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_the_owner_is_the_thread():
    """python-redis-lock: any thread with the Lock object (or its id) can release.
    Ours (like redis-py's thread_local=True): only the thread that acquired it;
    ``release_for(holder)`` hands the release to another thread on purpose."""
    lk = dlock.lock("cf-owner")
    lk.acquire()
    holder = current_holder()
    with pytest.raises(dlock.LockNotOwned):
        in_thread(lk.release)
    assert lk.locked()
    in_thread(lk.release_for, holder)
    assert not lk.locked()


def test_each_asyncio_task_is_an_owner_of_its_own():
    """redis-py and python-redis-lock know no asyncio tasks; django-pglock shares the
    thread's connection. Ours: two tasks in one thread are two owners."""

    async def two_tasks() -> tuple[bool, bool]:
        lk = dlock.lock("cf-tasks", strategy="advisory")
        first = asyncio.Event()
        done = asyncio.Event()

        async def holder() -> bool:
            async with lk:
                first.set()
                await done.wait()
            return True

        async def other() -> bool:
            await first.wait()
            try:
                return await lk.aacquire(timeout=0)
            finally:
                done.set()

        return tuple(await asyncio.gather(holder(), other()))  # type: ignore[return-value]

    assert async_to_sync(two_tasks)() == (True, False)


def test_renewal_keeps_a_lease_past_its_ttl():
    """python-redis-lock ``auto_renewal=True``; ours ``renew=True`` (at about ttl / 3)."""
    from django_dlock.models import Lock as LockRow

    def expire_at():
        return LockRow.objects.get(name="lock:cf-renew").expire_at

    lk = dlock.lock("cf-renew", ttl=1.5, renew=True)
    with lk:
        first = expire_at()
        # The renewal pushes the end of the lease past where the TTL first put it.
        wait_until(lambda: (expire_at() - first).total_seconds() >= 1.0)
        assert lk.owned() and not lk.lost


def test_reset_is_force_release_and_the_holder_learns_it():
    """python-redis-lock ``reset()``: the holder is not told. Ours: ``dlock_release``
    (or the admin), and the holder's next release raises LockLost."""
    lk = dlock.lock("cf-reset", ttl=300)
    lk.acquire()
    call_command("dlock_release", "lock:cf-reset", "--yes", stdout=StringIO())
    assert not lk.locked()
    with pytest.raises(dlock.LockLost):
        lk.release()


# -- django-pglock ---------------------------------------------------------------


def test_with_raises_on_timeout_and_the_decorator_can_skip():
    """django-pglock's context manager yields False on a timeout (side_effect=Return);
    ours raises LockTimeout. Its ``side_effect=pglock.Skip`` is our ``on_fail="skip"``."""
    holder = dlock.lock("cf-pg", strategy="advisory")
    holder.acquire()
    try:

        def with_block() -> None:
            with dlock.lock("cf-pg", strategy="advisory", timeout=0):
                pass

        with pytest.raises(dlock.LockTimeout):
            in_thread(with_block)

        @dlock.lock("cf-pg", strategy="advisory", timeout=0, on_fail="skip")
        def job() -> str:
            return "ran"

        assert in_thread(job) is None
        assert (
            in_thread(lambda: dlock.lock("cf-pg", strategy="advisory").acquire(timeout=0)) is False
        )
    finally:
        holder.release()
    assert job() == "ran"


def test_default_wait_is_forever_unless_configured(settings):
    """django-pglock waits per PostgreSQL's lock_timeout; django-mysql 10 s. Ours:
    ``DLOCK_DEFAULT_TIMEOUT`` (None: forever) unless ``timeout=`` is given."""
    assert dlock.lock("cf-default").timeout is None
    settings.DLOCK_DEFAULT_TIMEOUT = 3
    assert dlock.lock("cf-default").timeout == 3.0


# -- django-mysql ----------------------------------------------------------------


def test_a_lease_survives_its_connection_on_mariadb():
    """django-mysql's GET_LOCK lock ends with its connection. A lease does not: it
    lasts until released or until its TTL, whatever happens to the connection."""
    lk = dlock.lock("cf-conn", using="mysql", ttl=300)
    lk.acquire()
    connections["mysql"].close()  # the holder's connection goes away
    assert in_thread(lambda: dlock.lock("cf-conn", using="mysql").acquire(timeout=0)) is False
    lk.release()  # on a new connection
    assert not lk.locked()


def test_long_names_on_mariadb():
    """django-mysql: names go to GET_LOCK, 64 characters at most. A key may be up
    to 255 characters (stored as is, shown as is)."""
    key = "report:" + "x" * 240
    with dlock.lock(key, using="mysql") as lk:
        assert lk.name == f"lock:{key}" and lk.locked()
        from django_dlock.models import Lock as LockRow

        assert LockRow.objects.using("mysql").filter(name=f"lock:{key}").exists()


def test_is_held_is_locked_and_owner_is_shown(alias):
    """django-mysql ``is_held()`` / ``holding_connection_id()``: ours ``locked()`` and
    the owner (host, pid, thread) in ``dlock_show``, ``dlock_list`` and the admin."""
    lk = dlock.lock("cf-show", using=alias)
    with lk:
        assert in_thread(lambda: dlock.lock("cf-show", using=alias).locked())
        out = StringIO()
        call_command("dlock_show", "lock:cf-show", "--using", alias, stdout=out)
        assert current_holder().owner() in out.getvalue()


# -- celery-once and celery-singleton -------------------------------------------


@pytest.fixture
def celery_charge():
    """A SingleInstanceTask on an app whose broker is kombu's in-memory transport."""
    from celery import Celery

    from django_dlock.contrib.celery import SingleInstanceTask

    app = Celery("cf", broker="memory://", set_as_current=False)

    @app.task(name="cf.charge", base=SingleInstanceTask, lock_args=["invoice_id"])
    def charge(invoice_id, amount):
        return f"charged {amount} on invoice {invoice_id}"

    yield app, charge
    app.close()


def test_every_send_is_sent_and_takes_no_lock(celery_charge):
    """celery-once raises AlreadyQueued on a duplicate send, celery-singleton returns
    the first call's result. Ours sends every call and locks nothing when sending."""
    from django_dlock.models import Lock as LockRow

    app, charge = celery_charge
    first = charge.delay(42, 10)
    second = charge.delay(42, 10)
    assert first.id != second.id
    assert not LockRow.objects.filter(name__startswith="lock:celery:").exists()
    with app.connection_for_write() as conn:
        declared = conn.default_channel.queue_declare(queue="celery", passive=True)
    assert declared.message_count == 2


def test_a_run_while_another_runs_is_skipped_and_a_later_one_runs(celery_charge):
    """Ours dedupes at run time: a run that finds the key held returns None; once the
    other run ended, the same call runs. Other arguments run at once."""
    _, charge = celery_charge
    assert charge.apply(args=(42, 10)).get() == "charged 10 on invoice 42"
    other_run = dlock.lock("celery:cf.charge:42")  # the task's key, held by another holder
    other_run.acquire()
    try:
        assert in_thread(lambda: charge.apply(args=(42, 10)).get()) is None
        assert in_thread(lambda: charge.apply(args=(43, 10)).get()) == "charged 10 on invoice 43"
        # a direct call (not checked by celery-once) takes the same lock
        assert in_thread(charge, 42, 10) is None
    finally:
        other_run.release()
    assert in_thread(lambda: charge.apply(args=(42, 10)).get()) == "charged 10 on invoice 42"


def test_on_locked_retry_instead_of_graceful(celery_charge):
    """celery-once's ``graceful`` silences the duplicate; ours skips by default and
    ``on_locked="retry"`` retries the run later instead."""
    from celery.exceptions import Retry

    _, charge = celery_charge
    charge.on_locked = "retry"
    other_run = dlock.lock("celery:cf.charge:7")
    other_run.acquire()
    try:
        with pytest.raises(Retry):
            in_thread(charge, 7, 1)
    finally:
        other_run.release()
