"""The lease table drops its ``expire_at`` index.

Every acquire and release changes ``expire_at``. Without an index on it,
PostgreSQL writes them as heap-only tuple (HOT) updates: the new row version
goes on the same page and no index is touched, which is most of what an
uncontended acquire + release costs the server beyond the least SQL that
gives the same guarantee (see the benchmarks page). Nothing reads the table
by ``expire_at`` on a hot path: ``dlock_cleanup`` walks the table once, by
pages on PostgreSQL and by primary key elsewhere.
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0007_queued"),
    ]

    operations = [
        migrations.AlterField(
            model_name="lock",
            name="expire_at",
            field=models.DateTimeField(verbose_name="expires at"),
        ),
    ]
