"""The ``expire_at`` column's label reads "expires at" (no SQL: a label only)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0005_waiter_name_collation"),
    ]

    operations = [
        migrations.AlterField(
            model_name="lock",
            name="expire_at",
            field=models.DateTimeField(db_index=True, verbose_name="expires at"),
        ),
    ]
