"""The ``advisory`` strategy on MySQL/MariaDB, under its former name.

It lives in :mod:`django_dlock.strategies.advisory.mysql` now; this module
keeps the documented names importable.
"""

from __future__ import annotations

from django_dlock.strategies.advisory.mysql import (
    MAX_NAME_LENGTH,
    MySQLAdvisoryStrategy,
    advisory_mysql,
    database_name,
    lock_name,
)

__all__ = [
    "MAX_NAME_LENGTH",
    "MySQLAdvisoryStrategy",
    "advisory_mysql",
    "database_name",
    "lock_name",
]
