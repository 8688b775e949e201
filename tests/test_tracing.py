"""OpenTelemetry traces (``DLOCK_TRACING = "opentelemetry"``), read back with the
SDK's in-memory exporter: the spans of acquire, hold, renew, release, loss and a
leader's term, for every strategy, a semaphore, a TaskLock, a view's
``@with_lock`` and a Celery task; lock names plain, hashed or off; no token."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.test import Client, override_settings

import django_dlock as dlock
from django_dlock import testing as kit
from django_dlock import tracing
from django_dlock.checks import check_tracing

from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


class Spans:
    """The finished spans, by name, and checks on them."""

    def __init__(self, exporter: Any) -> None:
        self.exporter = exporter

    def all(self) -> list[Any]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[Any]:
        return [span for span in self.all() if span.name == name]

    def one(self, name: str) -> Any:
        found = self.named(name)
        assert len(found) == 1, [span.name for span in self.all()]
        return found[0]

    def children(self, parent: Any, name: str) -> list[Any]:
        return [
            span
            for span in self.named(name)
            if span.parent is not None and span.parent.span_id == parent.context.span_id
        ]


@pytest.fixture(scope="session")
def exporter() -> Any:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    trace.set_tracer_provider(provider)
    return found


@pytest.fixture
def spans(exporter: Any, settings: Any) -> Iterator[Spans]:
    settings.DLOCK_TRACING = "opentelemetry"
    exporter.clear()
    yield Spans(exporter)
    exporter.clear()


def outer_span() -> Any:
    """A span standing for the caller's own (a request's, a task's)."""
    from opentelemetry import trace

    return trace.get_tracer("tests").start_as_current_span("caller")


def no_token_anywhere(spans: Spans, token: str) -> None:
    for span in spans.all():
        for key, value in (span.attributes or {}).items():
            assert "token" not in key
            assert token not in str(value), (span.name, key)


CELLS = [
    ("lease", "default"),
    ("lease", "sqlite"),
    ("lease", "mysql"),
    ("row", "default"),
    ("row", "mysql"),
    ("advisory", "default"),
    ("advisory", "mysql"),
    ("advisory_xact", "default"),
]


@pytest.mark.parametrize(("strategy", "alias"), CELLS, ids=[f"{s}-{a}" for s, a in CELLS])
def test_acquire_hold_and_release_spans_on_every_strategy(spans, strategy, alias):
    transactional = strategy in ("row", "advisory_xact")
    lk = dlock.lock("report", using=alias, strategy=strategy)
    with outer_span() as caller:
        if transactional:
            with transaction.atomic(using=alias), lk:
                fence = lk.fence
        else:
            with lk:
                fence = lk.fence
    acquire, hold = spans.one("dlock.acquire"), spans.one("dlock.hold")
    # both are the caller's children: the hold outlives the acquire
    assert acquire.parent.span_id == caller.get_span_context().span_id
    assert hold.parent.span_id == caller.get_span_context().span_id
    assert acquire.end_time <= hold.end_time
    for span in (acquire, hold):
        assert span.attributes["dlock.lock.name"] == "lock:report"
        assert span.attributes["dlock.strategy"] == strategy
        assert span.attributes["dlock.primitive"] == "Lock"
        assert span.attributes["db.namespace"] == alias
    assert acquire.attributes["dlock.acquire.outcome"] == "acquired"
    assert acquire.attributes["dlock.acquire.attempts"] == 1
    assert acquire.attributes["dlock.acquire.wait"] >= 0
    assert hold.attributes["dlock.hold.outcome"] == "released"
    if fence is not None:
        assert hold.attributes["dlock.lock.fence"] == fence
    if fence is not None and not (transactional and alias == "default"):
        assert acquire.attributes["dlock.lock.fence"] == fence
    else:
        # none, or (row, advisory_xact on PostgreSQL) drawn when first read,
        # after the acquire: only the hold span carries it
        assert "dlock.lock.fence" not in acquire.attributes
    if not transactional:  # the transaction's end releases the others
        (release,) = spans.children(hold, "dlock.release")
        assert release.end_time <= hold.end_time
    assert str(hold.status.status_code) == "StatusCode.UNSET"


