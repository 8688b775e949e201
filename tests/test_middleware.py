"""``LockMiddleware``: rules per user, per anonymous session, URL kwargs, sync and async."""

from __future__ import annotations

import asyncio
import threading

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.test import AsyncClient, Client, override_settings

import django_dlock as dlock

from .helpers import in_thread, wait_until
from .test_decorators import contend, contend_permits, statuses
from .views import PROBE

pytestmark = pytest.mark.django_db(transaction=True)

LOCK_MIDDLEWARE = "django_dlock.middleware.LockMiddleware"
RULES = [
    {"path": r"^/checkout/$", "methods": ["POST"], "key": "checkout:{user}", "name": "checkout"},
    {"path": r"^/checkout/async/$", "methods": ["post"], "key": "acheckout:{user}"},
    {"path": r"^/shop/", "key": "shop:{shop}:{ip}", "retry_after": 5},
    {"path": r"^/limited/", "key": "limited", "name": "limited", "permits": 2},
]


@pytest.fixture(autouse=True)
def lock_middleware():
    with override_settings(
        MIDDLEWARE=[*settings.MIDDLEWARE, LOCK_MIDDLEWARE], DLOCK_MIDDLEWARE_RULES=RULES
    ):
        yield
    PROBE.reset()


def logged_in_client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def make_user(name: str):
    return get_user_model().objects.create_user(username=name, password="pw-" + name)


def test_same_user_is_serialised():
    user = make_user("alice")
    responses = contend(lambda: logged_in_client(user).post("/checkout/"), n=3)
    assert statuses(responses) == [200, 423, 423]
    refused = [r for r in responses if r.status_code == 423]
    assert all(r["Retry-After"] == "1" for r in refused)
    # the body names the rule, never the rendered key
    assert all(b'"checkout"' in r.content for r in refused)
    assert not dlock.lock(f"checkout:{user.pk}").locked()


def test_a_rule_with_permits_lets_that_many_requests_in():
    responses = contend_permits(lambda: Client().get("/limited/1/"), permits=2)
    assert statuses(responses) == [200, 200, 423, 423, 423]
    assert PROBE.max_active == 2
    assert not dlock.semaphore("limited", permits=2).locked()


def test_a_rules_lock_names_the_request():
    from django_dlock.models import Lock as LockRow

    PROBE.reset()
    PROBE.close_gate()
    thread = threading.Thread(target=lambda: (Client().get("/limited/3/"), connections.close_all()))
    thread.start()
    try:
        wait_until(lambda: PROBE.entered == 1)
        owners = list(LockRow.objects.held().values_list("owner", flat=True))
        assert [o for o in owners if o.endswith("(GET /limited/3/)")], owners
    finally:
        PROBE.gate.set()
        thread.join(30)


def test_a_rule_with_bad_permits_is_named():
    from django_dlock.middleware import rule_problems

    problems = rule_problems([{"path": "^/x/", "key": "x", "permits": 0}])
    assert problems and problems[0][0] == "dlock.E025" and "permits" in problems[0][1]
    problems = rule_problems([{"path": "^/x/", "key": "x", "permits": 2, "strategy": "row"}])
    assert problems and "cannot count permits" in problems[0][1]


def test_different_users_do_not_contend():
    alice, bob = make_user("alice"), make_user("bob")
    PROBE.reset()
    PROBE.close_gate()
    codes: dict[str, int] = {}

    def post(user) -> None:
        codes[user.username] = logged_in_client(user).post("/checkout/").status_code
        connections.close_all()

    threads = [threading.Thread(target=post, args=(u,)) for u in (alice, bob)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: PROBE.entered == 2)  # both inside at once
    finally:
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)
    assert codes == {"alice": 200, "bob": 200}


def test_anonymous_session_is_created_and_serialised():
    first = Client()
    assert first.post("/checkout/").status_code == 200
    session_key = first.cookies[settings.SESSION_COOKIE_NAME].value
    assert session_key

    def same_session() -> object:
        client = Client()
        client.cookies[settings.SESSION_COOKIE_NAME] = session_key
        return client.post("/checkout/")

    responses = contend(same_session, n=3)
    assert statuses(responses) == [200, 423, 423]

    # another anonymous visitor is not held up by this one: both are inside at once
    PROBE.reset()
    PROBE.close_gate()

    def known() -> None:
        same_session()
        connections.close_all()

    def stranger() -> None:
        Client().post("/checkout/")
        connections.close_all()

    threads = [threading.Thread(target=known), threading.Thread(target=stranger)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: PROBE.entered == 2)
    finally:
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)


