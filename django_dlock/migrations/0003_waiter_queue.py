"""The waiter queue of the lease strategy: one ticket per waiting caller."""

from __future__ import annotations

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_dlock", "0002_two_part_key_names")]

    operations = [
        migrations.CreateModel(
            name="Waiter",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("name", models.CharField(help_text="namespaced key", max_length=300)),
                ("token", models.CharField(editable=False, max_length=64)),
                (
                    "owner",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="host, pid and thread or task",
                        max_length=255,
                    ),
                ),
                ("enqueued_at", models.DateTimeField()),
                ("expire_at", models.DateTimeField()),
            ],
            options={
                "verbose_name": "waiter",
                "verbose_name_plural": "waiters",
                "db_table": "django_dlock_waiter",
                "ordering": ["name", "id"],
                "indexes": [models.Index(fields=["name", "id"], name="django_dlock_waiter_queue")],
            },
        ),
    ]