def test_a_semaphore_permit_is_a_hold_of_its_own_row(spans, alias):
    sem = dlock.semaphore("exports", permits=2, using=alias)
    with kit.held_elsewhere(sem), sem:
        pass
    mine = [
        s for s in spans.named("dlock.acquire") if s.attributes["dlock.primitive"] == "Semaphore"
    ]
    assert len(mine) == 2  # the other holder's and ours
    holds = spans.named("dlock.hold")
    assert {span.attributes["dlock.lock.name"] for span in holds} == {"semaphore:exports"}
    assert len(holds) == 2 and all(span.attributes["dlock.lock.fence"] for span in holds)


def test_contention_skipped_and_timeout_with_attempts_and_queue_place(spans, alias):
    with kit.held_elsewhere("busy", using=alias, timeout=30):
        spans.exporter.clear()
        assert dlock.lock("busy", using=alias).acquire(timeout=0) is False
        assert dlock.lock("busy", using=alias, retry_interval=0.05).acquire(timeout=0.5) is False
    skipped, timed_out = spans.named("dlock.acquire")
    assert skipped.attributes["dlock.acquire.outcome"] == "skipped"
    assert skipped.attributes["dlock.acquire.attempts"] == 1
    assert "dlock.acquire.queue_position" not in skipped.attributes
    assert timed_out.attributes["dlock.acquire.outcome"] == "timeout"
    assert timed_out.attributes["dlock.acquire.queue_position"] == 1  # the head
    assert timed_out.attributes["dlock.acquire.attempts"] >= 1
    assert not spans.named("dlock.hold") or all(
        span.attributes["dlock.hold.outcome"] == "released" for span in spans.named("dlock.hold")
    )


def test_an_error_is_recorded_on_the_acquire_span(spans):
    lk = dlock.lock("in-tx", strategy="row")  # outside a transaction: refused
    with pytest.raises(dlock.DLockError):
        lk.acquire()
    acquire = spans.one("dlock.acquire")
    assert acquire.attributes["dlock.acquire.outcome"] == "error"
    assert acquire.attributes["error.type"]
    assert str(acquire.status.status_code) == "StatusCode.ERROR"
    # recorded once (the span's own context manager records nothing more)
    assert [event.name for event in acquire.events] == ["exception"]


def test_renewals_are_children_of_the_hold(spans, alias):
    lk = dlock.lock("renewed", using=alias, ttl=30)
    with lk:
        lk.extend(30)
    hold = spans.one("dlock.hold")
    (renew,) = spans.children(hold, "dlock.renew")
    assert renew.attributes["dlock.renew.outcome"] == "renewed"


def test_a_loss_ends_the_hold_in_error_with_its_reason(spans, alias):
    lk = dlock.lock("lost", using=alias, ttl=30)
    with pytest.raises(dlock.LockLost), lk:
        kit.expire(lk)
    hold = spans.one("dlock.hold")
    assert hold.attributes["dlock.hold.outcome"] == "lost"
    assert str(hold.status.status_code) == "StatusCode.ERROR"
    (lost,) = [event for event in hold.events if event.name == "dlock.lost"]
    assert "expired" in lost.attributes["dlock.lost.reason"]


def test_no_attribute_carries_a_token(spans, alias):
    lk = dlock.lock("secret", using=alias, ttl=30)
    with lk:
        token = lk._holdings()[0].request.token
        lk.extend(30)
    assert token
    no_token_anywhere(spans, token)


@pytest.mark.parametrize("names", ["hashed", "off"])
def test_lock_names_hashed_or_left_out(spans, settings, names):
    settings.DLOCK_TRACING_LOCK_NAMES = names
    with dlock.lock("customer:alice@example.com"):
        pass
    for span in spans.named("dlock.acquire") + spans.named("dlock.hold"):
        shown = span.attributes.get("dlock.lock.name")
        if names == "off":
            assert shown is None
        else:
            digest = hashlib.sha256(b"lock:customer:alice@example.com").hexdigest()[:16]
            assert shown == digest
    for span in spans.all():
        assert "alice" not in str(dict(span.attributes))


def test_a_tasklock_skip(spans, alias):
    with kit.held_elsewhere(dlock.TaskLock("digest", using=alias)):
        spans.exporter.clear()
        with dlock.TaskLock("digest", using=alias) as acquired:
            assert acquired is False
    acquire = spans.one("dlock.acquire")
    assert acquire.attributes["dlock.primitive"] == "TaskLock"
    assert acquire.attributes["dlock.acquire.outcome"] == "skipped"


