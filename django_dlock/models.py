"""The ``Lock`` model: one row per lease (held, or free and keeping its history)."""

from __future__ import annotations

from django.db import models

from django_dlock.dbclock import DbNow
from django_dlock.tables import FENCE_FLOOR_TABLE, LOCK_TABLE, WAITER_TABLE


class LockQuerySet(models.QuerySet["Lock"]):
    """Queries judged on the database clock."""

    def held(self) -> LockQuerySet:
        """Leases whose ``expire_at`` is still in the future (database time)."""
        return self.filter(expire_at__gt=DbNow())

    def expired(self) -> LockQuerySet:
        """Leases that are free: expired or released (database time)."""
        return self.filter(expire_at__lte=DbNow())


class Lock(models.Model):
    """A lease on a named lock.

    A row is written by the ``lease`` strategy when a lock is acquired. A
    release keeps the row but ends its lease (``expire_at`` = now, empty
    ``token``), so the key's fencing history survives until
    ``dlock_cleanup`` removes free rows. The ``row`` strategy locks the same
    rows with ``SELECT ... FOR UPDATE``.
    """

    name = models.CharField(max_length=300, unique=True, help_text="namespaced key")
    token = models.CharField(max_length=64, blank=True, default="", editable=False)
    owner = models.CharField(
        max_length=255, blank=True, default="", help_text="host, pid and thread or task"
    )
    fence = models.BigIntegerField(default=0, help_text="fencing number of the latest holding")
    acquired_at = models.DateTimeField(null=True, blank=True)
    expire_at = models.DateTimeField("expires at")
    queued = models.BooleanField(
        null=True,
        editable=False,
        help_text="PostgreSQL: a waiter may hold a ticket for this key (empty: nobody waits)",
    )

    objects = LockQuerySet.as_manager()

    class Meta:
        db_table = LOCK_TABLE
        ordering = ["name"]
        verbose_name = "lock"
        verbose_name_plural = "locks"
        permissions = [("force_release_lock", "Can force-release locks")]

    def __str__(self) -> str:
        return self.name


class FenceFloor(models.Model):
    """The high-water mark of fencing numbers of deleted rows.

    Used on SQLite and MySQL/MariaDB, where a key's first fence after its
    row was deleted must still exceed every fence issued before. (On
    PostgreSQL fencing numbers come from the ``django_dlock_fence`` sequence.)
    A single row with ``id = 1``.
    """

    value = models.BigIntegerField(default=0)

    class Meta:
        db_table = FENCE_FLOOR_TABLE
        verbose_name = "fence floor"

    def __str__(self) -> str:
        return str(self.value)


class Waiter(models.Model):
    """A ticket in the queue of a lease key: one caller waiting for it.

    The ``id`` is the ticket number: it comes from the table's monotonic
    sequence, so waiters are served in the order they joined. ``expire_at``
    is the ticket's own short lease on the database clock, renewed while its
    waiter is alive; a ticket that has run out (a killed process, a lost
    connection) is skipped and removed by ``dlock_cleanup``.
    """

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=300, help_text="namespaced key")
    token = models.CharField(max_length=64, editable=False)
    owner = models.CharField(
        max_length=255, blank=True, default="", help_text="host, pid and thread or task"
    )
    enqueued_at = models.DateTimeField()
    expire_at = models.DateTimeField()

    objects = models.Manager()

    class Meta:
        db_table = WAITER_TABLE
        ordering = ["name", "id"]
        indexes = [models.Index(fields=["name", "id"], name="django_dlock_waiter_queue")]
        verbose_name = "waiter"
        verbose_name_plural = "waiters"

    def __str__(self) -> str:
        return f"{self.name} #{self.id}"