def test_anonymous_key_is_the_session_digest():
    from django_dlock.middleware import session_digest

    client = Client()
    client.post("/checkout/")
    session_key = client.cookies[settings.SESSION_COOKIE_NAME].value
    with dlock.lock(f"checkout:anon:{session_digest(session_key)}"):
        assert in_thread(lambda: client.post("/checkout/")).status_code == 423


def test_no_session_key_in_lock_names_logs_rows_or_dlock_list(caplog):
    """A session key is a credential: it stands in a lock's name only as a digest,
    the same for one session, different for two."""
    import logging
    from io import StringIO

    from django.core.management import call_command

    from django_dlock.middleware import session_digest
    from django_dlock.models import Lock as LockRow

    caplog.set_level(logging.DEBUG, logger="django_dlock")
    first, second = Client(), Client()
    for client in (first, first, second):
        assert client.post("/checkout/").status_code == 200
    keys = [c.cookies[settings.SESSION_COOKIE_NAME].value for c in (first, second)]
    assert keys[0] != keys[1]
    names = sorted(_checkout_rows())
    # one name per session, stable across its requests
    assert names == sorted(f"lock:checkout:anon:{session_digest(k)}" for k in keys)
    assert len(set(names)) == 2
    listed = StringIO()
    call_command("dlock_list", "--all", stdout=listed)
    rows = [str(row) for row in LockRow.objects.values()]
    logged = [r.getMessage() + repr(r.args) for r in caplog.records]
    assert any("checkout:anon:" in line for line in logged), logged
    for key in keys:
        assert not [n for n in names if key in n]
        assert not [r for r in rows if key in r]
        assert not [line for line in logged if key in line]
        assert key not in listed.getvalue()
    assert "checkout:anon:" in listed.getvalue()


def test_session_rule_uses_the_digest():
    from django_dlock.middleware import session_digest

    rules = [{"path": r"^/checkout/$", "key": "s:{session}"}]
    with override_settings(DLOCK_MIDDLEWARE_RULES=rules):
        client = Client()
        assert client.post("/checkout/").status_code == 200
        session_key = client.cookies[settings.SESSION_COOKIE_NAME].value
        digest = session_digest(session_key)
        assert len(digest) == 32 and session_key not in digest
        with dlock.lock(f"s:{digest}"):
            assert in_thread(lambda: client.post("/checkout/")).status_code == 423


def test_methods_filter():
    user = make_user("carol")
    client = logged_in_client(user)
    with dlock.lock(f"checkout:{user.pk}"):
        assert in_thread(lambda: client.get("/checkout/")).status_code == 200
        assert in_thread(lambda: client.post("/checkout/")).status_code == 423


def test_url_kwargs_and_ip():
    client = Client()
    with dlock.lock("shop:acme:127.0.0.1"):
        refused = in_thread(lambda: client.post("/shop/acme/checkout/"))
        assert refused.status_code == 423 and refused["Retry-After"] == "5"
        assert b"/shop/acme/checkout/" in refused.content
        assert in_thread(lambda: client.post("/shop/other/checkout/")).status_code == 200
        other_ip = in_thread(lambda: client.post("/shop/acme/checkout/", REMOTE_ADDR="10.0.0.9"))
        assert other_ip.status_code == 200


def test_unresolvable_path_passes_through():
    assert Client().post("/shop/").status_code == 404


def test_async_mode_per_anonymous_session():
    PROBE.reset()
    PROBE.close_gate()

    async def scenario():
        client = AsyncClient()
        PROBE.gate.set()
        created = await client.post("/checkout/async/")  # creates the session
        PROBE.reset()
        PROBE.close_gate()
        first = asyncio.ensure_future(client.post("/checkout/async/"))
        for _ in range(6000):
            if PROBE.entered:
                break
            await asyncio.sleep(0.01)
        assert PROBE.entered == 1, "the first request never entered the view"
        second = await client.post("/checkout/async/")
        stranger = asyncio.ensure_future(AsyncClient().post("/checkout/async/"))
        for _ in range(6000):
            if PROBE.entered == 2:
                break
            await asyncio.sleep(0.01)
        PROBE.gate.set()
        return created, await first, second, await stranger

    try:
        created, first, second, stranger = async_to_sync(scenario)()
    finally:
        PROBE.gate.set()
    assert created.status_code == 200
    assert settings.SESSION_COOKIE_NAME in created.cookies
    assert first.status_code == 200 and first.content == b"async checked out"
    assert second.status_code == 423 and second["Retry-After"] == "1"
    assert stranger.status_code == 200
    assert PROBE.entered == 2


