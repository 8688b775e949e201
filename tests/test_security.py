"""Security: who may force-release, CSRF, and tokens that never leak."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import Client

import django_dlock as dlock

from .test_admin import CHANGELIST, client_for, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def _force_release(client: Client, pk: int):
    return client.post(
        CHANGELIST, {"action": "force_release", "_selected_action": [pk], "post": "yes"}
    )


def _held():
    from django_dlock.models import Lock as LockRow

    lk = dlock.lock("guarded", ttl=300)
    lk.acquire()
    return lk, LockRow.objects.get(name="lock:guarded")


def test_force_release_needs_a_csrf_token():
    lk, row = _held()
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("root", superuser=True))
    assert _force_release(client, row.pk).status_code == 403
    assert lk.owned()  # still held
    lk.release()


def test_force_release_is_refused_to_non_staff_and_anonymous_users():
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    lk, row = _held()
    user = get_user_model().objects.create_user("not-staff", password="pw")
    user.user_permissions.add(Permission.objects.get(codename="force_release_lock"))
    for client in (client_for(user), Client()):
        response = _force_release(client, row.pk)
        assert response.status_code == 302 and "/login/" in response["Location"]
    assert lk.owned()
    lk.release()


def test_the_token_is_never_shown_in_full():
    lk, row = _held()
    token = lk.token
    root = client_for(make_user("root", superuser=True))
    pages = [
        root.get(CHANGELIST).content.decode(),
        root.get(f"{CHANGELIST}{row.pk}/change/").content.decode(),
        root.post(
            CHANGELIST, {"action": "force_release", "_selected_action": [row.pk]}
        ).content.decode(),
    ]
    out = StringIO()
    call_command("dlock_list", stdout=out)
    call_command("dlock_show", "lock:guarded", stdout=out)
    for text in [*pages, out.getvalue(), str(row), repr(row), repr(lk)]:
        assert token not in text
    lk.release()


def _recover_token(client: Client, alphabet: str, length: int) -> str:
    """The attack: grow a prefix one character at a time with ``token__startswith``."""
    found = ""
    for _ in range(length):
        for char in alphabet:
            page = client.get(CHANGELIST, {"token__startswith": found + char})
            if page.status_code == 200 and "lock:guarded" in page.content.decode():
                found += char
                break
        else:
            break
    return found


def test_a_view_only_user_cannot_recover_the_token_through_admin_lookups():
    lk, row = _held()
    token = lk.token
    viewer = client_for(make_user("viewer", "view_lock"))
    alphabet = "".join(sorted(set(token)))  # the attacker's best case: he knows the alphabet
    assert _recover_token(viewer, alphabet, 3) == ""
    # No spelling of a lookup on the token gets through, and none is a server error.
    for query in (
        {"token": token},
        {"token__startswith": token[:1]},
        {"token__gt": ""},
        {"token__regex": "^."},
        {"token__exact": token},
        {"token__in": token},
        {"token__isnull": "False"},
        {"token__iexact": token},
        {"TOKEN__startswith": token[:1]},
        {"pk__in": str(row.pk), "token__contains": token[:2]},
    ):
        response = viewer.get(CHANGELIST, query)
        shown = "lock:guarded" in response.content.decode()
        assert response.status_code == 400 or not shown, query
    lk.release()
