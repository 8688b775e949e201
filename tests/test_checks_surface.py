"""System checks of the Django surface: dlock.E020-E027 and dlock.W020-W022, one test each."""

from __future__ import annotations

from django.conf import settings
from django.core import checks
from django.test import override_settings

from django_dlock.checks import check_middleware_rules

LOCK = "django_dlock.middleware.LockMiddleware"
SESSION = "django.contrib.sessions.middleware.SessionMiddleware"
AUTH = "django.contrib.auth.middleware.AuthenticationMiddleware"
WITH_LOCK = [*settings.MIDDLEWARE, LOCK]
GOOD = {"path": r"^/checkout/", "methods": ["POST"], "key": "checkout:{user}"}


def ids(rules=None, middleware=None) -> list[str]:
    options = {"MIDDLEWARE": WITH_LOCK if middleware is None else middleware}
    if rules is not None:
        options["DLOCK_MIDDLEWARE_RULES"] = rules
    with override_settings(**options):
        return [str(message.id) for message in check_middleware_rules()]


def test_good_rules_pass():
    assert ids([GOOD]) == []


def test_registered_with_django():
    with override_settings(DLOCK_MIDDLEWARE_RULES="nope"):
        found = [m.id for m in checks.run_checks(tags=[checks.Tags.compatibility])]
    assert "dlock.E020" in found


def test_e020_rules_not_a_list_of_dicts():
    assert ids({"path": "x", "key": "k"}) == ["dlock.E020"]
    assert ids(["^/x/"]) == ["dlock.E020"]


def test_e021_unknown_or_missing_keys():
    assert ids([{"path": "^/x/", "key": "k", "method": ["POST"]}]) == ["dlock.E021"]
    assert ids([{"path": "^/x/"}]) == ["dlock.E021"]


def test_e022_bad_path_regex():
    assert ids([{"path": "^/x/(", "key": "k"}]) == ["dlock.E022"]


def test_e023_bad_methods():
    assert ids([{"path": "^/x/", "key": "k", "methods": "POST"}]) == ["dlock.E023"]
    assert ids([{"path": "^/x/", "key": "k", "methods": ["FETCH"]}]) == ["dlock.E023"]


def test_e024_bad_key_template():
    assert ids([{"path": "^/x/", "key": "{request.user.password}"}]) == ["dlock.E024"]
    assert ids([{"path": "^/x/", "key": "{0}"}]) == ["dlock.E024"]


def test_e025_bad_lock_option():
    assert ids([{"path": "^/x/", "key": "k", "ttl": 0}]) == ["dlock.E025"]
    assert ids([{"path": "^/x/", "key": "k", "using": "nope"}]) == ["dlock.E025"]
    assert ids([{"path": "^/x/", "key": "k", "strategy": "redis"}]) == ["dlock.E025"]


def test_e026_bad_on_contention():
    assert ids([{"path": "^/x/", "key": "k", "on_contention": 200}]) == ["dlock.E026"]
    assert ids([{"path": "^/x/", "key": "k", "on_contention": "wait"}]) == ["dlock.E026"]
    assert ids([{"path": "^/x/", "key": "k", "on_contention": "tests.views.nope"}]) == [
        "dlock.E026"
    ]


def test_e027_user_needs_session_and_auth_before_the_middleware():
    before_auth = [m for m in settings.MIDDLEWARE if m != AUTH] + [LOCK, AUTH]
    assert ids([GOOD], middleware=before_auth) == ["dlock.E027"]
    no_session = [m for m in WITH_LOCK if m not in (SESSION, AUTH)]
    session_rule = {"path": "^/x/", "key": "s:{session}"}
    assert ids([session_rule], middleware=no_session) == ["dlock.E027"]


def test_w020_rules_without_the_middleware():
    assert ids([GOOD], middleware=list(settings.MIDDLEWARE)) == ["dlock.W020"]


def test_w021_wait_without_limit():
    rule = {"path": "^/x/", "key": "k", "on_contention": "wait", "timeout": None}
    assert ids([rule]) == ["dlock.W021"]


def test_w022_middleware_without_rules():
    assert ids([]) == ["dlock.W022"]
