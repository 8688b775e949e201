"""Which databases make a quorum: the ``using=[...]`` aliases and their checks.

:func:`quorum_aliases` checks the list a lock is created with (distinct,
known aliases of independent databases) and remembers it;
:func:`quorum_problems` turns those quorums and the ``DLOCK_QUORUMS`` setting
into system check messages. :func:`majority` says how many databases of a
quorum are needed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from django.core.checks import CheckMessage
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.exceptions import DatabaseUnavailable
from django_dlock.strategies.connection import execute
from django_dlock.strategies.lease import TABLE
from django_dlock.validation import alias_error, validated

__all__ = [
    "declared",
    "majority",
    "quorum_aliases",
    "quorum_problems",
    "same_database",
    "same_server",
    "server_identity",
]

#: what tells one server's database from another's, per vendor: on
#: PostgreSQL the server's start time (to the microsecond) and the database;
#: on MySQL/MariaDB the server's host name, port and data directory and the
#: database. The same server reached under two host names answers the same.
_IDENTITY_SQL = {
    "postgresql": "SELECT pg_postmaster_start_time()::text, current_database()",
    "mysql": "SELECT @@hostname, @@port, @@datadir, DATABASE()",
}

#: every quorum a lock was created with (the system checks look at them)
declared: set[tuple[str, ...]] = set()


def majority(count: int) -> int:
    """How many databases out of ``count`` make a majority."""
    return count // 2 + 1


def _server(alias: str) -> tuple[str, str, str, str]:
    settings = connections.settings[alias]
    return (
        str(settings.get("ENGINE", "")),
        str(settings.get("HOST") or "localhost"),
        str(settings.get("PORT") or ""),
        str(settings.get("NAME") or ""),
    )


def same_database(aliases: Sequence[str]) -> list[tuple[str, str]]:
    """Pairs of aliases that name the same database (engine, host, port, name)."""
    seen: dict[tuple[str, str, str, str], str] = {}
    pairs = []
    for alias in aliases:
        server = _server(alias)
        if server in seen:
            pairs.append((seen[server], alias))
        else:
            seen[server] = alias
    return pairs


def server_identity(connection: BaseDatabaseWrapper) -> tuple[str, ...]:
    """What the database behind ``connection`` says it is (one query).

    Two aliases with the same identity are one database, whatever their
    ``HOST`` says (``127.0.0.1`` and ``localhost``, a DNS alias, a proxy).
    """
    if connection.vendor == "sqlite":
        return ("sqlite", os.path.realpath(str(connection.settings_dict["NAME"])))
    row = execute(connection, _IDENTITY_SQL[connection.vendor], [])[0]
    return (connection.vendor, *(str(value) for value in row or ()))


def same_server(identities: Mapping[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """Pairs of aliases whose databases answered with the same identity."""
    seen: dict[tuple[str, ...], str] = {}
    pairs = []
    for alias, identity in identities.items():
        if identity in seen:
            pairs.append((seen[identity], alias))
        else:
            seen[identity] = alias
    return pairs


def quorum_aliases(using: object) -> tuple[str, ...]:
    """The database aliases of ``using=[...]``, checked.

    Raises:
        ValueError: the list is empty, names an alias twice or an unknown
            alias, or two aliases are the same database (a majority of copies
            of one database is no majority).
    """
    if isinstance(using, (str, bytes)) or not isinstance(using, (list, tuple)):
        raise ValueError(f"using must be a database alias or a list of aliases, got {using!r}")
    aliases = tuple(using)
    if not aliases:
        raise ValueError("using=[] names no database: give one alias, or a list of several")
    for alias in aliases:
        if not isinstance(alias, str):
            raise ValueError(f"using lists database aliases (strings), got {alias!r}")
        validated(alias_error(alias, f" in using={list(aliases)!r}"))
    duplicates = sorted({alias for alias in aliases if aliases.count(alias) > 1})
    if duplicates:
        raise ValueError(
            f"using={list(aliases)!r} names {', '.join(map(repr, duplicates))} more than "
            "once: each database of a quorum counts once"
        )
    twins = same_database(aliases)
    if twins:
        first, second = twins[0]
        raise ValueError(
            f"using={list(aliases)!r}: {first!r} and {second!r} are the same database "
            "(same ENGINE, HOST, PORT and NAME); a quorum needs independent databases"
        )
    declared.add(aliases)
    return aliases


def quorum_problems(databases: Sequence[str]) -> list[CheckMessage]:
    """System check messages for the quorums in use (see ``checks.check_quorums``).

    The quorums are those of ``DLOCK_QUORUMS`` (a list of alias lists) and
    those of every lock created so far with ``using=[...]``. With
    ``databases`` (``check --database``), each of their databases must have
    the lock table.
    """
    from django.conf import settings
    from django.core.checks import Error, Warning

    found: list[CheckMessage] = []
    quorums = [tuple(q) for q in getattr(settings, "DLOCK_QUORUMS", ())] + sorted(declared)
    for aliases in dict.fromkeys(quorums):
        try:
            quorum_aliases(list(aliases))
        except ValueError as exc:
            found.append(
                Error(
                    f"The quorum {list(aliases)!r} is invalid: {exc}.",
                    hint="List distinct aliases of independent databases (each on its own "
                    "server, or at least its own database).",
                    id="dlock.E060",
                )
            )
            continue
        if len(aliases) % 2 == 0:
            found.append(
                Warning(
                    f"The quorum {list(aliases)!r} has an even number of databases: "
                    f"{majority(len(aliases))} of {len(aliases)} are needed, so it survives "
                    f"no more failures than {len(aliases) - 1} databases would.",
                    hint="Use an odd number of databases (3 or 5).",
                    id="dlock.W060",
                )
            )
        for alias in aliases:
            if alias in databases and not _has_lock_table(alias):
                found.append(
                    Warning(
                        f"The database {alias!r} of the quorum {list(aliases)!r} has no "
                        "django-dlock lock table yet: locks on this quorum fail until it "
                        "has.",
                        hint=f"Run `manage.py migrate django_dlock --database {alias}`.",
                        id="dlock.W061",
                    )
                )
        identities = _identities([alias for alias in aliases if alias in databases])
        for first, second in same_server(identities):
            found.append(
                Error(
                    f"The quorum {list(aliases)!r} counts one database twice: {first!r} and "
                    f"{second!r} reach the same database on the same server.",
                    hint="A quorum needs independent databases: point each alias at its "
                    "own database (better: its own server).",
                    id="dlock.E062",
                )
            )
    return found


def _identities(aliases: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The identity of each alias's database that answers (see :func:`server_identity`)."""
    from django.db import DatabaseError

    found = {}
    for alias in aliases:
        try:
            connections[alias].ensure_connection()
            found[alias] = server_identity(connections[alias])
        except (DatabaseError, DatabaseUnavailable):
            continue  # unreachable: Django's own checks say so
    return found


def _has_lock_table(alias: str) -> bool:
    from django.db import DatabaseError

    try:
        with connections[alias].cursor() as cur:
            return TABLE in connections[alias].introspection.table_names(cur)
    except DatabaseError:
        return True  # unreachable: Django's own checks say so
