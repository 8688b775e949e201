"""1. Uncontended acquire + release pairs on one connection, one client.

Ours is measured the way users write it (``with dlock.lock(key, ...)``, a new
lock per call; inside ``transaction.atomic`` for the transaction-scoped
strategies) and, separately, with one ``Lock`` object reused. Each floor is
the least SQL that gives the same guarantee, prepared, on one psycopg
connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .common import Series, interleaved, raw_connection

#: What Django's ``transaction.atomic`` costs on its own: the floor's one
#: statement, prepared, inside ``transaction.atomic`` on Django's connection.
#: No lock library used the way users write it can beat these.
DJANGO_XACT = "Django's share: transaction.atomic + the advisory_xact floor's statement"
DJANGO_ROW = "Django's share: transaction.atomic + the row floor's statement"

#: (ours, the raw-psycopg floor it is compared with)
FLOORS = {
    "lease": "floor: lease upsert + DELETE",
    "lease, reused Lock object": "floor: lease upsert + DELETE",
    "lease, fast durability": "floor: lease upsert + DELETE, synchronous_commit off",
    "advisory": "floor: pg_try_advisory_lock + unlock",
    "advisory, reused Lock object": "floor: pg_try_advisory_lock + unlock",
    "advisory_xact": "floor: BEGIN; pg_try_advisory_xact_lock; COMMIT",
    "advisory_xact, reused Lock object": "floor: BEGIN; pg_try_advisory_xact_lock; COMMIT",
    "row": "floor: BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT",
    "row, reused Lock object": "floor: BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT",
    "django-pglock advisory": "floor: pg_try_advisory_lock + unlock",
    DJANGO_XACT: "floor: BEGIN; pg_try_advisory_xact_lock; COMMIT",
    DJANGO_ROW: "floor: BEGIN; SELECT … FOR UPDATE NOWAIT; COMMIT",
}

#: The least SQL that gives a lease: take the row when it is free or expired
#: (judged on the database clock), with a fencing number from a sequence;
#: give it back by deleting it. Written here by hand, not taken from
#: django-dlock, and run prepared on one psycopg connection.
FLOOR_LEASE_ACQUIRE = """
INSERT INTO django_dlock_lock AS l (name, token, owner, fence, acquired_at, expire_at)
VALUES (%s, %s, '', nextval('django_dlock_fence'), now(), now() + interval '60 seconds')
ON CONFLICT (name) DO UPDATE
SET token = EXCLUDED.token, fence = EXCLUDED.fence,
    acquired_at = EXCLUDED.acquired_at, expire_at = EXCLUDED.expire_at
