"""PostgreSQL: a key's row says whether anybody may wait for it.

A waiter's ticket sets ``queued`` on the key's row (creating a free row if
there is none) in the statement that inserts the ticket, so an acquire and
a release of a key nobody waits for skip the queue. ``queued`` is cleared by
the acquire that finds no ticket left, looked up by the function
``django_dlock_queued``: a ``VOLATILE`` PL/pgSQL function, whose query takes
a fresh snapshot after the caller locked the key's row, so it sees a ticket
committed while the caller waited for that row. The column is empty (NULL)
on rows nobody ever waited for, and stays empty on other databases.
"""

from __future__ import annotations

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

CREATE = """
CREATE OR REPLACE FUNCTION django_dlock_queued(key text, besides bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM django_dlock_waiter w WHERE w.name = key AND w.id <> besides LIMIT 1;
    RETURN FOUND;
END
$$
"""
DROP = "DROP FUNCTION IF EXISTS django_dlock_queued(text, bigint)"
# Keys with tickets at the time of the migration are flagged.
FLAG = """
UPDATE django_dlock_lock l SET queued = true
WHERE EXISTS (SELECT 1 FROM django_dlock_waiter w WHERE w.name = l.name)
"""


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)
        schema_editor.execute(FLAG)


def drop(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0006_expire_at_verbose_name"),
    ]

    operations = [
        migrations.AddField(
            model_name="lock",
            name="queued",
            field=models.BooleanField(
                editable=False,
                help_text="PostgreSQL: a waiter may hold a ticket for this key (empty: nobody waits)",
                null=True,
            ),
        ),
        migrations.RunPython(create, drop, elidable=False),
    ]
