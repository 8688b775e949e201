from __future__ import annotations

from django.db import migrations, models


def create_floor(apps, schema_editor):
    FenceFloor = apps.get_model("django_dlock", "FenceFloor")
    alias = schema_editor.connection.alias
    FenceFloor.objects.using(alias).get_or_create(id=1, defaults={"value": 0})


def forwards(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor == "postgresql":
        schema_editor.execute("CREATE SEQUENCE IF NOT EXISTS django_dlock_fence AS bigint")
    elif connection.vendor == "mysql":
        # Lock names are matched exactly: binary and NO PAD, so that "a",
        # "A" and "a " are three different locks.
        collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
        schema_editor.execute(
            "ALTER TABLE django_dlock_lock MODIFY name varchar(300) "
            f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
        )


def backwards(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP SEQUENCE IF EXISTS django_dlock_fence")


class Migration(migrations.Migration):
    initial = True

    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Lock",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("name", models.CharField(help_text="namespaced key", max_length=300, unique=True)),
                ("token", models.CharField(blank=True, default="", editable=False, max_length=64)),
                ("owner", models.CharField(blank=True, default="", help_text="host, pid and thread or task", max_length=255)),
                ("fence", models.BigIntegerField(default=0, help_text="fencing number of the latest holding")),
                ("acquired_at", models.DateTimeField(blank=True, null=True)),
                ("expire_at", models.DateTimeField(db_index=True)),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "db_table": "django_dlock_lock",
                "ordering": ["name"],
                "permissions": [("force_release_lock", "Can force-release locks")],
            },
        ),
        migrations.CreateModel(
            name="FenceFloor",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("value", models.BigIntegerField(default=0)),
            ],
            options={"verbose_name": "fence floor", "db_table": "django_dlock_fencefloor"},
        ),
        migrations.RunPython(create_floor, migrations.RunPython.noop),
        migrations.RunPython(forwards, backwards, atomic=False),
    ]
