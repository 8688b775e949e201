"""The lock admin through Django's test client (the browser test is test_admin_browser.py)."""

from __future__ import annotations

import ast
import datetime as dt
import re
import threading

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.db import DatabaseError, connections
from django.test import Client
from django.urls import reverse
from django.utils import timezone

import django_dlock as dlock
from django_dlock import cleanup, signals
from django_dlock.keys import hash32, hash64, make_key
from django_dlock.models import Lock as LockRow
from django_dlock.models import Waiter
from django_dlock.operations import advisory_key, advisory_names

from .factories import LockFactory as _LockFactory
from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/django_dlock/lock/"


def make_row(**fields) -> LockRow:
    """A saved lease row from the factory (typed)."""
    row: LockRow = _LockFactory(**fields)  # type: ignore[assignment]
    return row


def make_user(name: str, *perms: str, superuser: bool = False):
    model = get_user_model()
    if superuser:
        return model.objects.create_superuser(name, f"{name}@example.com", "pw")
    user = model.objects.create_user(name, password="pw", is_staff=True)
    for codename in perms:
        user.user_permissions.add(Permission.objects.get(codename=codename))
    return user


def client_for(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def admin_client_(db):
    return client_for(make_user("root", superuser=True))


def action(client: Client, name: str, rows, **extra):
    data = {"action": name, "_selected_action": [r.pk for r in rows], **extra}
    return client.post(CHANGELIST, data, follow=extra.get("post") == "yes")


def test_changelist_shows_states_on_the_database_clock_and_no_full_token(admin_client_):
    lk = dlock.lock("invoice:1", ttl=300)
    lk.acquire()
    try:
        make_row(name="lock:crashed", expired=True, token="f" * 33)
        make_row(name="lock:done", expired=True)
        page = admin_client_.get(CHANGELIST).content.decode()
        assert "dlock-state-held" in page
        assert "dlock-state-expired" in page
        assert "dlock-state-released" in page
        assert re.search(r"\d min \d\d s left", page)  # about five minutes on the DB clock
        assert "ended " in page
        assert "judged on the database clock" in page
        assert lk.token not in page and lk.token[:8] not in page  # on the detail page
        assert "f" * 9 not in page
        row = LockRow.objects.get(name="lock:invoice:1")
        detail = admin_client_.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
        assert lk.token not in detail and lk.token[:8] + "…" in detail
        assert "Advisory locks (PostgreSQL)" in page
    finally:
        lk.release()


def test_state_filter_and_search(admin_client_):
    make_row(name="lock:alpha")
    make_row(name="lock:beta", expired=True)
    held = admin_client_.get(CHANGELIST, {"state": "held"}).content.decode()
    assert "lock:alpha" in held and "lock:beta" not in held
    released = admin_client_.get(CHANGELIST, {"state": "released"}).content.decode()
    assert "lock:beta" in released and "lock:alpha" not in released
    found = admin_client_.get(CHANGELIST, {"q": "alph"}).content.decode()
    assert "lock:alpha" in found and "lock:beta" not in found


def test_no_add_change_or_delete(admin_client_):
    row = make_row()
    assert admin_client_.get(CHANGELIST + "add/").status_code == 403
    detail = admin_client_.get(f"{CHANGELIST}{row.pk}/change/")
    assert detail.status_code == 200  # read-only view
    assert row.token not in detail.content.decode()
    assert 'name="_save"' not in detail.content.decode()
    assert admin_client_.get(f"{CHANGELIST}{row.pk}/delete/").status_code == 403
    assert "delete_selected" not in admin_client_.get(CHANGELIST).content.decode()


def test_force_release_confirms_logs_signals_and_the_holder_sees_lock_lost(admin_client_):
    lk = dlock.lock("report", ttl=300)
    lk.acquire()
    other = make_row(name="lock:other")
    row = LockRow.objects.get(name="lock:report")
    seen = []

    def receiver(sender, **kwargs):
        seen.append(kwargs)

    signals.lock_force_released.connect(receiver)
    try:
        confirm = action(admin_client_, "force_release", [row])
        assert confirm.status_code == 200
        page = confirm.content.decode()
        assert "Force-release locks: are you sure?" in page
        assert "lock:report" in page and "lock:other" not in page
        assert lk.token not in page
        assert lk.owned()  # nothing happened yet

        done = action(admin_client_, "force_release", [row], post="yes")
        assert done.status_code == 200
        assert "Force-released 1 lock: lock:report" in done.content.decode()
        assert not lk.locked()
        with pytest.raises(dlock.LockLost):
            lk.release()
    finally:
        signals.lock_force_released.disconnect(receiver)
    row.refresh_from_db()
    assert row.token == ""
    other.refresh_from_db()
    assert other.token  # not selected, untouched
    entry = LogEntry.objects.get(object_id=str(row.pk))
    assert entry.action_flag == CHANGE and "Force-released" in entry.get_change_message()
    assert [s["name"] for s in seen] == ["lock:report"]
    assert seen[0]["source"] == "admin" and seen[0]["user"].username == "root"


def test_force_release_of_an_already_released_lock(admin_client_):
    row = make_row(expired=True)
    done = action(admin_client_, "force_release", [row], post="yes")
    assert "already released" in done.content.decode()
    assert not LogEntry.objects.exists()


def test_force_release_needs_the_permission():
    row = make_row(name="lock:guarded")
    viewer = client_for(make_user("viewer", "view_lock"))
    page = viewer.get(CHANGELIST).content.decode()
    assert "lock:guarded" in page
    assert 'value="force_release"' not in page
    assert 'value="delete_expired"' not in page
    action(viewer, "force_release", [row], post="yes")
    row.refresh_from_db()
    assert row.token  # not released

    operator = client_for(make_user("operator", "view_lock", "force_release_lock"))
    page = operator.get(CHANGELIST).content.decode()
    assert 'value="force_release"' in page and 'value="delete_expired"' not in page
    action(operator, "force_release", [row], post="yes")
    row.refresh_from_db()
    assert row.token == ""


def db_now():
    """The database's clock (the admin's judge of every lease), as an aware datetime."""
    with connections["default"].cursor() as cur:
        cur.execute("SELECT statement_timestamp()")
        return cur.fetchone()[0]


def names_left() -> set[str]:
    return set(LockRow.objects.values_list("name", flat=True))


@pytest.fixture
def ended_and_held():
    """A held lease, one that ran out, one released, and one that ran out but is not selected."""
    return {
        "held": make_row(name="lock:held"),
        "expired": make_row(name="lock:ran-out", expired=True, token="e" * 32),
        "released": make_row(name="lock:released", expired=True),
        "other": make_row(name="lock:not-selected", expired=True, token="a" * 32),
    }


def test_delete_expired_asks_for_confirmation_first(admin_client_, ended_and_held):
    rows = ended_and_held
    selected = [rows["held"], rows["expired"], rows["released"]]
    confirm = action(admin_client_, "delete_expired", selected)
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Delete expired or released locks: are you sure?" in page
    doomed = page[page.index('id="dlock-delete-list"') : page.index('id="dlock-keep-list"')]
    kept = page[page.index('id="dlock-keep-list"') :]
    assert "lock:ran-out" in doomed and "lock:released" in doomed
    assert "lock:held" not in doomed and "lock:held" in kept
    assert "lock:not-selected" not in page
    assert 'value="Yes, delete 2 rows"' in page
    assert names_left() == {row.name for row in rows.values()}  # nothing deleted yet


def test_delete_expired_deletes_the_selected_ended_rows_only(admin_client_, ended_and_held):
    rows = ended_and_held
    selected = [rows["held"], rows["expired"], rows["released"]]
    done = action(admin_client_, "delete_expired", selected, post="yes")
    page = done.content.decode()
    assert "Deleted 2 expired or released locks: lock:ran-out, lock:released." in page
    assert "1 selected lock was kept" in page
    # the selection is respected, the held row kept
    assert names_left() == {"lock:held", "lock:not-selected"}
    assert LockRow.objects.get(name="lock:held").token == rows["held"].token


def test_delete_expired_keeps_a_free_row_that_waiters_are_queued_for(admin_client_):
    row = make_row(name="lock:queued", expired=True)
    now = db_now()
    Waiter.objects.create(
        name="lock:queued",
        token="w" * 32,
        owner="waiter",
        enqueued_at=now,
        expire_at=now + dt.timedelta(hours=1),
    )
    page = action(admin_client_, "delete_expired", [row]).content.decode()
    assert "waiters queued for it" in page and "dlock-confirm" not in page
    action(admin_client_, "delete_expired", [row], post="yes")
    assert names_left() == {"lock:queued"}


def test_delete_expired_judges_the_lease_on_the_database_clock(admin_client_, monkeypatch):
    now = db_now()
    ahead = make_row(name="lock:ends-in-an-hour", expire_at=now + dt.timedelta(hours=1))
    behind = make_row(name="lock:ended-an-hour-ago", expire_at=now - dt.timedelta(hours=1))
    real_now = timezone.now

    # This web server's clock two hours fast: the lease it thinks has ended is held.
    monkeypatch.setattr(timezone, "now", lambda: real_now() + dt.timedelta(hours=2))
    page = action(admin_client_, "delete_expired", [ahead]).content.decode()
    assert "dlock-confirm" not in page
    action(admin_client_, "delete_expired", [ahead], post="yes")
    assert "lock:ends-in-an-hour" in names_left()

    # Two hours slow: the lease it thinks is held has ended.
    monkeypatch.setattr(timezone, "now", lambda: real_now() - dt.timedelta(hours=2))
    page = action(admin_client_, "delete_expired", [behind]).content.decode()
    assert 'value="Yes, delete 1 row"' in page
    action(admin_client_, "delete_expired", [behind], post="yes")
    assert names_left() == {"lock:ends-in-an-hour"}


@pytest.fixture
def advisory_holder():
    """Another PostgreSQL session holding advisory locks (int8 and int4 pair)."""
    other = connections["default"].copy()
    with other.cursor() as cur:
        cur.execute("SET application_name = 'dlock-test-holder'")
        cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:nightly")])
        cur.execute("SELECT pg_advisory_lock(%s, %s)", [7, -42])
        cur.execute("SELECT pg_backend_pid()")
        pid = cur.fetchone()[0]
    yield other, pid
    other.close()


def test_advisory_page_lists_held_locks(admin_client_, advisory_holder):
    _, pid = advisory_holder
    url = reverse("admin:django_dlock_lock_advisory")
    page = admin_client_.get(url, {"name": "nightly"}).content.decode()
    assert str(hash64("lock:nightly")) in page
    assert "(7, -42)" in page
    assert "dlock-test-holder" in page and str(pid) in page
    assert "dlock-state-held" in page
    # the searched name is highlighted
    [selected] = [row for row in advisory_rows(page) if "selected" in row.split(">", 1)[0]]
    assert str(hash64("lock:nightly")) in selected
    assert "Terminate holder" in page


def test_advisory_key_reconstruction():
    assert advisory_key(0xFFFFFFFF, 0xFFFFFFFE, 1) == ("int8", (-2,))
    assert advisory_key(0, 5, 1) == ("int8", (5,))
    assert advisory_key(7, 0xFFFFFFD6, 2) == ("int4 pair", (7, -42))


def advisory_rows(page: str) -> list[str]:
    """The rows of the advisory locks table, as HTML."""
    table = page[page.index('id="dlock-advisory-list"') :]
    body = table[table.index("<tbody>") : table.index("</tbody>")]
    return re.findall(r"<tr[ >].*?</tr>", body, re.S)


def wait_for_nightly() -> None:
    """Wait (at most 20 s) for the advisory lock of lock:nightly, on a session of its own."""
    waiter = connections["default"].copy()  # created in the thread that uses it
    try:
        with waiter.cursor() as cur:
            cur.execute("SET lock_timeout = '20s'")
            cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:nightly")])
    except DatabaseError:
        pass
    finally:
        waiter.close()


def test_advisory_waiters_show_as_waiting(admin_client_, advisory_holder):
    thread = threading.Thread(target=wait_for_nightly)
    thread.start()
    try:
        url = reverse("admin:django_dlock_lock_advisory")
        for _ in range(500):
            page = admin_client_.get(url).content.decode()
            if "dlock-state-waiting" in page:
                break
        assert "dlock-state-waiting" in page
        assert "1 waiting" in page
        # Terminate is offered on the rows that hold a lock, never on a waiting one
        rows = advisory_rows(page)
        waiting = [row for row in rows if "dlock-state-waiting" in row]
        held = [row for row in rows if "dlock-state-held" in row]
        assert len(waiting) == 1 and len(held) == 2
        assert "Terminate holder" not in waiting[0]
        assert all("Terminate holder" in row for row in held)
    finally:
        holder, _ = advisory_holder
        holder.close()  # frees the lock: the waiter gets it and leaves
        thread.join(60)


def test_terminate_holder_is_superuser_only_and_confirmed(admin_client_, advisory_holder):
    holder, pid = advisory_holder
    url = reverse("admin:django_dlock_lock_terminate", args=[pid])
    staff = client_for(make_user("staff", "view_lock", "force_release_lock"))
    assert staff.get(url).status_code == 403
    assert staff.post(url, {"post": "yes"}).status_code == 403
    listing = staff.get(reverse("admin:django_dlock_lock_advisory")).content.decode()
    assert "Terminate holder" not in listing

    confirm = admin_client_.get(url)
    assert confirm.status_code == 200 and "Yes, terminate backend" in confirm.content.decode()
    with holder.cursor() as cur:  # still alive after the GET
        cur.execute("SELECT 1")

    done = admin_client_.post(url, {"post": "yes"}, follow=True)
    assert f"Terminated PostgreSQL backend {pid}" in done.content.decode()
    with pytest.raises(DatabaseError), holder.cursor() as cur:
        cur.execute("SELECT 1")
    page = admin_client_.get(reverse("admin:django_dlock_lock_advisory")).content.decode()
    assert "No advisory lock is held or awaited." in page


def test_terminate_confirmation_names_the_keys_it_can(admin_client_, advisory_holder):
    """The page listed the keys of the session as bare numbers."""
    with dlock.lock("nightly"):  # a lease row named lock:nightly: its key's name is known
        pass
    _, pid = advisory_holder
    page = admin_client_.get(reverse("admin:django_dlock_lock_terminate", args=[pid]))
    text = page.content.decode()
    assert "<th>Name</th>" in text
    assert "<code>lock:nightly</code>" in text
    assert "(7, -42)" in text  # a two-part key of no known name: its cell says so on hover


def test_terminate_needs_post_with_csrf(advisory_holder):
    _, pid = advisory_holder
    client = Client(enforce_csrf_checks=True)
    client.force_login(make_user("root2", superuser=True))
    url = reverse("admin:django_dlock_lock_terminate", args=[pid])
    assert client.post(url, {"post": "yes"}).status_code == 403  # no CSRF token
    assert client.put(url).status_code in (403, 405)


def breadcrumbs(page: str) -> list[str]:
    """The texts of the breadcrumb trail, in order."""
    found = re.search(r'<div class="breadcrumbs">(.*?)</div>', page, re.S)
    assert found, "no breadcrumbs"
    text = re.sub(r"<[^>]+>", "", found.group(1)).replace("&rsaquo;", "›")
    return [part.strip() for part in text.split("›")]


def test_terminate_confirmation_breadcrumbs_name_the_app(admin_client_, advisory_holder):
    _, pid = advisory_holder
    page = admin_client_.get(reverse("admin:django_dlock_lock_terminate", args=[pid]))
    html = page.content.decode()
    assert breadcrumbs(html) == [
        "Home",
        "Distributed locks",
        "Locks",
        "Advisory locks",
        f"Terminate {pid}",
    ]
    app_list = reverse("admin:app_list", kwargs={"app_label": "django_dlock"})
    assert f'<a href="{app_list}">Distributed locks</a>' in html


def test_detail_page_shows_times_to_the_second_with_the_time_zone(admin_client_, settings):
    utc = dt.timezone.utc
    row = make_row(
        name="lock:timed",
        acquired_at=dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=utc),
        expire_at=dt.datetime(2030, 1, 2, 3, 9, 7, tzinfo=utc),
    )
    page = admin_client_.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert "2030-01-02 03:04:05 UTC" in page
    assert "2030-01-02 03:09:07 UTC" in page
    assert re.search(r"<label>\s*Expires at:\s*</label>", page), page
    assert "Expire at" not in page
    assert re.search(r"<label>\s*Acquired at:\s*</label>", page)

    settings.TIME_ZONE = "Europe/Paris"  # the admin's time zone, named on the page
    page = admin_client_.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert "2030-01-02 04:04:05 CET" in page
    assert "2030-01-02 04:09:07 CET" in page


@pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])
def test_delete_free_rows_deletes_the_chosen_ended_rows_and_keeps_the_fences(alias):
    def row(name: str, **fields) -> LockRow:
        made: LockRow = _LockFactory.build(name=name, **fields)  # type: ignore[assignment]
        made.save(using=alias)
        return made

    held = row("lock:held")
    ran_out = row("lock:ran-out", expired=True, token="e" * 32, fence=10**12)
    released = row("lock:released", expired=True)
    row("lock:not-chosen", expired=True)
    assert cleanup.delete_free_rows(alias, [held.pk, ran_out.pk, released.pk]) == 2
    left = set(LockRow.objects.using(alias).values_list("name", flat=True))
    assert left == {"lock:held", "lock:not-chosen"}
    assert cleanup.delete_free_rows(alias, []) == 0
    lk = dlock.lock("ran-out", using=alias, ttl=60)
    assert lk.acquire(timeout=5)
    try:
        assert (lk.fence or 0) > 10**12  # the fencing history survives the deletion
    finally:
        lk.release()


def form_of(page: str, form_id: str) -> tuple[str, dict[str, list[str]]]:
    """The target and the fields (but the CSRF token) of the form ``form_id`` of a page."""
    found = re.search(rf'<form [^>]*id="{form_id}"[^>]*>(.*?)</form>', page, re.S)
    assert found, f"no form {form_id}"
    target = re.search(r'action="([^"]*)"', found.group(0)[: found.group(0).index(">")])
    fields: dict[str, list[str]] = {}
    for tag in re.findall(r"<input [^>]*>", found.group(1)):
        name = re.search(r'name="([^"]*)"', tag)
        value = re.search(r'value="([^"]*)"', tag)
        if name and name.group(1) != "csrfmiddlewaretoken":
            fields.setdefault(name.group(1), []).append(value.group(1) if value else "")
    return (target.group(1) if target else ""), fields


