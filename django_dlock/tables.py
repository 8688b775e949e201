"""The names of the database objects django-dlock's SQL uses.

Lock statements are written as SQL text built when their module is
imported, before Django's app registry is ready, so they cannot ask the
models for ``_meta.db_table``. The models' ``Meta.db_table`` and every
statement take the names from here, so a name is written once.
"""

from __future__ import annotations

__all__ = ["FENCE_ERA_TABLE", "FENCE_FLOOR_TABLE", "FENCE_SEQUENCE", "LOCK_TABLE", "WAITER_TABLE"]

#: one row per lease (:class:`django_dlock.models.Lock`)
LOCK_TABLE = "django_dlock_lock"
#: one row per place in a key's queue (:class:`django_dlock.models.Waiter`)
WAITER_TABLE = "django_dlock_waiter"
#: the least fencing number a new row starts above (:class:`django_dlock.models.FenceFloor`)
FENCE_FLOOR_TABLE = "django_dlock_fencefloor"
#: PostgreSQL's sequence of fencing numbers (made by a migration)
FENCE_SEQUENCE = "django_dlock_fence"
#: PostgreSQL's one-row table naming the timeline on which the fence sequence
#: was last raised (made by a migration; see django_dlock.strategies.fence)
FENCE_ERA_TABLE = "django_dlock_fence_era"
