"""``with_lock`` on function views, CBVs, async views, streaming and plain functions."""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connections
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, Client

import django_dlock as dlock
from django_dlock.decorators import Contention, KeyTemplate, fit_key, locked_response, with_lock
from django_dlock.exceptions import KeyTemplateError, MissingKeyArgument

from .helpers import in_thread, wait_until
from .views import PROBE

pytestmark = pytest.mark.django_db(transaction=True)

N = 4  # concurrent requests (the machine has 2 cores)


def contend(request: Callable[[], Any], n: int = N) -> list[Any]:
    """Send ``n`` requests at once while the one that gets in is held at the gate.

    Returns the results: the gate opens only when the other ``n - 1`` have
    answered, so they all met the lock held.
    """
    PROBE.reset()
    PROBE.close_gate()
    results: list[Any] = []
    mutex = threading.Lock()

    def worker() -> None:
        try:
            result = request()
        except BaseException as exc:  # pragma: no cover - reported below
            result = exc
        finally:
            connections.close_all()
        with mutex:
            results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(results) >= n - 1 and PROBE.entered >= 1 or len(results) == n, 60)
    finally:
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)
    assert len(results) == n
    return results


def contend_permits(request: Callable[[], Any], permits: int, n: int = 5) -> list[Any]:
    """Send ``n`` requests at once; ``permits`` of them get in and are held at the
    gate until the others have answered."""
    PROBE.reset()
    PROBE.close_gate()
    results: list[Any] = []
    mutex = threading.Lock()

    def worker() -> None:
        try:
            result = request()
        finally:
            connections.close_all()
        with mutex:
            results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: PROBE.entered == permits and len(results) == n - permits, 60)
    finally:
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)
    assert len(results) == n
    return results


def statuses(responses: list[Any]) -> list[int]:
    return sorted(r.status_code for r in responses)


def test_concurrent_requests_one_proceeds_the_rest_get_423():
    responses = contend(lambda: Client().post("/invoice/42/"))
    assert statuses(responses) == [200] + [423] * (N - 1)
    assert PROBE.entered == 1 and PROBE.max_active == 1
    for response in responses:
        if response.status_code == 423:
            assert response["Retry-After"] == "1"
            assert response["Content-Type"].startswith("text/plain")
            assert b'"invoice:42"' in response.content
    # released when the response was returned
    assert not dlock.lock("invoice:42").locked()
    assert Client().post("/invoice/42/").status_code == 200


def test_permits_let_that_many_requests_in_and_answer_423_to_the_rest():
    responses = contend_permits(lambda: Client().post("/export/csv/"), permits=2)
    assert statuses(responses) == [200, 200, 423, 423, 423]
    assert PROBE.max_active == 2
    refused = [r for r in responses if r.status_code == 423]
    assert all(r["Retry-After"] == "1" and b'"export:csv"' in r.content for r in refused)
    assert not dlock.semaphore("export:csv", permits=2).locked()
    assert Client().post("/export/csv/").status_code == 200


def test_different_kwargs_do_not_contend():
    PROBE.reset()
    PROBE.close_gate()
    box: dict[int, int] = {}

    def call(invoice_id: int) -> None:
        box[invoice_id] = Client().post(f"/invoice/{invoice_id}/").status_code
        connections.close_all()

    threads = [threading.Thread(target=call, args=(i,)) for i in (1, 2)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: PROBE.entered == 2)  # both inside at once
    finally:
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)
    assert box == {1: 200, 2: 200}


def test_live_server_concurrent_requests(live_server):
    url = f"{live_server.url}/invoice/7/"

    def get() -> tuple[int, str | None, bytes]:
        request = urllib.request.Request(url)  # GET: no CSRF token needed
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.headers.get("Retry-After"), response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After"), error.read()

    results = contend(get)
    assert sorted(code for code, _, _ in results) == [200] + [423] * (N - 1)
    for code, retry_after, body in results:
        if code == 423:
            assert retry_after == "1"
            assert b"invoice:7" in body
    assert not dlock.lock("invoice:7").locked()


def _serialised_run(get: Callable[[], Any]) -> list[Any]:
    PROBE.reset()
    results: list[Any] = []
    mutex = threading.Lock()

    def worker() -> None:
        try:
            result = get()
        finally:
            connections.close_all()
        with mutex:
            results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return results


