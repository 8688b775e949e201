"""Bad keys and arguments: each gives its named error and touches no row.

Checked on every database with a query counter (no SQL at all) and the
lock table's row count (unchanged).
"""

from __future__ import annotations

import math

import pytest
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