def test_a_views_lock_names_the_request(spans):
    response = Client().get("/invoice/7/")
    assert response.status_code == 200
    acquire, hold = spans.one("dlock.acquire"), spans.one("dlock.hold")
    for span in (acquire, hold):
        assert span.attributes["dlock.lock.name"] == "lock:invoice:7"
        assert span.attributes["dlock.holder.context"] == "GET /invoice/7/"


def test_a_celery_tasks_lock_names_the_task(spans):
    # an app of its own: importing tests.celery_app here would fix its queue for
    # this process, and tests/test_celery.py's real worker needs another
    from celery import Celery

    from django_dlock.contrib.celery import SingleInstanceTask

    app = Celery("tracing", set_as_current=False)

    @app.task(base=SingleInstanceTask, name="billing.charge", lock_args=["invoice"])
    def charge(invoice: int) -> None:
        pass

    charge(1)  # run here, as a worker runs it (no broker needed)
    acquire = spans.one("dlock.acquire")
    assert acquire.attributes["dlock.acquire.outcome"] == "acquired"
    assert acquire.attributes["dlock.lock.name"] == "lock:celery:billing.charge:1"
    assert acquire.attributes["dlock.holder.context"] == "celery billing.charge"


def test_a_leaders_term_is_a_span(spans, alias):
    election = dlock.LeaderElection("traced", using=alias, lease=2.0, renew_deadline=1.5, retry=0.2)
    with election:
        wait_until(lambda: election.is_leader)
        term = election.term
    wait_until(lambda: bool(spans.named("dlock.leader.term")))
    (span,) = spans.named("dlock.leader.term")
    assert span.attributes["dlock.leader.term"] == term
    assert span.attributes["dlock.lock.name"] == "leader:traced"
    assert span.attributes["dlock.primitive"] == "LeaderElection"
    assert span.attributes["dlock.leader.end"] == "stepped down"
    assert str(span.status.status_code) == "StatusCode.UNSET"


def test_an_async_acquire_is_traced(spans, alias):
    async def main() -> None:
        async with dlock.lock("async-report", using=alias):
            pass
        await sync_to_async(connections.close_all)()

    asyncio.run(main())
    assert spans.one("dlock.acquire").attributes["dlock.acquire.outcome"] == "acquired"
    assert spans.one("dlock.hold").attributes["dlock.hold.outcome"] == "released"


def test_a_cancelled_async_acquire_is_cancelled_not_an_error(spans, alias):
    async def main() -> None:
        task = asyncio.ensure_future(dlock.lock("cancelled", using=alias).aacquire(timeout=30))
        await asyncio.sleep(0.5)  # waiting behind the other holder
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()

    with kit.held_elsewhere("cancelled", using=alias, timeout=30):
        spans.exporter.clear()
        asyncio.run(main())
    acquire = spans.one("dlock.acquire")
    assert acquire.attributes["dlock.acquire.outcome"] == "cancelled"
    assert str(acquire.status.status_code) == "StatusCode.UNSET"
    assert not any(event.name == "exception" for event in acquire.events)


def test_off_by_default_nothing_is_made(exporter, settings):
    settings.DLOCK_TRACING = None
    exporter.clear()
    with dlock.lock("quiet"):
        pass
    assert list(exporter.get_finished_spans()) == []


def test_checks_e043_e044_e045_and_tracing_stays_off(monkeypatch):
    for value in ("otel", True, "OpenTelemetry"):
        with override_settings(DLOCK_TRACING=value):
            assert [m.id for m in check_tracing()] == ["dlock.E043"]
            assert tracing.tracer is None
    with override_settings(DLOCK_TRACING="opentelemetry", DLOCK_TRACING_LOCK_NAMES="sha"):
        assert [m.id for m in check_tracing()] == ["dlock.E045"]
        assert tracing.tracer is None
    with override_settings(DLOCK_TRACING="opentelemetry"):
        assert check_tracing() == []
        assert tracing.tracer is not None
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)  # import raises ImportError
    with override_settings(DLOCK_TRACING="opentelemetry"):
        assert [m.id for m in check_tracing()] == ["dlock.E044"]
        assert tracing.tracer is None
    assert check_tracing() == []
