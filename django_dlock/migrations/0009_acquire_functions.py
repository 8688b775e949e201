"""PostgreSQL: two functions that an acquire calls instead of subqueries.

PostgreSQL sets a statement's subqueries up at every execution, also when
they are not reached; a function is called only when reached, and PL/pgSQL
keeps the plans of its queries for the session. Nothing on other databases.

* ``django_dlock_ahead(key, ticket)``: is a live ticket below ``ticket``
  waiting for ``key``? A lease acquire asks it only when the key's row is
  flagged ``queued`` (migration 0007). ``STABLE``: its query reads with the
  acquire's own snapshot, the answer the subquery gave.
* ``django_dlock_next_fence()``: the next fencing number, also across a
  fail-over (the sequence raised above the timeline's epoch, see
  ``django_dlock.strategies.fence``), the value of the expression the
  statements held before. ``VOLATILE``: it takes a number at every call.
"""

from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

CREATE = [
    """
CREATE OR REPLACE FUNCTION django_dlock_ahead(key text, ticket bigint) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    PERFORM 1 FROM django_dlock_waiter w
    WHERE w.name = key AND w.expire_at > statement_timestamp() AND w.id < ticket
    LIMIT 1;
    RETURN FOUND;
END
$$
""",
    """
CREATE OR REPLACE FUNCTION django_dlock_next_fence() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    number bigint := nextval('django_dlock_fence');
    -- the first number of this timeline: (timeline - 1) * 2**44, the
    -- timeline read from the current WAL file's name
    epoch bigint := (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))
                     ::bit(32)::bigint - 1) << 44;
BEGIN
    IF number >= epoch THEN
        RETURN number;
    END IF;
    IF has_sequence_privilege('django_dlock_fence', 'UPDATE') THEN
        RETURN setval('django_dlock_fence', epoch + number);
    END IF;
    RETURN epoch + number;
END
$$
""",
]
DROP = [
    "DROP FUNCTION IF EXISTS django_dlock_ahead(text, bigint)",
    "DROP FUNCTION IF EXISTS django_dlock_next_fence()",
]


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for sql in CREATE:
            schema_editor.execute(sql)


def drop(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        for sql in DROP:
            schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0008_expire_at_no_index"),
    ]

    operations = [
        migrations.RunPython(create, drop, elidable=False),
    ]
