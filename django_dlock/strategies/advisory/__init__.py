"""The ``advisory`` strategy: locks held on a dedicated database session per holder.

One strategy name, an implementation per database vendor
(:mod:`~django_dlock.strategies.advisory.vendors`):

* :mod:`~django_dlock.strategies.advisory.postgresql`: PostgreSQL
  session-level advisory locks (``pg_advisory_lock``);
* :mod:`~django_dlock.strategies.advisory.mysql`: MySQL/MariaDB user locks
  (``GET_LOCK``).

Both hold a holder's locks on a session of its own:
:mod:`~django_dlock.strategies.advisory.session` (one session, and the
connection model), :mod:`~django_dlock.strategies.advisory.pool` (idle
sessions, holders that end without releasing, ``fork``),
:mod:`~django_dlock.strategies.advisory.watcher` (sessions the server ended),
:mod:`~django_dlock.strategies.advisory.executor` and
:mod:`~django_dlock.strategies.advisory.acquire` (the async path), and
:mod:`~django_dlock.strategies.advisory.pending` (two-phase acquire).

The names of the PostgreSQL implementation (:func:`pg_locks_ids`,
:data:`PG_LOCKS_MATCH`, ...) stay importable from this package, as they were
before it was split; they are loaded on first use, so importing the package
costs nothing.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_dlock.strategies._pg import (
        MAX_LOCK_TIMEOUT_MS,
        PG_LOCKS_MATCH,
        fencing,
        pg_locks_ids,
    )
    from django_dlock.strategies.advisory.postgresql import AdvisoryStrategy, advisory

__all__ = [
    "MAX_LOCK_TIMEOUT_MS",
    "PG_LOCKS_MATCH",
    "AdvisoryStrategy",
    "advisory",
    "fencing",
    "pg_locks_ids",
]


def __getattr__(name: str) -> Any:
    # ``from django_dlock.strategies.advisory import pg_locks_ids`` and the
    # like: the PostgreSQL implementation's names, imported on first use.
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(import_module("django_dlock.strategies.advisory.postgresql"), name)
