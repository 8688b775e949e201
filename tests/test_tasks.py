"""``locked_task`` without workers: keys, validation, and runs on the framework's
own in-process backends (``immediate`` runs a task as it is enqueued, ``dummy``
keeps what was enqueued). The locks are real, on PostgreSQL; the runs with
real ``db_worker`` processes are in tests/test_tasks_workers.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from typing import Any

import pytest
from django.db import connections

import django_dlock as dlock
from django_dlock import signals
from django_dlock.contrib.tasks import (
    LockedTask,
    LockedTaskError,
    Task,
    TaskResultStatus,
    guard,
    locked_task,
)
from django_dlock.exceptions import DLockError, InvalidLockKey
from django_dlock.models import Lock as LockRow

#: a run that ended well ("SUCCEEDED" in the backport's 0.9 series)
SUCCEEDED = "SUCCESSFUL" if hasattr(TaskResultStatus, "SUCCESSFUL") else "SUCCEEDED"

pytestmark = pytest.mark.django_db(transaction=True)

SEEN: list[Any] = []


@locked_task(key="charge:{account_id}", backend="immediate")
def charge(account_id, amount=0):
    row = LockRow.objects.get(name=f"lock:{key_of(charge, account_id)}")
    SEEN.append(row.owner)
    return amount


@locked_task(backend="immediate", ttl=3)
def nightly():
    with guard():
        SEEN.append("guarded")
    return "ran"


@locked_task(key=lambda a, b: ("pair", a * 1000 + b), backend="immediate")
def pair(a, b):
    return [a, b]


@locked_task(key="exports", permits=2, on_busy="retry", retry_after=30, backend="dummy")
def export(n):
    return n


@locked_task(key="ctx:{n}", takes_context=True, backend="immediate")
def with_context(context, n):
    return [n, context.task_result.id]


@locked_task(key="async:{n}", backend="immediate")
async def aexport(n):
    await asyncio.sleep(0)
    return n


def key_of(task, *args, **kwargs):
    return task.lock_spec.lock_key(args, kwargs)


# -- keys ----------------------------------------------------------------------


def test_template_values_are_json_literals_so_distinct_values_never_share_a_key():
    assert key_of(charge, 42) == "charge:42"
    assert key_of(charge, "42") == 'charge:"42"'
    assert key_of(charge, None) == "charge:null"
    assert key_of(charge, "null") == 'charge:"null"'
    assert key_of(charge, account_id=7, amount=5) == "charge:7"
    assert key_of(charge, uuid.UUID(int=1)).startswith("charge:UUID(")
    values = [1, "1", 1.0, True, "true", None, "a:b", ["a", "b"], ["a:b"], {"1": 2}, {1: 2}]
    keys = [key_of(charge, v) for v in values]
    # {"1": 2} and {1: 2} are the same JSON: the task receives the same argument
    assert len(set(keys)) == len(values) - 1


def test_the_default_key_names_the_task_and_callables_return_the_key():
    assert key_of(nightly) == "tasks:tests.test_tasks.nightly"
    assert key_of(pair, 1, 2) == ("pair", 1002)


def test_long_or_unencodable_values_become_a_digest_that_no_value_can_name():
    long = key_of(charge, "x" * 300)
    assert long.startswith("sha256:") and len(long) == 7 + 64
    assert key_of(charge, "\ud800").startswith("sha256:")
    assert key_of(charge, "y" * 300) != long


def test_a_value_without_stable_text_is_refused_by_name():
    with pytest.raises(InvalidLockKey, match="no stable text"):
        key_of(charge, object())


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("k:{nope}", "names 'nope', which is not a named argument"),
        ("k:{a}{b}", "followed by another field"),
        ("k:{a}1{b}", "followed by '1'"),
        ("k:{a}-{b}", "followed by '-'"),
        ("k:{a.b}", "only plain argument names"),
        ("k:{a", "malformed"),
    ],
)
def test_bad_templates_are_refused_when_the_task_is_defined(key, match):
    def two(a, b): ...

    with pytest.raises(LockedTaskError, match=match):
        locked_task(key=key, backend="immediate")(two)


def test_literal_braces_and_separators_are_fine():
    def two(a, b): ...

    two.__qualname__ = "two"  # a module-level function, for the framework
    task = locked_task(key="k:{a}:{b}/{{x}}", backend="immediate")(two)
    assert task.lock_spec.lock_key((1, "2"), {}) == 'k:1:"2"/{x}'
    task = locked_task(key="{{plain}}", backend="immediate")(two)
    assert task.lock_spec.lock_key((1, 2), {}) == "{plain}"


# -- validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"on_busy": "wait"}, 'on_busy must be "skip" or "retry"'),
        ({"on_busy": "retry", "retry_after": 0, "backend": "dummy"}, "retry_after"),
        ({"permits": 0}, "permits"),
        ({"ttl": -1}, "ttl"),
        ({"key": 42}, "key must be a string"),
        ({"on_busy": "retry"}, "cannot defer"),  # the immediate backend
        ({"takes_context": True}, "first argument must be named 'context'"),
    ],
)
def test_options_that_cannot_work_are_refused_at_definition(options, match):
    def job(): ...

    job.__qualname__ = "job"
    with pytest.raises(LockedTaskError, match=match):
        locked_task(**{"backend": "immediate", **options})(job)


def test_retry_on_a_backend_that_cannot_defer_is_refused_at_enqueue():
    with pytest.raises(LockedTaskError, match="'immediate' .*cannot defer"):
        export.using(backend="immediate").enqueue(1)


def test_it_is_still_a_task_of_the_framework():
    from django_dlock.contrib.tasks import Task

    assert isinstance(charge, Task)
    assert charge.name == "charge"
    assert charge.module_path == "tests.test_tasks.charge"
    assert charge.using(priority=0).lock_spec is charge.lock_spec


try:  # the framework's in-process backend, on Django 6 or from the backport
    from django.tasks.backends.dummy import DummyBackend
except ImportError:
    from django_tasks.backends.dummy import DummyBackend


class CustomTask(Task):
    """A backend's own task class."""

    __slots__ = ()

    def enqueue(self, *args, **kwargs):
        SEEN.append("custom enqueue")
        return super().enqueue(*args, **kwargs)