def test_wait_mode_serialises_requests():
    responses = _serialised_run(lambda: Client().post("/invoice/3/wait/"))
    assert statuses(responses) == [200, 200, 200]
    assert PROBE.entered == 3 and PROBE.max_active == 1


def test_wait_mode_serialises_live_server_requests(live_server):
    url = f"{live_server.url}/invoice/4/wait/"

    def get() -> int:
        request = urllib.request.Request(url)
        with urllib.request.urlopen(request, timeout=120) as response:
            return int(response.status)

    assert sorted(_serialised_run(get)) == [200, 200, 200]
    assert PROBE.max_active == 1


def test_async_view():
    PROBE.reset()
    PROBE.close_gate()

    async def scenario() -> tuple[Any, Any, Any]:
        client = AsyncClient()
        first = asyncio.ensure_future(client.post("/invoice/9/async/"))
        for _ in range(6000):
            if PROBE.entered:
                break
            await asyncio.sleep(0.01)
        assert PROBE.entered == 1, "the first request never entered the view"
        second = await client.post("/invoice/9/async/")
        PROBE.gate.set()
        done = await first
        third = await client.post("/invoice/9/async/")
        return done, second, third

    try:
        first, second, third = async_to_sync(scenario)()
    finally:
        PROBE.gate.set()
    assert first.status_code == 200 and first.content == b"async 9"
    assert second.status_code == 423 and second["Retry-After"] == "1"
    assert third.status_code == 200
    assert PROBE.max_active == 1


def test_class_based_view_with_method_decorator():
    responses = contend(lambda: Client().post("/invoice/5/cbv/"), n=2)
    assert statuses(responses) == [200, 409]
    refused = next(r for r in responses if r.status_code == 409)
    assert refused["Retry-After"] == "3"
    assert b"cbv:5" in refused.content
    # the undecorated method is not locked
    assert Client().get("/invoice/5/cbv/").content == b"unlocked get"


def test_callable_key_and_callable_on_contention():
    responses = contend(lambda: Client().post("/invoice/8/callable/"), n=2)
    assert statuses(responses) == [200, 503]
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.content == b"busy: ('invoice', 8)"


def test_missing_kwarg_is_an_error_not_a_shared_key():
    with pytest.raises(MissingKeyArgument, match="order_id"):
        Client().get("/invoice/1/wrong/")
    assert not dlock.lock("order:").locked()


def test_missing_parameter_is_refused_at_decoration():
    with pytest.raises(MissingKeyArgument, match="order_id"):

        @with_lock("order:{order_id}")
        def view(request, invoice_id):
            return HttpResponse()


@pytest.mark.parametrize(
    "template",
    [
        "{request.user.password}",
        "{0}",
        "{}",
        "{a[0]}",
        "{x!r}",
        "{x:>10}",
        "{x",
        "x}",
        "{a.__class__}",
    ],
)
def test_templates_allow_only_plain_names(template):
    with pytest.raises(KeyTemplateError):
        with_lock(template)


def test_template_values_are_not_formatted_again():
    assert KeyTemplate.parse("a:{x}:{{lit}}").render({"x": "{y}"}) == "a:{y}:{lit}"


def test_bad_rendered_keys_become_digests():
    assert fit_key("ok") == "ok"
    for bad in ["", "x" * 300, "a\x00b"]:
        digest = fit_key(bad)
        assert digest.startswith("sha256:") and len(digest) == 71
    assert fit_key("x" * 300) != fit_key("x" * 301)


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"on_contention": "wait"}, ValueError),  # timeout=0 never waits
        ({"on_contention": 200}, ValueError),
        ({"on_contention": "later"}, ValueError),
        ({"retry_after": -1}, ValueError),
        ({"ttl": 0}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"using": "nope"}, ValueError),
        ({"strategy": "zookeeper"}, dlock.StrategyNotSupported),
        ({"permits": 0}, ValueError),
        ({"permits": 2, "strategy": "advisory"}, dlock.SemaphoreNotSupported),
        ({"permits": 2, "using": ["q1", "q2", "q3"]}, dlock.SemaphoreNotSupported),
    ],
)
def test_bad_options_are_refused_at_decoration(options, error):
    with pytest.raises(error):
        with_lock("k", **options)


