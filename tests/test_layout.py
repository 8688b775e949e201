"""The package layout: one import path per name, checks run from one registry,
and database threads close what they opened."""

from __future__ import annotations

import importlib
import threading

import pytest
from django.core import checks
from django.db import connections
from django.test import override_settings

from django_dlock._threads import SerialThread, start_db_thread

from .helpers import wait_until


def test_the_operator_functions_stay_importable_from_django_dlock_operations():
    from django_dlock import operations
    from django_dlock.operations import lease_rows, mysql_user_locks, pg_advisory

    homes = {
        lease_rows: (
            "Lease Released SecondsLeft annotate_state candidate_names default_alias "
            "find_lease force_release leases state_of token_prefix"
        ),
        pg_advisory: (
            "AdvisoryLock advisory_key advisory_key_of advisory_locks is_postgresql "
            "terminate_backend"
        ),
        mysql_user_locks: "UserLock UserLocks is_mysql user_lock_holder user_locks",
    }
    for home, names in homes.items():
        for name in names.split():
            assert getattr(operations, name) is getattr(home, name), name
    for name in operations.__all__:
        assert hasattr(operations, name)


# Django 6 runs the model checks on every database (the MySQL backend asks
# its server's version)
@pytest.mark.django_db(databases=["default", "sqlite", "mysql"])
def test_every_check_is_registered_including_the_direct_databases_one():
    with override_settings(DLOCK_DIRECT_DATABASES={"default": "nope"}):
        found = [m.id for m in checks.run_checks() if m.id and m.id.startswith("dlock.")]
    assert "dlock.E050" in found
    with override_settings(DLOCK_DEFAULT_TTL=0):
        found = [m.id for m in checks.run_checks() if m.id and m.id.startswith("dlock.")]
    assert "dlock.E002" in found


def _backend_gone(pid: int) -> bool:
    with connections["default"].cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        return bool(cur.fetchone()[0] == 0)


def _pid_in_thread() -> int:
    with connections["default"].cursor() as cur:
        cur.execute("SELECT pg_backend_pid()")
        pid: int = cur.fetchone()[0]
    return pid


@pytest.mark.django_db(transaction=True)
def test_a_database_thread_closes_its_connection_when_it_ends():
    pids: list[int] = []
    start_db_thread(lambda: pids.append(_pid_in_thread()), "test-db-thread").join()
    assert len(pids) == 1
    wait_until(lambda: _backend_gone(pids[0]))


@pytest.mark.django_db(transaction=True)
def test_a_serial_thread_runs_calls_in_order_then_closes_its_connection():
    pids: list[int] = []
    order: list[int] = []
    exited = threading.Event()
    worker = SerialThread("test-serial", alias="default", on_exit=exited.set)
    for n in range(5):
        worker.post(lambda n=n: order.append(n))
    worker.post(lambda: pids.append(_pid_in_thread()))
    worker.close()
    worker.join(30)
    assert order == [0, 1, 2, 3, 4]
    assert exited.is_set()
    wait_until(lambda: _backend_gone(pids[0]))


def test_one_import_path_per_name_no_former_homes():
    import importlib

    from django_dlock import conf, decorators, exceptions, leader
    from django_dlock.strategies import advisory, base

    for gone in (
        "django_dlock.sessions",
        "django_dlock.strategies.advisory_mysql",
        "django_dlock.strategies.advisory.vendors",
        "django_dlock.strategies.deadline",
    ):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    for name in ("lock_connection", "close_private_connections", "Abandoned", "behind_pooler"):
        assert not hasattr(base, name), name  # their home: strategies.connection
    for name in ("ttl_error", "strategy_error", "MAX_SECONDS", "STRATEGIES"):
        assert name not in conf.__all__, name  # their home: django_dlock.validation
    # the advisory package hands on nothing: each name has its module
    assert not hasattr(advisory, "pg_locks_ids") and not hasattr(advisory, "advisory")
    # errors are exported by django_dlock and django_dlock.exceptions only
    assert not set(decorators.__all__) & set(exceptions.__all__)
    # the leader package exports what users call, not the modules' internals
    assert set(leader.__all__) == {
        "LeaderElection",
        "LeaderRecord",
        "Leadership",
        "STEPPING_DOWN",
        "TargetDied",
        "current_leadership",
    }


def test_one_registry_names_each_strategy_per_database():
    from django_dlock import strategies
    from django_dlock.strategies.advisory import mysql, postgresql

    assert strategies.implementation("advisory", "postgresql") is postgresql.advisory
    assert strategies.implementation("advisory", "mysql") is mysql.advisory_mysql
    lease = strategies.implementation("lease", "sqlite")
    assert strategies.implementation("lease", "postgresql") is lease
    with pytest.raises(strategies.StrategyNotSupported, match="needs PostgreSQL or MySQL"):
        strategies.implementation("advisory", "sqlite")
    assert set(strategies.REGISTRY) == {"lease", "advisory", "advisory_xact", "row"}


def test_the_models_and_the_sql_take_their_table_names_from_one_module():
    from django_dlock import cleanup, models, tables
    from django_dlock.strategies import fence, lease, queue, row

    assert models.Lock._meta.db_table == tables.LOCK_TABLE
    assert models.Waiter._meta.db_table == tables.WAITER_TABLE
    assert models.FenceFloor._meta.db_table == tables.FENCE_FLOOR_TABLE
    assert lease.TABLE == row.TABLE == queue.LOCKS == cleanup.TABLE == tables.LOCK_TABLE
    assert lease.WAITERS == queue.WAITERS == cleanup.WAITERS == tables.WAITER_TABLE
    # the functions of migrations 0009 and 0011 (a migration keeps its SQL as written)
    functions = importlib.import_module("django_dlock.migrations.0009_acquire_functions")
    ahead, _ = functions.CREATE
    assert f"FROM {tables.WAITER_TABLE} w" in ahead
    next_fence = importlib.import_module("django_dlock.migrations.0011_fence_era")
    assert f"nextval('{tables.FENCE_SEQUENCE}')" in next_fence.CREATE
    assert f"CREATE TABLE IF NOT EXISTS {tables.FENCE_ERA_TABLE} (" in next_fence.TABLE
    assert f"FROM {tables.FENCE_ERA_TABLE} WHERE id = 1" in next_fence.CREATE
    assert f"set_config('{fence.ERA_SEEN}', 'on', false)" in next_fence.CREATE
    assert f"nextval('{tables.FENCE_SEQUENCE}')" in fence.NEXT_FENCE
    assert "django_dlock_next_fence()" in fence.NEXT_FENCE