def test_force_release_from_the_lock_page(admin_client_):
    lk = dlock.lock("detail", ttl=300)
    lk.acquire()
    make_row(name="lock:bystander")
    row = LockRow.objects.get(name="lock:detail")
    url = reverse("admin:django_dlock_lock_force_release", args=[row.pk])
    detail = admin_client_.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert f'<a href="{url}" id="dlock-force-release"' in detail and "Force release…" in detail

    confirm = admin_client_.get(url)
    assert confirm.status_code == 200
    page = confirm.content.decode()
    assert "Force-release locks: are you sure?" in page  # the list action's page
    assert "lock:detail" in page and "lock:bystander" not in page
    assert lk.token not in page
    assert lk.owned()  # nothing happened yet
    target, fields = form_of(page, "dlock-force-release-form")
    # the form runs the list's action on this one lock
    assert target == CHANGELIST
    assert fields == {
        "_selected_action": [str(row.pk)],
        "action": ["force_release"],
        "post": ["yes"],
    }

    done = admin_client_.post(target, fields, follow=True).content.decode()
    assert "Force-released 1 lock: lock:detail" in done
    assert not lk.locked()
    with pytest.raises(dlock.LockLost):
        lk.release()
    entry = LogEntry.objects.get(object_id=str(row.pk))
    assert "Force-released" in entry.get_change_message()
    assert LockRow.objects.get(name="lock:bystander").token  # untouched
    # released: nothing left to force
    detail = admin_client_.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert url not in detail