def test_rules_are_read_at_call_time():
    user = make_user("dave")
    client = logged_in_client(user)
    with dlock.lock(f"checkout:{user.pk}"):
        with override_settings(DLOCK_MIDDLEWARE_RULES=[]):
            assert in_thread(lambda: client.post("/checkout/")).status_code == 200
        assert in_thread(lambda: client.post("/checkout/")).status_code == 423


def test_invalid_rules_raise_improperly_configured():
    bad = override_settings(DLOCK_MIDDLEWARE_RULES=[{"path": "(", "key": "x"}])
    with bad, pytest.raises(ImproperlyConfigured, match="dlock.E022"):
        Client().post("/checkout/")


def test_wait_rule_serialises():
    rules = [
        {"path": r"^/checkout/$", "key": "w:{session}", "on_contention": "wait", "timeout": 60}
    ]
    with override_settings(DLOCK_MIDDLEWARE_RULES=rules):
        first = Client()
        first.post("/checkout/")
        session_key = first.cookies[settings.SESSION_COOKIE_NAME].value
        PROBE.reset()
        results = []

        def post() -> None:
            client = Client()
            client.cookies[settings.SESSION_COOKIE_NAME] = session_key
            results.append(client.post("/checkout/").status_code)
            connections.close_all()

        PROBE.close_gate()
        threads = [threading.Thread(target=post) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: PROBE.entered == 1)
        PROBE.gate.set()
        for thread in threads:
            thread.join(60)
    assert results == [200, 200, 200]
    assert PROBE.max_active == 1


def _checkout_rows() -> list[str]:
    from django_dlock.models import Lock as LockRow

    return list(LockRow.objects.filter(name__contains="checkout:").values_list("name", flat=True))


def test_a_post_refused_by_csrf_leaves_no_lock_row_and_no_session():
    from django.contrib.sessions.models import Session

    client = Client(enforce_csrf_checks=True)
    for _ in range(3):
        assert client.post("/checkout/").status_code == 403
    assert _checkout_rows() == []
    assert Session.objects.count() == 0


def test_a_post_with_its_csrf_token_is_locked_as_before():
    from django.middleware.csrf import get_token
    from django.test import RequestFactory

    client = Client(enforce_csrf_checks=True)
    client.get("/checkout/")  # no rule for GET: the view runs unlocked
    token = get_token(RequestFactory().get("/"))
    client.cookies[settings.CSRF_COOKIE_NAME] = token
    assert client.post("/checkout/", {"csrfmiddlewaretoken": token}).status_code == 200
    from django_dlock.middleware import session_digest

    digest = session_digest(client.cookies[settings.SESSION_COOKIE_NAME].value)
    assert _checkout_rows() == [f"lock:checkout:anon:{digest}"]
    with dlock.lock(f"checkout:anon:{digest}"):
        refused = in_thread(lambda: client.post("/checkout/", {"csrfmiddlewaretoken": token}))
        assert refused.status_code == 423


def test_an_async_post_refused_by_csrf_leaves_no_lock_row():
    async def post() -> int:
        response = await AsyncClient(enforce_csrf_checks=True).post("/checkout/async/")
        return response.status_code

    assert async_to_sync(post)() == 403
    assert _checkout_rows() == []


def test_lock_middleware_before_csrf_is_reported():
    from django.core import checks

    from django_dlock.checks import middleware_messages as check_rules

    csrf = "django.middleware.csrf.CsrfViewMiddleware"
    others = [m for m in settings.MIDDLEWARE if m not in (csrf, LOCK_MIDDLEWARE)]
    with override_settings(MIDDLEWARE=[*others, LOCK_MIDDLEWARE, csrf]):
        found = [m for m in check_rules() if m.id == "dlock.W023"]
    assert len(found) == 1 and found[0].level == checks.WARNING
    assert "dlock.W023" not in [m.id for m in check_rules()]  # csrf before: fine
