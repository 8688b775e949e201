"""Bad keys and arguments: each gives its named error and touches no row.

Checked on every database with a query counter (no SQL at all) and the
lock table's row count (unchanged).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from django.core.exceptions import SynchronousOnlyOperation
from django.db import connections
from django.test.utils import CaptureQueriesContext

import django_dlock as dlock
from django_dlock.models import Lock as LockRow

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

BAD_KEYS = [
    ("", dlock.InvalidLockKey),
    ("k" * 256, dlock.InvalidLockKey),
    ("nul\x00byte", dlock.InvalidLockKey),
    (12, dlock.InvalidLockKey),
    (1.5, dlock.InvalidLockKey),
    (b"bytes", dlock.InvalidLockKey),
    (object(), dlock.InvalidLockKey),
    ((2**31, 1), dlock.InvalidLockKey),
    ((1, -(2**31) - 1), dlock.InvalidLockKey),
    ((2**63, 1), dlock.InvalidLockKey),
    ((1, 2, 3), dlock.InvalidLockKey),
    ([], dlock.InvalidLockKey),
    (["ok", ""], dlock.InvalidLockKey),
    (("a" * 200, "b" * 200), dlock.InvalidLockKey),
]

BAD_OPTIONS = [
    ({"ttl": 0}, ValueError),
    ({"ttl": -1}, ValueError),
    ({"ttl": math.nan}, ValueError),
    ({"ttl": math.inf}, ValueError),
    ({"ttl": "30"}, ValueError),
    ({"timeout": -0.5}, ValueError),
    ({"timeout": math.nan}, ValueError),
    ({"max_hold": -1}, ValueError),
    ({"max_hold": math.inf}, ValueError),
    ({"retry_interval": math.nan}, ValueError),
    ({"retry_interval": 1e12}, ValueError),
    ({"ttl": 1e12}, ValueError),
    ({"max_hold": 1e12}, ValueError),
    ({"on_fail": "ignore"}, ValueError),
    ({"strategy": "zookeeper"}, dlock.StrategyNotSupported),
    ({"strategy": None, "using": "no-such-db"}, ValueError),
]


def _untouched(alias, action, error):
    before = LockRow.objects.using(alias).count()
    with CaptureQueriesContext(connections[alias]) as queries, pytest.raises(error) as info:
        action()
    assert len(queries) == 0, [q["sql"] for q in queries]
    assert LockRow.objects.using(alias).count() == before
    assert str(info.value)  # a message that says what is wrong


@pytest.mark.parametrize(("key", "error"), BAD_KEYS, ids=[repr(k)[:20] for k, _ in BAD_KEYS])
def test_bad_keys(alias, key, error):
    _untouched(alias, lambda: dlock.lock(key, using=alias).acquire(timeout=0), error)


@pytest.mark.parametrize(("options", "error"), BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_options(alias, options, error):
    options = {"using": alias, **options}
    if options.get("strategy", "") is None:
        del options["strategy"]
    _untouched(alias, lambda: dlock.lock("k", **options).acquire(timeout=0), error)


@pytest.mark.parametrize("timeout", [-1, math.nan, "5"])
def test_bad_timeout_at_acquire(alias, timeout):
    _untouched(alias, lambda: dlock.lock("k", using=alias).acquire(timeout=timeout), ValueError)


def test_bad_ttl_at_extend(alias):
    with dlock.lock("k", using=alias) as lk:
        _untouched(alias, lambda: lk.extend(-5), ValueError)


@pytest.mark.parametrize(
    ("alias", "strategy", "options"),
    [
        ("sqlite", "advisory", {}),
        ("sqlite", "advisory_xact", {}),
        ("mysql", "advisory_xact", {}),
        ("mysql", "advisory", {"shared": True}),  # GET_LOCK has no shared mode
        # a shared row lock would be an exclusive one: refused, not weakened
        ("default", "row", {"shared": True}),
        ("mysql", "row", {"shared": True}),
    ],
)
def test_strategy_the_database_cannot_do(alias, strategy, options):
    _untouched(
        alias,
        lambda: dlock.lock("k", using=alias, strategy=strategy, **options).acquire(timeout=0),
        dlock.StrategyNotSupported,
    )


def test_row_strategy_refused_on_sqlite():
    _untouched(
        "sqlite",
        lambda: dlock.lock("k", using="sqlite", strategy="row").acquire(timeout=0),
        dlock.StrategyNotSupported,
    )


# -- sync calls from async code -------------------------------------------------

SYNC_CALLS = {
    "with": lambda lk: lk.__enter__(),
    "acquire": lambda lk: lk.acquire(timeout=0),
    "release": lambda lk: lk.release(),
    "extend": lambda lk: lk.extend(),
    "locked": lambda lk: lk.locked(),
    "enqueue": lambda lk: lk.enqueue(),
    "wait": lambda lk: lk.wait(timeout=0),
}


@pytest.mark.parametrize("call", SYNC_CALLS)
def test_sync_call_from_async_code_is_a_named_error(alias, call, monkeypatch):
    monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE", raising=False)

    async def main():
        SYNC_CALLS[call](dlock.lock("k", using=alias))

    _untouched(alias, lambda: asyncio.run(main()), dlock.SyncInAsyncContext)
    with pytest.raises(SynchronousOnlyOperation) as info:  # Django's handlers still catch it
        asyncio.run(main())
    assert isinstance(info.value, dlock.DLockError)
    assert "async with dlock.lock(" in str(info.value)
    assert "await lk.a" in str(info.value) or "sync_to_async" in str(info.value)


def test_sync_call_from_async_code_with_django_allow_async_unsafe(alias, monkeypatch):
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

    async def main():
        with dlock.lock("k", using=alias, timeout=0) as lk:
            return lk.held()

    assert asyncio.run(main()) is True
    assert not LockRow.objects.using(alias).held().exists()  # released on leaving


def test_async_calls_still_work_from_async_code(alias, monkeypatch):
    monkeypatch.delenv("DJANGO_ALLOW_ASYNC_UNSAFE", raising=False)

    async def main():
        async with dlock.lock("k", using=alias, timeout=0) as lk:
            # held() and owned() are sync, but query off the loop: allowed
            return await lk.aheld(), lk.held(), lk.owned(), await lk.aowned()

    assert asyncio.run(main()) == (True, True, True, True)


# -- transaction-scoped strategies outside a transaction -------------------------


@pytest.mark.parametrize(
    ("alias", "strategy"),
    [("default", "advisory_xact"), ("default", "row"), ("mysql", "row")],
)
def test_transaction_scoped_strategy_outside_a_transaction(alias, strategy):
    lk = dlock.lock("k", using=alias, strategy=strategy)
    _untouched(alias, lambda: lk.acquire(timeout=0), dlock.TransactionRequired)
    with pytest.raises(dlock.TransactionRequired) as info:
        asyncio.run(lk.aacquire(timeout=0))
    message = str(info.value)
    assert f"transaction.atomic(using={alias!r})" in message
    assert "lock_and_atomic(" in message
    assert isinstance(info.value, dlock.DLockError)


# -- key templates ----------------------------------------------------------------


def test_key_template_errors_are_public(alias):
    from django_dlock import exceptions
    from django_dlock.decorators import with_lock

    assert dlock.KeyTemplateError is exceptions.KeyTemplateError
    assert dlock.MissingKeyArgument is exceptions.MissingKeyArgument
    assert {"KeyTemplateError", "MissingKeyArgument"} <= set(exceptions.__all__)
    assert {"KeyTemplateError", "MissingKeyArgument"} <= set(dlock.__all__)
    with pytest.raises(dlock.KeyTemplateError, match="only plain argument names"):
        with_lock("invoice:{invoice.pk}", using=alias)

    @with_lock("invoice:{invoice_id}", using=alias)
    def pay(**kwargs):
        return "paid"

    _untouched(alias, lambda: pay(order_id=1), dlock.MissingKeyArgument)


# -- unknown database aliases -------------------------------------------------------


def _leader(using):
    return dlock.LeaderElection("x", using=using)


def _with_lock(using):
    from django_dlock.decorators import with_lock

    return with_lock("k", using=using)


@pytest.mark.parametrize(
    "make",
    [
        lambda using: dlock.lock("k", using=using),
        lambda using: dlock.lock("k", using=["default", using]),
        lambda using: dlock.TaskLock("k", using=using),
        _leader,
        _with_lock,
    ],
    ids=["lock", "quorum", "tasklock", "leader", "with_lock"],
)
def test_unknown_database_alias_lists_the_known_ones(make):
    with pytest.raises(ValueError, match="unknown database alias 'no-such-db'") as info:
        make("no-such-db")
    known = ", ".join(connections)
    assert f"(known: {known})" in str(info.value)