def test_force_release_from_the_lock_page_needs_the_permission():
    row = make_row(name="lock:guarded")
    url = reverse("admin:django_dlock_lock_force_release", args=[row.pk])
    viewer = client_for(make_user("viewer", "view_lock"))
    detail = viewer.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert "lock:guarded" in detail and url not in detail
    assert viewer.get(url).status_code == 403
    operator = client_for(make_user("operator", "view_lock", "force_release_lock"))
    assert url in operator.get(f"{CHANGELIST}{row.pk}/change/").content.decode()
    assert operator.get(url).status_code == 200
    assert operator.post(url).status_code == 405  # the confirmation posts to the list
    row.refresh_from_db()
    assert row.token  # still held


def test_advisory_names_from_known_names_and_the_tables():
    pair_names = ["lock('order', 42)", 'task("it\'s", -7)', "leader(7, 8)", "lock('a, b', 'c')"]
    odd = ["lock:unrelated", "lock(9999999999, 1)", "lock('\\x00', 1)", "task(", "plain"]
    for name in ["leader:scheduler", "task:nightly-report", *pair_names, *odd]:
        make_row(name=name)
    now = db_now()
    Waiter.objects.create(
        name="lock:queued", token="w" * 32, enqueued_at=now, expire_at=now + dt.timedelta(hours=1)
    )
    keys = {name: make_key_of(name) for name in pair_names}
    wanted = {
        (hash64("leader:scheduler"),): "leader:scheduler",
        (hash64("task:nightly-report"),): "task:nightly-report",
        (hash64("lock:queued"),): "lock:queued",  # a waiter's key
        (hash64("leader:runworker"),): "leader:runworker",  # known without a row
        (hash64("lock:typed"),): "lock:typed",  # a name given by the caller
        **{key: name for name, key in keys.items()},
    }
    unknown = [(hash64("lock:nobody-knows"),), (1, 2)]
    found = advisory_names("default", [*wanted, *unknown], names=["typed"])
    assert found == wanted
    assert keys["lock('order', 42)"] == (hash32("order"), 42)
    assert keys['task("it\'s", -7)'] == (hash32("it's"), -7)
    assert keys["leader(7, 8)"] == (7, 8)


