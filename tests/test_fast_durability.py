"""DLOCK_LEASE_SYNCHRONOUS_COMMIT = False: faster lease writes on PostgreSQL.

The trade-off, shown for real on a private cluster that the test crashes
(``pg_ctl stop -m immediate``) with a long ``wal_writer_delay``, so that
asynchronous commits are still unflushed at the crash:

* the last lease writes before a crash of the database server are lost
  (those in WAL pages the WAL writer had not flushed yet; in the default,
  durable mode every acknowledged write survives), and their holders learn it;
* fencing numbers still strictly increase across the crash.
"""

from __future__ import annotations

import pytest
from django.db import connections
from django.test import override_settings

import django_dlock as dlock

from .pgcluster import PrivateCluster

ALIAS = "crashable"


@pytest.fixture(scope="module")
def cluster(django_db_blocker):
    # fsync stays on: a crash must lose exactly what was never flushed.
    cluster = PrivateCluster(wal_writer_delay="10s", checkpoint_timeout="1h").create()
    try:
        with django_db_blocker.unblock(), cluster.attached(ALIAS, "dlock_crash"):
            yield cluster
    finally:
        cluster.destroy()


def _rows() -> set[str]:
    with connections[ALIAS].cursor() as cur:
        cur.execute("SELECT name FROM django_dlock_lock WHERE token <> ''")
        return {name for (name,) in cur.fetchall()}


def _wal_writer_just_flushed(cluster: PrivateCluster) -> None:
    """Make the WAL writer flush everything now, so that for the next
    ``wal_writer_delay`` (10 s) it writes only completed WAL pages.

    Woken by an asynchronous commit that starts a new page, the WAL writer
    flushes everything, the last commit too, when its own last full flush
    is older than ``wal_writer_delay``; otherwise it flushes completed pages
    only. A few kB of asynchronously committed rows wake it, and it flushes
    them all: the lease writes that follow are then lost at a crash unless
    their page filled up."""
    db = "dlock_crash"
    cluster.sql("CREATE TABLE IF NOT EXISTS dlock_wal_filler (x text)", dbname=db)
    cluster.sql(
        "INSERT INTO dlock_wal_filler SELECT string_agg(md5(random()::text || g), '') "
        "FROM generate_series(1, 16) AS r, generate_series(1, 64) AS g, "
        "(SELECT set_config('synchronous_commit', 'off', true)) AS s GROUP BY r",
        dbname=db,
    )
    cluster.wait_for("SELECT pg_current_wal_flush_lsn() >= pg_current_wal_insert_lsn()", timeout=30)


def _acquire_many(prefix: str) -> tuple[list[dlock.Lock], list[int]]:
    held, fences = [], []
    for i in range(50):
        lk = dlock.lock(f"{prefix}{i % 5}", using=ALIAS, ttl=3600)
        lk.acquire()
        fences.append(lk.fence)
        if i < 45:
            lk.release()  # the last five stay held
        else:
            held.append(lk)
    return held, fences


@pytest.mark.slow
@pytest.mark.django_db(transaction=True, databases=["default", ALIAS])
@pytest.mark.parametrize("durable", [True, False], ids=["durable", "fast"])
def test_crash_of_the_database_server(cluster, durable):
    prefix = "durable-" if durable else "fast-"
    with override_settings(DLOCK_LEASE_SYNCHRONOUS_COMMIT=durable):
        _wal_writer_just_flushed(cluster)
        held, fences = _acquire_many(prefix)
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False))
        connections[ALIAS].close()
        cluster.crash_and_restart()

        survivors = {name for name in _rows() if name.startswith(f"lock:{prefix}")}
        if durable:
            assert survivors == {lk.name for lk in held}  # every acknowledged write survived
            for lk in held:
                lk.release()
        else:
            # WAL pages that filled up were flushed by the WAL writer; the
            # tail of the last page (at least the last write) was lost.
            assert held[-1].name not in survivors
            assert survivors < {lk.name for lk in held}
            for lk in held:  # every holder is told the truth, never fooled
                if lk.name in survivors:
                    assert lk.owned()
                    lk.release()
                else:
                    assert not lk.owned()
                    with pytest.raises(dlock.LockLost):
                        lk.release()

        after = []
        for i in range(5):
            with dlock.lock(f"{prefix}{i}", using=ALIAS, ttl=60, timeout=0) as lk:
                after.append(lk.fence)
        assert min(after) > max(fences), (fences, after)
