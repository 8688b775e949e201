"""Two-part keys are stored under new names: keep their fencing numbers increasing.

A two-part key ``("order", 42)`` used to be stored as ``lock:('order', 42)``,
the same name as the string key ``"('order', 42)"``; it is now stored as
``lock('order', 42)``. Rows under the old names are left alone (their
leases run out, ``dlock_cleanup`` deletes them once free). So that the first
fencing number issued under a new name still exceeds every number issued
under an old one, the fence floor (the start of a new row's numbers on
SQLite and MySQL/MariaDB) is raised to the highest number in the table; on
PostgreSQL the ``django_dlock_fence`` sequence is moved past it as well.
"""

from __future__ import annotations

from django.db import migrations
from django.db.models import Max


def raise_floor(apps, schema_editor):
    Lock = apps.get_model("django_dlock", "Lock")
    FenceFloor = apps.get_model("django_dlock", "FenceFloor")
    connection = schema_editor.connection
    alias = connection.alias
    highest = Lock.objects.using(alias).aggregate(high=Max("fence"))["high"] or 0
    floor, _ = FenceFloor.objects.using(alias).get_or_create(id=1, defaults={"value": 0})
    if highest > floor.value:
        FenceFloor.objects.using(alias).filter(id=1, value__lt=highest).update(value=highest)
    if connection.vendor == "postgresql" and highest > 0:
        with connection.cursor() as cur:
            cur.execute(
                "SELECT setval('django_dlock_fence', GREATEST(%s, "
                "(SELECT last_value FROM django_dlock_fence)))",
                [highest],
            )


class Migration(migrations.Migration):
    dependencies = [("django_dlock", "0001_initial")]

    operations = [migrations.RunPython(raise_floor, migrations.RunPython.noop)]
