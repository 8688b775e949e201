"""Manual override for operators: inspect and force-release locks.

Shared by the admin and the operator commands (``dlock_list``,
``dlock_show``, ``dlock_release``), one module per kind of lock:

* :mod:`~django_dlock.operations.lease_rows`: :func:`leases` lists lease rows
  with their state judged on the database clock; :func:`force_release` ends
  leases at once (``token = ''``, ``expire_at = now``), and on PostgreSQL
  wakes their waiters with ``pg_notify``. The old holder is not stopped: its
  next renew or release finds its token gone and raises
  :class:`~django_dlock.LockLost`;
* :mod:`~django_dlock.operations.pg_advisory`: :func:`advisory_locks` lists the
  PostgreSQL advisory locks held or awaited in the lock database
  (``pg_locks`` joined with ``pg_stat_activity``), :func:`advisory_names`
  finds the lock names behind their keys where they can be known, and
  :func:`terminate_backend` ends the session of a holder (the only way to
  free a session advisory lock that is not yours);
* :mod:`~django_dlock.operations.waiting`: :func:`blocking_tree`, who waits on
  whom (lease queues and semaphores; PostgreSQL advisory waiters and the
  backends that block them);
* :mod:`~django_dlock.operations.mysql_user_locks`: :func:`user_locks` lists the
  MySQL/MariaDB ``GET_LOCK`` locks of the advisory strategy where the server
  can show them, and :func:`user_lock_holder` finds the holder of one key
  (``IS_USED_LOCK``).
"""

from __future__ import annotations

from django_dlock.operations.lease_rows import (
    Lease,
    Released,
    SecondsLeft,
    default_alias,
    find_lease,
    find_permits,
    find_readers,
    force_release,
    leases,
)
from django_dlock.operations.lease_rows import annotate_state as annotate_state
from django_dlock.operations.lease_rows import candidate_names as candidate_names
from django_dlock.operations.lease_rows import held_for as held_for
from django_dlock.operations.lease_rows import is_held_long as is_held_long
from django_dlock.operations.lease_rows import state_of as state_of
from django_dlock.operations.lease_rows import token_prefix as token_prefix
from django_dlock.operations.mysql_user_locks import (
    UserLock,
    UserLocks,
    user_lock_holder,
)
from django_dlock.operations.mysql_user_locks import is_mysql as is_mysql
from django_dlock.operations.mysql_user_locks import user_locks as user_locks
from django_dlock.operations.pg_advisory import (
    AdvisoryLock,
    advisory_locks,
    blocking_pids,
    terminate_backend,
)
from django_dlock.operations.pg_advisory import advisory_key as advisory_key
from django_dlock.operations.pg_advisory import advisory_key_of as advisory_key_of
from django_dlock.operations.pg_advisory import advisory_key_of_name as advisory_key_of_name
from django_dlock.operations.pg_advisory import advisory_names as advisory_names
from django_dlock.operations.pg_advisory import is_postgresql as is_postgresql
from django_dlock.operations.waiting import (
    AwaitedAdvisory,
    AwaitedLease,
    Waiting,
    blocking_tree,
    deadlocks,
)

__all__ = [
    "AdvisoryLock",
    "AwaitedAdvisory",
    "AwaitedLease",
    "Waiting",
    "blocking_tree",
    "deadlocks",
    "Lease",
    "Released",
    "SecondsLeft",
    "advisory_locks",
    "blocking_pids",
    "default_alias",
    "find_lease",
    "find_permits",
    "find_readers",
    "force_release",
    "leases",
    "terminate_backend",
    "UserLock",
    "UserLocks",
    "user_lock_holder",
    "user_locks",
]
