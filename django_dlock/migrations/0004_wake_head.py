"""PostgreSQL: the function that wakes the head of a key's waiter queue.

A release locks the key's row, then calls this function, which reads the
queue with a snapshot of its own (a ``VOLATILE`` PL/pgSQL function takes a
fresh snapshot for each query it runs), so a ticket committed while the
release waited for the row is seen and woken. Nothing on other databases.
"""

from __future__ import annotations

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

CREATE = """
CREATE OR REPLACE FUNCTION django_dlock_wake_head(key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    head bigint;
BEGIN
    SELECT w.id INTO head FROM django_dlock_waiter w
    WHERE w.name = key AND w.expire_at > statement_timestamp()
    ORDER BY w.id LIMIT 1;
    IF head IS NOT NULL THEN
        PERFORM pg_notify('django_dlock', 'django-dlock-ticket:' || head);
    END IF;
    RETURN head;
END
$$
"""
DROP = "DROP FUNCTION IF EXISTS django_dlock_wake_head(text)"


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE)


def drop(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [("django_dlock", "0003_waiter_queue")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