def test_generators_are_refused():
    with pytest.raises(TypeError):

        @with_lock("k")
        def gen():
            yield 1


def test_streaming_response_holds_the_lock_until_closed():
    PROBE.reset()
    response = Client().get("/invoice/5/stream/")
    assert response.status_code == 200 and response.streaming
    lk = dlock.lock("stream:5")
    assert lk.locked()  # the view returned, the stream is not sent yet
    refused = in_thread(lambda: Client().get("/invoice/5/stream/"))
    assert refused.status_code == 423
    content = response.streaming_content  # type: ignore[attr-defined]
    assert b"".join(content) == b"one,two"  # consuming it closes the response
    assert not lk.locked()
    assert PROBE.entered == 1


def test_plain_function_key_from_arguments_and_contention():
    calls = []

    @with_lock("report:{day}")
    def build(day, *, kind="daily"):
        calls.append((day, kind))
        return "built"

    assert build("2024-05-01") == "built"
    lk = dlock.lock("report:2024-05-01")
    lk.acquire()
    try:
        with pytest.raises(dlock.LockTimeout):
            in_thread(build, "2024-05-01")
        assert in_thread(build, "2024-05-02", kind="weekly") == "built"
    finally:
        lk.release()
    assert calls == [("2024-05-01", "daily"), ("2024-05-02", "weekly")]


def test_plain_function_with_callable_on_contention():
    @with_lock("nightly", on_contention=lambda c: f"skipped {c.resource}")
    def nightly():
        return "ran"

    with dlock.lock("nightly"):
        assert in_thread(nightly) == "skipped nightly"
    assert nightly() == "ran"


def test_async_on_contention_callable_in_async_view():
    async def later(contention: Contention) -> HttpResponse:
        return HttpResponse("async busy", status=429)

    @with_lock("aview:{pk}", on_contention=later)
    async def view(request: HttpRequest, pk: int) -> HttpResponse:
        return HttpResponse("ok")

    request = HttpRequest()
    with dlock.lock("aview:1"):
        response = in_thread(lambda: async_to_sync(view)(request, pk=1))
    assert response.status_code == 429
    assert async_to_sync(view)(request, pk=1).status_code == 200


def test_exception_in_view_releases_the_lock():
    @with_lock("boom:{pk}")
    def view(request: HttpRequest, pk: int) -> HttpResponse:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        view(HttpRequest(), pk=1)
    assert not dlock.lock("boom:1").locked()


def test_locked_response_helper():
    response = locked_response("x", status=409, retry_after=None)
    assert response.status_code == 409 and "Retry-After" not in response


def test_logging_debug_on_acquire_info_on_contention(caplog):
    """A 423 is the lock doing its job: INFO, never WARNING; each record carries
    its facts as attributes (a structured formatter's fields), never the token."""
    caplog.set_level(logging.DEBUG, logger="django_dlock")
    responses = contend(lambda: Client().post("/invoice/11/"), n=2)
    assert statuses(responses) == [200, 423]
    records = [r for r in caplog.records if r.name == "django_dlock"]
    acquired = [r for r in records if "acquired lock:invoice:11" in r.getMessage()]
    assert acquired and acquired[0].levelno == logging.DEBUG
    assert acquired[0].lock_name == "lock:invoice:11" and acquired[0].lock_strategy == "lease"
    assert isinstance(acquired[0].lock_fence, int) and acquired[0].lock_wait >= 0
    assert acquired[0].lock_owner.endswith("(POST /invoice/11/)")
    gave_up = [r for r in records if "gave up" in r.getMessage()]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.INFO
    assert gave_up[0].lock_name == "lock:invoice:11"
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert not [r for r in records if "lock_token" in vars(r)]


def test_streaming_response_under_a_real_server_releases_after_sending(live_server):
    PROBE.reset()
    lk = dlock.lock("stream:6")
    with urllib.request.urlopen(f"{live_server.url}/invoice/6/stream/", timeout=60) as response:
        assert response.read() == b"one,two"
    # the server closes the response after sending it: then the lock is free
    wait_until(lambda: not lk.locked(), timeout=30)
    assert PROBE.entered == 1
