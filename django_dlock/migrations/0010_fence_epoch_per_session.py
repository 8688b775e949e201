"""PostgreSQL: a session that has seen the fence sequence above its timeline's epoch says so.

``django_dlock_next_fence()`` (migration 0009) read the timeline from the
name of the current WAL file at every number, in a PL/pgSQL call that cost
the server about 6 % of an uncontended lease acquire and release. Once
a session has seen the sequence at or above its timeline's epoch (or raised
it there), every later number of that session is too: a sequence only goes
up, and a session's timeline cannot change while it lives (a primary starts
a new timeline only when it is started again; a standby takes no number:
``nextval`` fails in a read-only transaction, so a session open on a standby
that is promoted calls the function at its first number). The function now
says so in the session's setting ``django_dlock.fence_above_epoch``, and
the statements (:data:`django_dlock.strategies.fence.NEXT_FENCE`) take a
plain ``nextval`` where it is ``on``. A role that may not raise the sequence
(the epoch added, not stored) never sets it and calls the function at every
number, as before. ``DISCARD ALL`` and ``RESET ALL`` clear the setting, a
transaction that rolls back undoes it: the function is called again then.
The same numbers as before. Nothing on other databases.
"""

from __future__ import annotations

from importlib import import_module

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

#: the session setting (a migration keeps its SQL as written: the name is
#: django_dlock.strategies.fence.ABOVE_EPOCH, checked by a test)
_SET = "PERFORM set_config('django_dlock.fence_above_epoch', 'on', false);"

CREATE = f"""
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
        {_SET}
        RETURN number;
    END IF;
    IF has_sequence_privilege('django_dlock_fence', 'UPDATE') THEN
        {_SET}
        RETURN setval('django_dlock_fence', epoch + number);
    END IF;
    RETURN epoch + number;
END
$$
"""

#: the function as migration 0009 made it (what reversing this migration restores)
PREVIOUS: str = import_module("django_dlock.migrations.0009_acquire_functions").CREATE[1]


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def restore(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0009_acquire_functions"),
    ]

    operations = [
        migrations.RunPython(create, restore, elidable=False),
    ]