WHERE l.expire_at <= now()
RETURNING fence
"""
FLOOR_LEASE_RELEASE = "DELETE FROM django_dlock_lock WHERE name = %s AND token = %s"
FLOOR_ROW_SELECT = "SELECT 1 FROM django_dlock_lock WHERE name = %s FOR UPDATE NOWAIT"


def floor_pairs(conn: Any, key: int, name: str) -> dict[str, Callable[[], None]]:
    """The raw floors on one psycopg connection (autocommit), for one key.

    ``key`` is an advisory-lock key, ``name`` a lease/row name; the row for
    ``row`` is created once, up front, as a user's table would have it.
    """
    conn.execute(
        "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
        "VALUES (%s, '', '', 0, now(), now()) ON CONFLICT DO NOTHING",
        [f"{name}:row"],
    )
    token = f"floor-{key}"

    def advisory() -> None:
        conn.execute("SELECT pg_try_advisory_lock(%s)", [key], prepare=True).fetchone()
        conn.execute("SELECT pg_advisory_unlock(%s)", [key], prepare=True).fetchone()

    def lease() -> None:
        got = conn.execute(FLOOR_LEASE_ACQUIRE, [name, token], prepare=True).fetchone()
        if got is None:
            raise RuntimeError("floor: uncontended lease acquire failed")
        conn.execute(FLOOR_LEASE_RELEASE, [name, token], prepare=True)

    def xact() -> None:
        conn.execute("BEGIN")
        conn.execute("SELECT pg_try_advisory_xact_lock(%s)", [key], prepare=True).fetchone()
        conn.execute("COMMIT")

    def row() -> None:
        conn.execute("BEGIN")
        conn.execute(FLOOR_ROW_SELECT, [f"{name}:row"], prepare=True).fetchone()
        conn.execute("COMMIT")

    return {"lease": lease, "advisory": advisory, "advisory_xact": xact, "row": row}


def _raw_contenders() -> dict[str, Callable[[], Any]]:
    conn = raw_connection()
    fast = raw_connection()
    fast.execute("SET synchronous_commit = off")
    floors = floor_pairs(conn, 42, "lock:bench-floor")
    return {
        FLOORS["lease"]: floors["lease"],
        FLOORS["lease, fast durability"]: floor_pairs(fast, 44, "lock:bench-floor-fast")["lease"],
        FLOORS["advisory"]: floors["advisory"],
        FLOORS["advisory_xact"]: floors["advisory_xact"],
        FLOORS["row"]: floors["row"],
        **django_share(conn),
    }


def django_share(conn: Any) -> dict[str, Callable[[], None]]:
    """The floors' one statement inside ``transaction.atomic`` on Django's connection.

    ``conn`` (a raw connection) creates the row once, as :func:`floor_pairs` does.
    """
    from django.db import connection, transaction

    name = "lock:bench-django-share:row"
    conn.execute(
        "INSERT INTO django_dlock_lock (name, token, owner, fence, acquired_at, expire_at) "
        "VALUES (%s, '', '', 0, now(), now()) ON CONFLICT DO NOTHING",
        [name],
    )

    def run(sql: str, param: Any) -> None:
        with transaction.atomic():
            connection.ensure_connection()
            raw = connection.connection
            # Django turns psycopg's preparation off; lift it for this statement.
            raw.prepare_threshold = 2**31
            try:
                raw.execute(sql, [param], prepare=True).fetchone()
            finally:
                raw.prepare_threshold = None

    def xact() -> None:
        run("SELECT pg_try_advisory_xact_lock(%s)", 43)

    def row() -> None:
        run(FLOOR_ROW_SELECT, name)

    return {DJANGO_XACT: xact, DJANGO_ROW: row}


def user_pair(strategy: str, key: str) -> Callable[[], None]:
    """One pair written the way users write it: a new lock per call."""
    from django.db import transaction

    import django_dlock as dlock

    if strategy in ("advisory_xact", "row"):

        def in_transaction() -> None:
            with transaction.atomic(), dlock.lock(key, strategy=strategy, timeout=0):
                pass

        return in_transaction

    def plain() -> None:
        with dlock.lock(key, strategy=strategy, ttl=60, timeout=0):
            pass

    return plain


def reused_pair(strategy: str, key: str) -> Callable[[], None]:
    """The same pair with one ``Lock`` object built once and reused."""
    from django.db import transaction

    import django_dlock as dlock

    lk = dlock.lock(key, strategy=strategy, ttl=60, timeout=0)
    if strategy in ("advisory_xact", "row"):

        def in_transaction() -> None:
            with transaction.atomic(), lk:
                pass

        return in_transaction

    def plain() -> None:
        with lk:
            pass

    return plain


def _ours() -> dict[str, Callable[[], Any]]:
    from django.conf import settings

    from django_dlock.conf import _forget_checked

    fast_lease = user_pair("lease", "bench-lease-fast")
    setting = "DLOCK_LEASE_SYNCHRONOUS_COMMIT"

    def fast() -> None:
        # A plain attribute (override_settings would cost more than a pair),
        # and what its setting_changed signal does: django-dlock keeps the
        # settings it read until that signal says one changed.
        settings.DLOCK_LEASE_SYNCHRONOUS_COMMIT = False
        _forget_checked(setting)
        try:
            fast_lease()
        finally:
            settings.DLOCK_LEASE_SYNCHRONOUS_COMMIT = True
            _forget_checked(setting)

    ours: dict[str, Callable[[], Any]] = {}
    for strategy in ("lease", "advisory", "advisory_xact", "row"):
        ours[strategy] = user_pair(strategy, f"bench-{strategy}")
        ours[f"{strategy}, reused Lock object"] = reused_pair(strategy, f"bench-{strategy}-reused")
    ours["lease, fast durability"] = fast
    return ours


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
