"""MySQL/MariaDB: waiter tickets match lock names exactly, as the lock table does.

The waiter table's ``name`` kept the database's default collation, usually
case- and accent-insensitive and padding trailing spaces: a caller waiting
for "Invoice" then kept out a newcomer to the free key "invoice" (also
"café" and "cafe", "a" and "a "). Other databases compare exactly already.
"""

from __future__ import annotations

from django.db import migrations


def forwards(apps, schema_editor):
    connection = schema_editor.connection
    if connection.vendor != "mysql":
        return
    # the lock table's collation (0001_initial): binary and NO PAD
    collation = "utf8mb4_nopad_bin" if connection.mysql_is_mariadb else "utf8mb4_0900_bin"
    schema_editor.execute(
        "ALTER TABLE django_dlock_waiter MODIFY name varchar(300) "
        f"CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL"
    )


class Migration(migrations.Migration):
    dependencies = [("django_dlock", "0004_wake_head")]

    # atomic=False: MySQL/MariaDB cannot run DDL in a transaction
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop, atomic=False)]
