"""The ``row`` strategy: ``SELECT ... FOR UPDATE`` on the key's row, PostgreSQL and MariaDB."""

from __future__ import annotations

import threading

import pytest
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from .helpers import in_thread

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])

ROW = "row"
ROW_ALIASES = ["default", "mysql"]


@pytest.fixture(autouse=True)
def _close_private():
    yield
    close_private_connections()


@pytest.fixture(params=ROW_ALIASES, ids=["postgresql", "mariadb"])
def db(request) -> str:
    return request.param


def other_try(key, alias, **options) -> bool:
    """In another thread and transaction: could the lock be taken now?"""

    def attempt() -> bool:
        with transaction.atomic(using=alias):
            return dlock.lock(key, strategy=ROW, using=alias, **options).acquire(timeout=0)

    return in_thread(attempt)


def rows(alias: str, name: str) -> list[tuple[str, bool]]:
    """(token, free on the database clock) of the rows called ``name``."""
    from django_dlock.models import Lock as LockRow

    found = LockRow.objects.using(alias).filter(name=name)
    free = set(found.expired().values_list("name", flat=True))
    return [(token, n in free) for n, token in found.values_list("name", "token")]


def test_refused_on_sqlite():
    with (
        CaptureQueriesContext(connections["sqlite"]) as queries,
        pytest.raises(dlock.StrategyNotSupported, match="PostgreSQL or MySQL"),
    ):
        dlock.lock("k", strategy=ROW, using="sqlite").acquire()
    assert len(queries) == 0


def test_outside_a_transaction_is_a_clear_error(db):
    with pytest.raises(dlock.DLockError, match=r"transaction\.atomic"):
        dlock.lock("x", strategy=ROW, using=db).acquire()


def test_the_row_is_created_free_and_locked(db):
    with transaction.atomic(using=db):
        lk = dlock.lock("job", strategy=ROW, using=db)
        assert lk.acquire(timeout=0)
        assert lk.held() and lk.owned() and lk.locked()
        assert other_try("job", db) is False
        # a free lease row: empty token, expire_at in the past (database clock)
        assert rows(db, "lock:job") == [("", True)]
    assert not lk.held()
    assert not dlock.lock("job", strategy=ROW, using=db).locked()
    assert other_try("job", db) is True
    assert rows(db, "lock:job") == [("", True)]  # still one row


def test_released_at_commit_and_at_rollback(db):
    seen: dict[str, bool] = {}
    with transaction.atomic(using=db):
        dlock.lock("commit", strategy=ROW, using=db).acquire()
        transaction.on_commit(lambda: seen.setdefault("after", other_try("commit", db)), using=db)
        seen["before"] = other_try("commit", db)
    assert seen == {"before": False, "after": True}
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=db):
        dlock.lock("rollback", strategy=ROW, using=db).acquire()
        assert other_try("rollback", db) is False
        _ = 1 / 0
    assert other_try("rollback", db) is True


def test_explicit_release_is_an_error_and_the_holding_ends_with_the_transaction(db):
    lk = dlock.lock("r", strategy=ROW, using=db)
    with transaction.atomic(using=db):
        lk.acquire()
        with pytest.raises(dlock.DLockError, match="transaction ends"):
            lk.release()
    with transaction.atomic(using=db):
        assert not lk.held()
        assert lk.acquire(timeout=0)
        assert other_try("r", db) is False


def test_a_row_deleted_while_waiting_is_made_again(db):
    from django_dlock.models import Lock as LockRow

    go, holding = threading.Event(), threading.Event()

    def holder() -> None:
        with transaction.atomic(using=db):
            dlock.lock("gone", strategy=ROW, using=db).acquire()
            holding.set()
            go.wait(30)
            LockRow.objects.using(db).filter(name="lock:gone").delete()  # as cleanup would
        connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert holding.wait(30)
    result: dict[str, bool] = {}

    def waiter() -> None:
        with transaction.atomic(using=db):
            lk = dlock.lock("gone", strategy=ROW, using=db)
            result["got"] = lk.acquire(timeout=60)
            result["blocks others"] = other_try("gone", db) is False
        close_private_connections()
        connections.close_all()

    waiting = threading.Thread(target=waiter)
    waiting.start()
    threading.Event().wait(0.5)
    go.set()
    thread.join(30)
    waiting.join(60)
    assert result == {"got": True, "blocks others": True}


def test_inspection_holds_nothing(db):
    lk = dlock.lock("look", strategy=ROW, using=db)
    with transaction.atomic(using=db):
        lk.acquire()
    assert not lk.locked()
    assert other_try("look", db) is True


def test_check_e011_row_needs_row_locks():
    from django_dlock.checks import database_messages

    assert [m.id for m in database_messages("row", "x", {}, "sqlite")] == ["dlock.E011"]
    assert database_messages("row", "x", {}, "postgresql") == []
    assert database_messages("row", "x", {}, "mysql") == []
    with override_settings(DLOCK_DEFAULT_STRATEGY="row"):
        from django_dlock.checks import check_strategy_database

        assert check_strategy_database() == []  # the lock database is PostgreSQL


# -- concurrency -----------------------------------------------------------------------