def make_key_of(name: str) -> tuple[int, ...]:
    """The advisory key of a stored two-part name, built by the library's own key code."""
    namespace, _, parts = name.partition("(")
    return make_key(ast.literal_eval("(" + parts), namespace).advisory


def test_advisory_page_names_the_keys_it_can(admin_client_, advisory_holder):
    holder, _ = advisory_holder  # holds lock:nightly and (7, -42)
    make_row(name="lock:nightly", expired=True)  # a name in the lock table
    with holder.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s)", [hash64("leader:runworker")])
        cur.execute("SELECT pg_advisory_lock(%s)", [hash64("lock:nobody-recorded-this")])
    url = reverse("admin:django_dlock_lock_advisory")
    rows = advisory_rows(admin_client_.get(url).content.decode())
    by_key = {
        re.search(r'<code class="dlock-key">([^<]*)</code>', row).group(1): row for row in rows
    }
    assert set(by_key) == {
        str(hash64("leader:runworker")),
        str(hash64("lock:nightly")),
        str(hash64("lock:nobody-recorded-this")),
        "(7, -42)",
    }
    assert (
        '<div class="dlock-name">leader:runworker</div>' in by_key[str(hash64("leader:runworker"))]
    )
    assert '<div class="dlock-name">lock:nightly</div>' in by_key[str(hash64("lock:nightly"))]
    assert "name unknown" in by_key[str(hash64("lock:nobody-recorded-this"))]
    assert "name unknown" in by_key["(7, -42)"]

    # a name typed in "Find a lock name" names and highlights its rows, two-part keys too
    rows = advisory_rows(admin_client_.get(url, {"name": "lock(7, -42)"}).content.decode())
    [selected] = [row for row in rows if "selected" in row.split(">", 1)[0]]
    assert "(7, -42)" in selected and '<div class="dlock-name">lock(7, -42)</div>' in selected
    page = admin_client_.get(url, {"name": "nobody-recorded-this"}).content.decode()
    [selected] = [row for row in advisory_rows(page) if "selected" in row.split(">", 1)[0]]
    assert '<div class="dlock-name">lock:nobody-recorded-this</div>' in selected


