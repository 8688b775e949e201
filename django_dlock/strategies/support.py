"""What the lock database can do: system checks for the advisory and row strategies.

* ``dlock.E010``: ``DLOCK_DEFAULT_STRATEGY`` is ``advisory`` and the lock
  database is neither PostgreSQL nor MySQL/MariaDB, or it is
  ``advisory_xact`` and the lock database is not PostgreSQL (on
  MySQL/MariaDB that is ``dlock.E013``).
* ``dlock.E011``: ``DLOCK_DEFAULT_STRATEGY`` is ``row`` and the lock database
  is neither PostgreSQL nor MySQL/MariaDB (SQLite has no row locks).
* ``dlock.E012``: ``DLOCK_ADVISORY_FENCING`` is not a bool.
* ``dlock.E013``: ``DLOCK_DEFAULT_STRATEGY`` is ``advisory_xact`` and the
  lock database is MySQL/MariaDB, which has no transaction-scoped advisory
  locks (``advisory`` itself runs there, on ``GET_LOCK``).
* ``dlock.W010``: ``DLOCK_DEFAULT_STRATEGY`` is ``advisory`` and the lock
  database looks like it is reached through PgBouncer
  (``DISABLE_SERVER_SIDE_CURSORS = True`` or port 6432). In transaction
  mode a pooler hands the server session to another client between two
  statements, so a session lock would stay with, and could be released by,
  the next client. django-dlock detects a switch at run time (the backend
  pid changes) but cannot undo it.
* ``dlock.W011``: ``DLOCK_DEFAULT_STRATEGY`` is ``advisory`` and the lock
  database uses Django's connection pool (``OPTIONS["pool"]``, Django 5.1+).
  That is safe, because advisory locks never use Django's connections
  (each holder has a dedicated session, see :mod:`django_dlock.sessions`),
  but those sessions are *in addition to* the pool's connections: count
  them in ``max_connections``.

These checks look at settings only; they never connect to a database.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning

from django_dlock.conf import DEFAULTS, strategy_error

SESSION_HINT = (
    "Use advisory_xact (transaction-scoped, safe behind any pooler) or lease, or give "
    "advisory locks a database alias that connects directly (lock(..., using=...))."
)


def lock_alias() -> str:
    """The database the lock model is written to (the router's choice)."""
    from django.db import router

    from django_dlock.models import Lock

    try:
        return router.db_for_write(Lock) or "default"
    except Exception:
        return "default"


def database_messages(
    strategy: str, alias: str, database: dict[str, Any], vendor: str
) -> list[CheckMessage]:
    """The messages for ``strategy`` as the default on the database ``alias``."""
    found: list[CheckMessage] = []
    if strategy == "advisory" and vendor not in ("postgresql", "mysql"):
        found.append(
            Error(
                "DLOCK_DEFAULT_STRATEGY is 'advisory', which needs PostgreSQL or "
                f"MySQL/MariaDB, but the lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E010",
            )
        )
    if strategy == "advisory_xact" and vendor == "mysql":
        found.append(
            Error(
                "DLOCK_DEFAULT_STRATEGY is 'advisory_xact', which needs PostgreSQL: the lock "
                f"database {alias!r} is MySQL/MariaDB, which has no transaction-scoped "
                "advisory locks.",
                hint="Use row (held until the transaction ends) or advisory (GET_LOCK, "
                "held until released).",
                id="dlock.E013",
            )
        )
    elif strategy == "advisory_xact" and vendor != "postgresql":
        found.append(
            Error(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory_xact', which needs PostgreSQL, but the "
                f"lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E010",
            )
        )
    if strategy == "row" and vendor not in ("postgresql", "mysql"):
        found.append(
            Error(
                f"DLOCK_DEFAULT_STRATEGY is 'row', which needs PostgreSQL or MySQL/MariaDB, "
                f"but the lock database {alias!r} is {vendor}.",
                hint="Use the lease strategy.",
                id="dlock.E011",
            )
        )
    if strategy != "advisory" or vendor != "postgresql":
        return found
    options = database.get("OPTIONS") or {}
    if database.get("DISABLE_SERVER_SIDE_CURSORS") or str(database.get("PORT", "")) == "6432":
        found.append(
            Warning(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory' and the database {alias!r} looks like "
                "it goes through PgBouncer (DISABLE_SERVER_SIDE_CURSORS or port 6432). In "
                "transaction mode the server session changes between statements, and a "
                "session lock would be left with the next client.",
                hint=SESSION_HINT,
                id="dlock.W010",
            )
        )
    if options.get("pool"):
        found.append(
            Warning(
                f"DLOCK_DEFAULT_STRATEGY is 'advisory' and the database {alias!r} uses "
                "Django's connection pool. Advisory locks never borrow pooled connections "
                "(a lock cannot leak to the next borrower): each thread or task holding "
                "one uses a dedicated session outside the pool.",
                hint="Count those sessions in max_connections (one per concurrent holder "
                "or waiter, plus a few idle ones per process), or silence this warning.",
                id="dlock.W011",
            )
        )
    return found


def strategy_messages() -> list[CheckMessage]:
    """dlock.E010-E013, W010-W011 for the current settings (see the module docstring)."""
    found: list[CheckMessage] = []
    fencing = getattr(settings, "DLOCK_ADVISORY_FENCING", False)
    if not isinstance(fencing, bool):
        found.append(
            Error(
                f"DLOCK_ADVISORY_FENCING must be True or False, not {fencing!r}.",
                hint="Set DLOCK_ADVISORY_FENCING = True to give advisory locks fencing "
                "numbers (it costs about 20 % of an uncontended acquire/release).",
                id="dlock.E012",
            )
        )
    strategy = getattr(settings, "DLOCK_DEFAULT_STRATEGY", DEFAULTS["DLOCK_DEFAULT_STRATEGY"])
    if strategy_error(strategy) is not None:
        return found  # dlock.E001
    alias = lock_alias()
    database = settings.DATABASES.get(alias)
    if database is None:
        return found
    from django.db import connections

    found += database_messages(strategy, alias, database, connections[alias].vendor)
    return found