class CustomBackend(DummyBackend):
    task_class = CustomTask


custom_job = None


def test_a_backend_with_a_task_class_of_its_own_gets_a_locked_one(settings):
    settings.TASKS = {
        "default": {"BACKEND": "tests.test_tasks.CustomBackend"},
        "immediate": {"BACKEND": settings.TASKS["immediate"]["BACKEND"]},
    }

    global custom_job  # the backend finds a task by its module path

    def job(n): ...

    job.__qualname__ = job.__name__ = "custom_job"
    task = custom_job = locked_task(key="job:{n}", on_busy="retry")(job)
    assert isinstance(task, CustomTask) and isinstance(task, LockedTask)
    SEEN.clear()
    task.enqueue(1)
    assert SEEN == ["custom enqueue"]
    with pytest.raises(LockedTaskError, match="cannot defer"):
        task.using(backend="immediate").enqueue(1)


# -- runs ----------------------------------------------------------------------


def hold(key, *, permits=None):
    """Hold ``key`` in another thread until the returned event is set."""
    held, done = threading.Event(), threading.Event()

    def run():
        lk = dlock.Semaphore(key, permits=permits) if permits else dlock.lock(key)
        try:
            with lk:
                held.set()
                done.wait(30)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    assert held.wait(30)
    return done, thread


def test_a_run_holds_its_key_and_names_its_task_and_result():
    SEEN.clear()
    result = charge.enqueue(42, amount=5)
    assert result.status == SUCCEEDED and result.return_value == 5
    assert f"task tests.test_tasks.charge[{result.id}]" in SEEN[0]
    assert not dlock.lock("charge:42").locked()


def test_a_busy_run_in_skip_mode_returns_none_with_a_signal_and_a_log_line(caplog):
    got = []

    def receiver(sender, **kwargs):
        got.append(kwargs)

    signals.lock_skipped.connect(receiver)
    done, thread = hold("charge:7")
    try:
        with caplog.at_level(logging.INFO, logger="django_dlock"):
            result = charge.enqueue(7, amount=5)
    finally:
        done.set()
        thread.join()
        signals.lock_skipped.disconnect(receiver)
    assert result.status == SUCCEEDED and result.return_value is None
    assert got == [
        {
            "signal": signals.lock_skipped,
            "name": "lock:charge:7",
            "reason": "held",
            "task": "tests.test_tasks.charge",
            "result_id": result.id,
        }
    ]
    assert "skipped task tests.test_tasks.charge: lock:charge:7 is held" in caplog.text
    assert charge.enqueue(7, amount=5).return_value == 5  # free again


def test_a_busy_run_in_retry_mode_is_enqueued_again_with_run_after():
    from django_dlock.contrib.tasks import task_backends

    backend = task_backends["dummy"]
    backend.clear()
    done, thread = hold("exports", permits=2)
    done2, thread2 = hold("exports", permits=2)
    try:
        assert export.call(3) is None  # as a worker would run it: busy
    finally:
        done.set()
        done2.set()
        thread.join()
        thread2.join()
    (again,) = backend.results
    assert again.args == [3] and again.task.run_after is not None
    assert export.call(4) == 4  # a free permit: runs


def test_guard_is_for_the_body_of_a_running_task():
    SEEN.clear()
    assert nightly.enqueue().return_value == "ran"
    assert SEEN == ["guarded"]
    with pytest.raises(DLockError, match="body of a running"):
        guard()


def test_the_context_is_passed_on_when_the_task_takes_it():
    result = with_context.enqueue(3)
    assert result.return_value == [3, result.id]


def test_async_tasks_hold_the_lock_too():
    assert aexport.enqueue(2).return_value == 2
    done, thread = hold("async:5")
    try:
        assert aexport.enqueue(5).return_value is None
    finally:
        done.set()
        thread.join()
