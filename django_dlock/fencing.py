"""Fenced writes: an update that a holder with an older fencing number cannot make.

For data that ``Lock.guard()`` cannot cover (another database than the
lock's, or a lock whose strategy refuses a guard), the resource itself
refuses a stale holder: each row keeps the fencing number of the last write
it accepted, and a write with an older number changes nothing (Martin
Kleppmann, "How to do distributed locking",
https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html)::

    class Account(models.Model):
        balance = models.IntegerField()
        fence = FenceField()

    with dlock.lock(("account", 42), ttl=30) as lk:
        balance = compute()
        fenced_update(Account.objects.filter(pk=42), lk, balance=balance)

The check and the write are one ``UPDATE`` statement (``... SET balance =
%s, fence = %s WHERE pk = 42 AND fence <= %s``), atomic on every database.
"""

from __future__ import annotations

from typing import Any

from django.db import models

from django_dlock.exceptions import DLockError, StaleFence

__all__ = ["FenceField", "FencedQuerySet", "fenced_update"]


class FenceField(models.PositiveBigIntegerField):  # type: ignore[type-arg]
    """The fencing number of the last fenced write a row accepted (``0``: none yet)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("default", 0)
        super().__init__(*args, **kwargs)


def fenced_update(queryset: models.QuerySet[Any], fence: Any, **values: Any) -> int:
    """Update the rows of ``queryset`` with ``values``, fenced by ``fence``.

    ``fence`` is a held lock (its :attr:`~django_dlock.Lock.fence`) or a
    fencing number (an ``int`` handed on, to a Celery task for instance).
    Rows whose stored fence is not newer than it are updated, and store it;
    the same holder may write as often as it likes. Returns the number of
    rows updated, as ``QuerySet.update()`` does.

    Raises:
        StaleFence: a row of ``queryset`` holds a newer fence: a newer holder
            wrote it, and this write was refused there (rows with an older
            fence were updated). Checked after the update, so a newer write
            that lands at the same moment is reported too.
        DLockError: ``fence`` is a lock without a fencing number (not held,
            or its strategy issues none), or the model has no
            :class:`FenceField` (or more than one).
    """
    number = _number(fence)
    field = _fence_field(queryset.model)
    updated = queryset.filter(**{f"{field}__lte": number}).update(**values, **{field: number})
    newer = queryset.filter(**{f"{field}__gt": number}).values_list(field, flat=True)
    found = max(newer, default=None)
    if found is not None:
        raise StaleFence(
            f"fence {number} is stale for {queryset.model.__name__}: a newer holder wrote "
            f"with fence {found}; {updated} row(s) with an older fence were updated"
        )
    return updated


class FencedQuerySet(models.QuerySet):  # type: ignore[type-arg]
    """A queryset with :meth:`fenced_update` (``objects = FencedQuerySet.as_manager()``)."""

    def fenced_update(self, fence: Any, **values: Any) -> int:
        """:func:`fenced_update` of this queryset."""
        return fenced_update(self, fence, **values)


def _number(fence: Any) -> int:
    if isinstance(fence, bool):
        raise DLockError(f"a fence is a held lock or a fencing number, not {fence!r}")
    if isinstance(fence, int):
        return fence
    number = getattr(fence, "fence", None)
    if not isinstance(number, int):
        raise DLockError(
            f"{fence!r} has no fencing number: it is not held by this thread or task, or "
            "its strategy issues none (see Fencing in the django-dlock docs)"
        )
    return number


def _fence_field(model: type[models.Model]) -> str:
    found = [f.name for f in model._meta.concrete_fields if isinstance(f, FenceField)]
    if len(found) != 1:
        what = "no FenceField" if not found else f"several FenceFields ({', '.join(found)})"
        raise DLockError(
            f"{model.__name__} has {what}: a fenced update needs exactly one, where each "
            "row keeps the fence of its last write"
        )
    return found[0]
