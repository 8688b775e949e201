"""1. Uncontended acquire + release pairs on one connection, one client."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import Series, interleaved, raw_connection

#: (ours, the raw-psycopg floor it is compared with)
FLOORS = {
    "lease": "raw lease upsert + release",
    "lease, fast durability": "raw lease upsert + release, fast durability",
    "advisory": "raw pg_try_advisory_lock + unlock",
    "advisory_xact": "raw BEGIN; pg_try_advisory_xact_lock; COMMIT",
    "row": "raw BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT",
    "django-pglock advisory": "raw pg_try_advisory_lock + unlock",
}


def _raw_contenders() -> dict[str, Callable[[], Any]]:
    from django_dlock.strategies import lease as lease_sql

    conn = raw_connection()
    conn.execute(
        "INSERT INTO django_dlock_lock (name, token, owner, fence, expire_at) "
        "VALUES ('lock:bench-row-raw', '', '', 0, now()) ON CONFLICT DO NOTHING"
    )

    def advisory() -> None:
        conn.execute("SELECT pg_try_advisory_lock(%s)", [42], prepare=True).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%s)", [42], prepare=True).fetchone()

    def lease(durable: bool) -> Callable[[], None]:
        acquire, release = lease_sql._PG_ACQUIRE_SQL[durable], lease_sql._PG_RELEASE_SQL[durable]
        name = f"lock:bench-raw-{durable}"

        def pair() -> None:
            conn.execute(acquire, [name, "token", "owner", 60.0], prepare=True).fetchone()
            conn.execute(release, [name, "token"], prepare=True).fetchone()

        return pair

    def xact() -> None:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_try_advisory_xact_lock(%s)", [43], prepare=True).fetchone()
        conn.execute("COMMIT")

    def row() -> None:
        conn.execute("BEGIN")
        conn.execute(
            "SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE NOWAIT",
            ["lock:bench-row-raw"],
            prepare=True,
        ).fetchone()
        conn.execute("COMMIT")

    return {
        FLOORS["lease"]: lease(True),
        FLOORS["lease, fast durability"]: lease(False),
        FLOORS["advisory"]: advisory,
        FLOORS["advisory_xact"]: xact,
        FLOORS["row"]: row,
    }


def _ours() -> dict[str, Callable[[], Any]]:
    from django.conf import settings
    from django.db import transaction

    import django_dlock as dlock

    def pair(strategy: str, key: str) -> Callable[[], None]:
        lk = dlock.lock(key, strategy=strategy, ttl=60)

        def run() -> None:
            if not lk.acquire(timeout=0):
                raise RuntimeError(f"{strategy}: uncontended acquire failed")
            lk.release()

        return run

    def in_transaction(strategy: str, key: str) -> Callable[[], None]:
        lk = dlock.lock(key, strategy=strategy)

        def run() -> None:
            with transaction.atomic(), lk:
                pass

        return run

    lease = pair("lease", "bench-lease")
    fast_lease = pair("lease", "bench-lease-fast")

    def fast() -> None:
        # (a plain attribute: override_settings would cost more than a pair)
        settings.DLOCK_LEASE_SYNCHRONOUS_COMMIT = False
        try:
            fast_lease()
        finally:
            settings.DLOCK_LEASE_SYNCHRONOUS_COMMIT = True

    return {
        "lease": lease,
        "lease, fast durability": fast,
        "advisory": pair("advisory", "bench-advisory"),
        "advisory_xact": in_transaction("advisory_xact", "bench-xact"),
        "row": in_transaction("row", "bench-row"),
    }


def _others() -> dict[str, Callable[[], Any]]:
    import pglock
    import redis
    import redis_lock

    client = redis.Redis(host="127.0.0.1", port=6379)
    client.ping()

    def pglock_pair() -> None:
        with pglock.advisory("bench-pglock"):
            pass

    redis_py = client.lock("bench:redis-py", timeout=60)

    def redis_py_pair() -> None:
        if not redis_py.acquire(blocking=False):
            raise RuntimeError("redis-py: uncontended acquire failed")
        redis_py.release()

    prl = redis_lock.Lock(client, "bench:python-redis-lock", expire=60)

    def prl_pair() -> None:
        if not prl.acquire(blocking=False):
            raise RuntimeError("python-redis-lock: uncontended acquire failed")
        prl.release()

    return {
        "django-pglock advisory": pglock_pair,
        "redis-py Lock": redis_py_pair,
        "python-redis-lock": prl_pair,
    }


def run(rounds: int, seconds: float) -> dict[str, Series]:
    contenders = {**_raw_contenders(), **_ours(), **_others()}
    return interleaved(contenders, rounds, seconds)
