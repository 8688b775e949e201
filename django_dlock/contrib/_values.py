"""Arguments as key text: one text per value, distinct for distinct values.

Shared by the Celery integration (``lock_args``) and the Tasks one (key
templates): ``42`` and ``"42"``, ``None`` and ``"None"`` never give the same
text, and a ``:`` inside a string cannot shift the boundary between two values.
"""

from __future__ import annotations

import datetime
import decimal
import json
import uuid

from django_dlock.exceptions import InvalidLockKey

__all__ = ["encode_value"]

#: types encoded by their ``repr()``, which is stable across processes and,
#: starting with a letter other than ``t``, ``f`` or ``n``, never a JSON literal
_REPR_TYPES = (
    uuid.UUID,
    decimal.Decimal,
    datetime.datetime,
    datetime.date,
    datetime.time,
    datetime.timedelta,
)


def encode_value(value: object) -> str:
    """One argument value as text, distinct for distinct values and types.

    JSON values are their compact JSON literal (``42``, ``"42"``, ``null``,
    ``true``, ``[1,"a"]``, a dict with its keys sorted); a tuple is a list and
    a dict key a string, as Celery's JSON serializer sends them. ``UUID``, ``Decimal`` and the
    ``datetime`` types are their ``repr()``. Any other type raises
    :class:`~django_dlock.exceptions.InvalidLockKey`: it has no text that is
    the same in every process.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ",".join(encode_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = sorted((encode_value(_dict_key(k)), encode_value(v)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, _REPR_TYPES):
        return repr(value)
    raise InvalidLockKey(
        f"a lock key argument of type {type(value).__qualname__} has no stable text: "
        "use arguments of JSON types (str, int, float, bool, None, list, dict), "
        "UUID, Decimal or datetime"
    )


def _dict_key(key: object) -> str:
    """A dict key as JSON sends it (a string: ``1`` arrives as ``"1"``)."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, bool | int | float):
        return json.dumps(key)
    raise InvalidLockKey(
        f"a lock key argument is a dict with a key of type {type(key).__qualname__}: "
        "use str, int, float, bool or None keys"
    )
