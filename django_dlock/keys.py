"""Lock keys: validation, namespacing and the mapping to advisory-lock keys.

A key is one of:

* a string of 1 to 255 characters with no NUL byte;
* a two-part tuple ``(a, b)`` whose parts are ints in the int4 range or
  strings (hashed to int4);
* a saved Django model instance, named ``"<app_label>.<model>:<pk>"``.

Each primitive prefixes its namespace (``lock``, ``task``, ``leader``, ``semaphore``) to
form the stored name, so ``lock("x")`` and ``TaskLock("x")`` never collide.
Distinct keys get distinct names, which the admin shows as they are:

* a string key ``"x"`` is stored as ``lock:x``;
* a two-part key ``("order", 42)`` is stored as ``lock('order', 42)``: the
  parts as Python literals (a string part quoted, an int part in digits)
  in parentheses right after the namespace. A string key's name always has
  ``:`` there, so no string can name the same lock as a two-part key;
* a model instance is the string key ``"<app_label>.<model>:<pk>"``.

The whole stored name must fit the ``name`` column
(:data:`MAX_NAME_LENGTH` characters): a longer one is refused with
:class:`InvalidLockKey`, never stored truncated.

Advisory keys (PostgreSQL) are derived from the namespaced name with a stable
hash, never Python's ``hash()``:

* a string key maps to ``pg_advisory_lock(bigint)`` with the first 8 bytes of
  ``SHA-256(name)`` read as a big-endian signed 64-bit integer;
* a two-part key maps to ``pg_advisory_lock(int4, int4)``: an int part is used
  as is, a string part is the first 4 bytes of ``SHA-256(part)`` read as a
  big-endian signed 32-bit integer. In ``pg_locks`` the lock shows as
  ``classid = a``, ``objid = b`` (as unsigned oids), ``objsubid = 2``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from django.db import models

from django_dlock.exceptions import InvalidLockKey

MAX_KEY_LENGTH = 255
#: ``max_length`` of the ``name`` column of the ``Lock`` model (the stored name)
MAX_NAME_LENGTH = 300
INT4_MIN, INT4_MAX = -(2**31), 2**31 - 1

KeyPart = int | str
#: one key: a string, a two-part tuple, or a saved model instance
KeyLike = str | tuple[KeyPart, KeyPart] | models.Model
#: what a lock takes: one key, or a collection of keys locked all or none
LockKey = KeyLike | list[KeyLike] | set[KeyLike] | frozenset[KeyLike]

NAMESPACES = ("lock", "task", "leader", "semaphore")

#: parts of a stored name that the library writes for rows of its own, and
#: what they name. A key containing one (in any case: MySQL/MariaDB compare
#: names without case) could name such a row of another key, so it is refused.
RESERVED_INFIXES = {
    "#reader:": "a read-write lock's readers hold their key in rows named '<key>#reader:<holder>'",
}


@dataclass(frozen=True, order=True)
class Key:
    """A validated key: the stored ``name`` and the advisory-lock arguments."""

    name: str
    advisory: tuple[int, ...]

    def __str__(self) -> str:
        return self.name

    @property
    def unqualified(self) -> str:
        """The name without its namespace: ``"x"``, or ``"('order', 42)"``."""
        namespace, colon, rest = self.name.partition(":")
        if colon and namespace in NAMESPACES:
            return rest
        for namespace in NAMESPACES:
            if self.name.startswith(namespace + "("):
                return self.name[len(namespace) :]
        return self.name


def hash64(text: str) -> int:
    """Stable signed 64-bit hash of ``text`` (SHA-256, first 8 bytes, big-endian)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def hash32(text: str) -> int:
    """Stable signed 32-bit hash of ``text`` (SHA-256, first 4 bytes, big-endian)."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big", signed=True)


def _check_string(value: str, what: str) -> None:
    if not value:
        raise InvalidLockKey(f"{what} must not be empty")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidLockKey(
            f"{what} is {len(value)} characters long; the maximum is {MAX_KEY_LENGTH}"
        )
    if "\x00" in value:
        raise InvalidLockKey(f"{what} must not contain a NUL byte")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidLockKey(f"{what} is not valid unicode text: {exc}") from None


def _check_reserved(value: str) -> None:
    folded = value.casefold()
    for infix, why in RESERVED_INFIXES.items():
        if infix in folded:
            raise InvalidLockKey(
                f"a lock key must not contain {infix!r}, which is reserved ({why}): "
                f"{value!r} could name such a row of another key"
            )


def _part(value: object, index: int) -> tuple[str, int]:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidLockKey(
            f"part {index} of a two-part key must be an int or a str, not {type(value).__name__}"
        )
    if isinstance(value, int):
        if not INT4_MIN <= value <= INT4_MAX:
            raise InvalidLockKey(
                f"part {index} of a two-part key ({value}) is outside the int4 range "
                f"[{INT4_MIN}, {INT4_MAX}]"
            )
        return str(value), value
    _check_string(value, f"part {index} of a two-part key")
    return repr(value), hash32(value)


def model_key(instance: models.Model) -> str:
    """The key string of a saved model instance: ``app_label.model:pk``."""
    if instance.pk is None:
        raise InvalidLockKey(f"cannot lock an unsaved {type(instance).__name__} (pk is None)")
    return f"{instance._meta.label_lower}:{instance.pk}"


#: (namespace, str key) -> its Key: a key used again is not validated and hashed again
_MADE: dict[tuple[str, str], Key] = {}
#: entries kept before the cache starts afresh (a key is about 200 bytes)
_MADE_MAX = 4096


def make_key(key: Any, namespace: str = "lock") -> Key:
    """Validate ``key`` and return its namespaced :class:`Key`.

    Raises:
        InvalidLockKey: the key is empty, too long, has a NUL byte, contains
            a reserved part (:data:`RESERVED_INFIXES`), is of a type that is
            not a key, or a part is out of the int4 range.
    """
    if type(key) is str:
        made = _MADE.get((namespace, key))
        if made is None:
            made = _make_key(key, namespace)
            if len(_MADE) >= _MADE_MAX:
                _MADE.clear()
            _MADE[(namespace, key)] = made
        return made
    return _make_key(key, namespace)


def _make_key(key: Any, namespace: str) -> Key:
    if namespace not in NAMESPACES:
        raise ValueError(f"unknown namespace {namespace!r}")
    if isinstance(key, models.Model):
        key = model_key(key)
    if isinstance(key, str):
        _check_string(key, "a lock key")
        _check_reserved(key)
        name = f"{namespace}:{key}"
        return Key(name=name, advisory=(hash64(name),))
    if isinstance(key, tuple):
        if len(key) != 2:
            raise InvalidLockKey(f"a tuple key must have exactly two parts, got {len(key)}")
        text_a, int_a = _part(key[0], 0)
        text_b, int_b = _part(key[1], 1)
        name = f"{namespace}({text_a}, {text_b})"
        if len(name) > MAX_NAME_LENGTH:
            raise InvalidLockKey(
                f"the two-part key's stored name is {len(name)} characters long; the "
                f"maximum is {MAX_NAME_LENGTH} (use shorter parts)"
            )
        return Key(name=name, advisory=(int_a, int_b))
    raise InvalidLockKey(
        "a lock key must be a str, a two-part tuple or a saved model instance, "
        f"not {type(key).__name__}"
    )


def pg_locks_ids(key: Key) -> tuple[int, int, int]:
    """Where ``key`` shows in ``pg_locks``: ``(classid, objid, objsubid)``.

    A one-part (bigint) key ``k`` is split into its high and low 32 bits,
    read as unsigned: ``classid = (k >> 32) & 0xFFFFFFFF``,
    ``objid = k & 0xFFFFFFFF``, ``objsubid = 1``. A two-part key ``(a, b)``
    shows as ``classid = a & 0xFFFFFFFF``, ``objid = b & 0xFFFFFFFF``,
    ``objsubid = 2`` (negative parts wrap around to unsigned oids).
    """
    if len(key.advisory) == 1:
        (k,) = key.advisory
        return (k >> 32) & 0xFFFFFFFF, k & 0xFFFFFFFF, 1
    a, b = key.advisory
    return a & 0xFFFFFFFF, b & 0xFFFFFFFF, 2
