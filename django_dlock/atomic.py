"""``lock_and_atomic``: a lock and a transaction, so the write commits before the lock goes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal

from django.db import connections, transaction

from django_dlock.keys import LockKey
from django_dlock.locks import Lock, LockOptions
from django_dlock.strategies import traits

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

logger = logging.getLogger("django_dlock")


@contextmanager
def lock_and_atomic(
    key: LockKey,
    *,
    using: str | None = None,
    savepoint: bool = True,
    durable: bool = False,
    **options: Unpack[LockOptions],
) -> Iterator[Lock[Literal["raise"]]]:
    """Hold a lock around a ``transaction.atomic`` block, released after the commit.

    Whatever the block writes is committed (or rolled back) *before* the
    lock can pass to someone else, so the next holder always sees it::

        with dlock.lock_and_atomic(("invoice", invoice.pk), strategy="advisory_xact"):
            invoice.refresh_from_db()
            invoice.paid = True
            invoice.save()

    With a transaction-scoped strategy (``advisory_xact``, ``row``) the lock
    is taken inside the transaction and the database releases it at commit
    or rollback. With ``lease`` or ``advisory`` the lock is taken first, the
    transaction runs inside it, and the lock is released once it has
    committed. Also a decorator (``@lock_and_atomic("key")``).

    Inside an outer transaction only the transaction-scoped strategies keep
    that promise (their lock lasts until the outer commit); with ``lease`` or
    ``advisory`` the writes would commit after the release, and a warning is
    logged.

    Args:
        key: the lock's key (see :class:`~django_dlock.locks.Lock`).
        using: the database alias of the lock *and* of the transaction.
        savepoint: passed to ``transaction.atomic``.
        durable: passed to ``transaction.atomic``.
        **options: the other arguments of :class:`~django_dlock.locks.Lock`
            (``strategy``, ``timeout``, ``ttl``, ``shared`` ...; see
            :class:`~django_dlock.locks.LockOptions`), but ``on_fail``: a
            ``with`` block cannot skip.

    Raises:
        LockTimeout: the lock could not be acquired within the timeout
            (nothing was written).
    """
    lk = Lock(key, using=using, **options)
    alias = lk.alias
    atomic = transaction.atomic(using=alias, savepoint=savepoint, durable=durable)
    if traits(lk.strategy_name)[1]:  # transaction-scoped
        with atomic, lk:
            yield lk
        return
    if connections[alias].in_atomic_block:
        logger.warning(
            "django-dlock: lock_and_atomic(%r) with the %s strategy inside an outer "
            "transaction: the writes commit with the outer transaction, after the lock "
            "is released; use advisory_xact or row here",
            lk.name,
            lk.strategy_name,
        )
    with lk, atomic:
        yield lk
