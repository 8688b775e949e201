"""The lock key of a ``SingleInstanceTask``: distinct argument values, distinct keys.

No worker and no database: ``lock_key`` is a pure function of the call.
"""

from __future__ import annotations

import datetime
import decimal
import uuid
from typing import Any

import pytest
from celery import Celery

from django_dlock.contrib.celery import SingleInstanceTask
from django_dlock.exceptions import InvalidLockKey
from django_dlock.keys import MAX_KEY_LENGTH, make_key

app = Celery("keys", set_as_current=False)


@app.task(base=SingleInstanceTask, lock_args=["a", "b"], name="billing.charge")
def charge(a: Any, b: Any, amount: int = 0) -> None: ...


@app.task(base=SingleInstanceTask, lock_args="a", name="billing.one")
def one(a: Any) -> None: ...


def key(*args: Any, **kwargs: Any) -> str:
    return charge.lock_key(args, kwargs)


def test_simple_values_stay_readable() -> None:
    assert key(42, "EUR") == 'celery:billing.charge:42:"EUR"'
    assert key(a=42, b=None, amount=5) == "celery:billing.charge:42:null"
    assert one.lock_key((7,), {}) == "celery:billing.one:7"


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("x:y", "z"), ("x", "y:z")),
        ((None, 0), ("None", 0)),
        ((1, 0), ("1", 0)),
        ((True, 0), (1, 0)),
        ((1, 0), (1.0, 0)),
        (('a",', "b"), ("a", '",b')),
        (([1, 2], 0), ("[1,2]", 0)),
        (({"a": 1}, 0), ('{"a":1}', 0)),
        ((uuid.UUID(int=1), 0), (str(uuid.UUID(int=1)), 0)),
        ((decimal.Decimal("1.5"), 0), (1.5, 0)),
        (("sha256:" + "0" * 64, 0), ("x" * 300, 0)),
    ],
)
def test_values_whose_text_was_equal_get_distinct_keys(first: tuple, second: tuple) -> None:
    assert key(*first) != key(*second)


def test_equal_values_give_equal_keys_whatever_the_order_of_a_dict() -> None:
    assert key({"b": 1, "a": [1, (2, 3)]}, 0) == key({"a": [1, [2, 3]], "b": 1}, 0)
    assert key(datetime.date(2024, 1, 2), 0) == key(datetime.date(2024, 1, 2), 0)
    assert key({1: "a"}, 0) == key({"1": "a"}, 0)  # as JSON sends it to the worker
    assert key({1: "a"}, 0) != key({1.0: "a"}, 0)
    with pytest.raises(InvalidLockKey, match="a key of type tuple"):
        key({(1, 2): "a"}, 0)


def test_a_long_value_is_hashed_into_a_valid_key() -> None:
    long_key = key("x" * 240, "y")
    assert len(long_key) <= MAX_KEY_LENGTH
    assert long_key.startswith("celery:billing.charge:sha256:")
    make_key(long_key)  # valid: no InvalidLockKey when the task runs
    assert long_key == key("x" * 240, "y")  # stable
    assert long_key != key("x" * 240, "z")


def test_text_that_is_not_utf8_is_hashed() -> None:
    make_key(key("\ud800", 0))


def test_a_value_without_stable_text_is_refused_by_name() -> None:
    from django_dlock.contrib.celery import encode_value

    with pytest.raises(InvalidLockKey, match="type object has no stable text"):
        encode_value(object())
    with pytest.raises(InvalidLockKey):
        key(object(), 0)


@pytest.mark.parametrize(
    "value",
    [
        uuid.UUID(int=7),
        decimal.Decimal("2.50"),
        datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        datetime.date(2024, 1, 2),
        (1, "a", None),
        {1: "a", "b": [True, 1.5]},
        "ünïcode:\n",
    ],
)
def test_the_worker_locks_the_key_of_a_direct_call(value: Any) -> None:
    """What Celery's JSON serializer delivers to the worker gives the same key."""
    from kombu.utils.json import dumps, loads

    delivered = loads(dumps([value, 0]))
    assert key(*delivered) == key(value, 0)
