"""PostgreSQL: fencing numbers raised to the clock at the first number of every new era.

Migration 0010's ``django_dlock_next_fence()`` raised the sequence *by* a
timeline's epoch, ``(timeline - 1) * 2**44``, instead of *to* it: after the
second promotion the sequence was already past the fourth timeline's epoch,
and was raised again only at timelines 5, 9, 17... A standby that missed the
old primary's last WAL then gave out numbers the old primary had already
given. And a timeline ID is not unique: a standby that never followed the
newest timeline (two switchovers in quick succession) names its own new
timeline with an ID already used, so no epoch derived from the ID can be
right.

Now a one-row table, ``django_dlock_fence_era``, records the timeline on
which the sequence was last raised. It is replicated with the data, so a
promoted standby's copy names the last era *it* saw: whenever the timeline a
number is taken on is not that one (a promotion, whatever ID it was given),
the first number of the new era raises the sequence to the server's clock in
microseconds since the Unix epoch, and records the timeline (the row's lock
makes one session do it). Every number the old primary issued is below: it
was at most its own era's raise plus the numbers taken since, and fewer
than one number per microsecond is taken, so it was below the old primary's
clock, and the new primary's clock is later (the members' clocks agreeing
to within the time between two promotions: seconds, where NTP keeps them
within milliseconds). With synchronous replication the promoted standby has
every number already, and the raise only moves the numbers up.

A database never promoted stays in its first era: the row is written here
with the timeline the database is on, so its numbers keep counting from 1.
A role that may not read the table, or write it and raise the sequence,
gets ``GREATEST(nextval, clock)`` (just as increasing, not stored). The session
setting ``django_dlock.fence_era_seen`` says that this session found its
timeline recorded; later numbers of the session are a plain ``nextval``.
Nothing on other databases.
"""

from __future__ import annotations

from importlib import import_module

from django.db import migrations
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

#: the timeline of the WAL being written now (an error on a standby)
_TIMELINE = "('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint"
#: the server's clock, in microseconds since the Unix epoch
_CLOCK = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"
#: the session setting (a migration keeps its SQL as written: the name is
#: django_dlock.strategies.fence.ERA_SEEN, checked by a test)
_SEEN = "PERFORM set_config('django_dlock.fence_era_seen', 'on', false);"

TABLE = f"""
CREATE TABLE IF NOT EXISTS django_dlock_fence_era (
    id integer PRIMARY KEY CHECK (id = 1),
    timeline bigint NOT NULL,
    raised_to bigint NOT NULL,
    raised_at timestamptz NOT NULL
);
INSERT INTO django_dlock_fence_era (id, timeline, raised_to, raised_at)
VALUES (1, {_TIMELINE}, 0, clock_timestamp())
ON CONFLICT (id) DO NOTHING;
"""

CREATE = f"""
CREATE OR REPLACE FUNCTION django_dlock_next_fence() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    current_timeline bigint := {_TIMELINE};
    number bigint;
BEGIN
    IF NOT has_table_privilege('django_dlock_fence_era', 'SELECT') THEN
        -- cannot tell the era: at or above the clock, not stored
        RETURN GREATEST(nextval('django_dlock_fence'), {_CLOCK});
    END IF;
    PERFORM 1 FROM django_dlock_fence_era WHERE id = 1 AND timeline = current_timeline;
    IF NOT FOUND THEN
        IF NOT (has_table_privilege('django_dlock_fence_era', 'INSERT, UPDATE')
                AND has_sequence_privilege('django_dlock_fence', 'UPDATE')) THEN
            -- may not raise: at or above the clock, not stored
            RETURN GREATEST(nextval('django_dlock_fence'), {_CLOCK});
        END IF;
        -- a new era: the first session here raises the sequence (the others
        -- wait for the row, then find the timeline recorded)
        INSERT INTO django_dlock_fence_era AS era (id, timeline, raised_to, raised_at)
        VALUES (1, current_timeline, 0, clock_timestamp())
        ON CONFLICT (id) DO UPDATE SET timeline = EXCLUDED.timeline, raised_at = EXCLUDED.raised_at
        WHERE era.timeline <> EXCLUDED.timeline;
        IF FOUND THEN
            number := GREATEST(nextval('django_dlock_fence'), {_CLOCK});
            PERFORM setval('django_dlock_fence', number);
            UPDATE django_dlock_fence_era SET raised_to = number WHERE id = 1;
            {_SEEN}
            RETURN number;
        END IF;
    END IF;
    {_SEEN}
    RETURN nextval('django_dlock_fence');
END
$$
"""

DROP = "DROP TABLE IF EXISTS django_dlock_fence_era"

#: the function as migration 0010 made it (what reversing this migration restores)
PREVIOUS: str = import_module("django_dlock.migrations.0010_fence_epoch_per_session").CREATE


def create(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(TABLE)
        schema_editor.execute(CREATE)


def restore(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(PREVIOUS)
        schema_editor.execute(DROP)


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0010_fence_epoch_per_session"),
    ]

    operations = [
        migrations.RunPython(create, restore, elidable=False),
    ]