def test_advisory_page_names_a_running_advisory_election(admin_client_):
    from django_dlock.strategies.advisory import sessions

    made = dlock.LeaderElection(
        "nightly-jobs", strategy="advisory", lease=10.0, renew_deadline=5.0, retry=0.4
    )
    try:
        with made:
            wait_until(lambda: made.is_leader)
            page = admin_client_.get(reverse("admin:django_dlock_lock_advisory")).content.decode()
    finally:
        sessions.close_all()
    [row] = [row for row in advisory_rows(page) if str(hash64("leader:nightly-jobs")) in row]
    assert '<div class="dlock-name">leader:nightly-jobs</div>' in row
    assert "dlock-state-held" in row


def test_who_waits_on_whom_shows_the_holder_and_the_queue_in_order(admin_client_):
    """A held key with three waiters: the holder, then the queue as it is served;
    then an advisory lock's waiter and the backend that blocks it."""
    threads = []

    def wait(i: int) -> None:
        try:
            threading.current_thread().name = f"waiter-{i}"
            with dlock.lock("tree", timeout=30):
                pass
        finally:
            connections.close_all()

    lk = dlock.lock("tree", ttl=60)
    assert lk.acquire(timeout=0)
    other = connections["default"].copy()
    with other.cursor() as cur:
        cur.execute("SELECT pg_advisory_lock(%s), pg_backend_pid()", [hash64("lock:nightly")])
        holder_pid = cur.fetchone()[1]

    try:
        for i in range(3):
            thread = threading.Thread(target=wait, args=(i,))
            thread.start()
            threads.append(thread)
            wait_until(lambda n=i + 1: Waiter.objects.filter(name="lock:tree").count() == n)
        advisory_waiter = threading.Thread(target=wait_for_nightly)
        advisory_waiter.start()
        threads.append(advisory_waiter)
        url = reverse("admin:django_dlock_lock_waiting")
        page = ""

        def advisory_shown() -> bool:
            nonlocal page
            page = admin_client_.get(url).content.decode()
            advisory = page.split("Advisory locks awaited")[-1]
            return str(hash64("lock:nightly")) in advisory and "dlock-waiter" in advisory

        wait_until(advisory_shown)
        tree = page[page.index("<h3>lock:tree") :]
        tree = tree[: tree.index("</table>")]
        assert "thread=MainThread" in tree.split('class="dlock-waiter"')[0]  # the holder first
        order = re.findall(r"thread=waiter-(\d)", tree)
        assert order == ["0", "1", "2"], tree
        advisory = page[page.index("Advisory locks awaited") :]
        assert "<td>waiting</td>" in advisory
        assert re.search(rf"<td class=\"dlock-nowrap\">{holder_pid}</td>\s*</tr>", advisory)
        # the changelist links to it
        assert url in admin_client_.get(CHANGELIST).content.decode()
    finally:
        lk.release()
        other.close()
        for thread in threads:
            thread.join(60)
