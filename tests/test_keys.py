from __future__ import annotations

import hashlib

import pytest

from django_dlock.exceptions import InvalidLockKey
from django_dlock.keys import hash32, hash64, make_key


def test_string_key_is_namespaced_and_hashed_to_signed_int8():
    key = make_key("invoice:42")
    assert key.name == "lock:invoice:42"
    digest = hashlib.sha256(b"lock:invoice:42").digest()
    assert key.advisory == (int.from_bytes(digest[:8], "big", signed=True),)


def test_hash_is_stable_across_releases():
    # Published mapping (docs: keys): changing it would split a running fleet.
    assert hash64("lock:x") == 5840596826904312391
    assert hash32("order") == 1055620758


def test_namespaces_keep_primitives_apart():
    names = {make_key("x", ns).name for ns in ("lock", "task", "leader")}
    assert names == {"lock:x", "task:x", "leader:x"}
    assert len({make_key("x", ns).advisory for ns in ("lock", "task", "leader")}) == 3


def test_two_part_keys_map_to_two_int4():
    assert make_key((1, 2)).advisory == (1, 2)
    assert make_key(("order", 42)).advisory == (hash32("order"), 42)
    assert make_key(("order", 42)).name == "lock('order', 42)"
    assert make_key((-(2**31), 2**31 - 1)).advisory == (-(2**31), 2**31 - 1)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "must not be empty"),
        ("x" * 256, "256 characters long"),
        ("a\x00b", "NUL byte"),
        ("\udcff", "not valid unicode"),
        (42, "not int"),
        (4.2, "not float"),
        (b"bytes", "not bytes"),
        (None, "not NoneType"),
        ((1, 2, 3), "exactly two parts"),
        ((2**31, 0), "outside the int4 range"),
        ((0, -(2**31) - 1), "outside the int4 range"),
        ((2**63, 0), "outside the int4 range"),
        ((1.5, 2), "must be an int or a str"),
        ((True, 2), "must be an int or a str"),
        (("", 2), "must not be empty"),
        ("report#reader:0123456789abcdef", "must not contain '#reader:', which is reserved"),
        ("report#READER:upgradeable", "must not contain '#reader:', which is reserved"),
    ],
)
def test_bad_keys_are_rejected_with_a_clear_error(key, message):
    with pytest.raises(InvalidLockKey, match=message):
        make_key(key)


def test_longest_key_is_accepted():
    assert make_key("é" * 255).name == "lock:" + "é" * 255


@pytest.mark.django_db
def test_model_instance_key():
    from django.contrib.auth.models import User

    user = User.objects.create(username="ada")
    assert make_key(user).name == f"lock:auth.user:{user.pk}"
    with pytest.raises(InvalidLockKey, match="unsaved"):
        make_key(User(username="nobody"))


def test_the_reserved_infix_is_the_one_reader_rows_use():
    from django_dlock.keys import RESERVED_INFIXES
    from django_dlock.strategies.lease.shared import READER_INFIX

    assert READER_INFIX in RESERVED_INFIXES


@pytest.mark.django_db(transaction=True)
def test_a_key_with_the_reader_infix_cannot_keep_writers_of_another_key_out():
    import django_dlock as dlock

    with pytest.raises(InvalidLockKey, match="reserved"):
        dlock.lock("doc#reader:0123456789abcdef", ttl=30).acquire(timeout=0)
    with dlock.lock("doc", ttl=30, timeout=0):  # nobody reads "doc"
        pass


def test_a_key_rendered_from_request_data_with_the_reader_infix_is_hashed():
    from django_dlock._http import fit_key

    rendered = fit_key("doc:x#reader:0123456789abcdef")
    assert rendered.startswith("sha256:"), rendered
    assert make_key(rendered).name == f"lock:{rendered}"
