"""The lock admin in a real browser: headless Chromium driven by Playwright.

Needs Debian's ``chromium`` (``apt-get install -y chromium chromium-driver``)
and the ``playwright`` Python package (no ``playwright install``: the test
launches the system's Chromium). A missing browser FAILS the test, it is
never skipped.

``DLOCK_WRITE_SCREENSHOT=1`` writes the lock list to
``docs/img/admin-locks.png`` (otherwise to a temporary directory).
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone

import django_dlock as dlock
from django_dlock.models import Lock as LockRow

from .factories import LockFactory
from .helpers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CHROMIUM = os.environ.get("DLOCK_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_IMG = Path(__file__).resolve().parent.parent / "docs" / "img"
CHANGELIST = "/admin/django_dlock/lock/"


def require_browser() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: install Debian's browser "
            "(apt-get install -y chromium chromium-driver) or set DLOCK_CHROMIUM",
            pytrace=False,
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.fail(
            "the playwright Python package is missing: pip install playwright "
            "(no 'playwright install' needed: the test uses the system's Chromium)",
            pytrace=False,
        )


def in_browser(steps: Any, width: int = 1600, height: int = 640, sidebar: bool = False) -> Any:
    """Run ``steps(page)`` in headless Chromium, in a thread of its own.

    Playwright's sync API runs an event loop in its thread; keeping it off
    the test's thread keeps the lock holder and the ORM there untouched.
    """
    from playwright.sync_api import sync_playwright

    def run() -> Any:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": width, "height": height})
                # the navigation sidebar open (Django's default) or collapsed
                page.add_init_script(
                    "localStorage.setItem('django.admin.navSidebarIsOpen', "
                    f"'{'true' if sidebar else 'false'}')"
                )
                page.set_default_timeout(30_000)
                return steps(page)
            finally:
                browser.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(run).result(timeout=300)


#: where the lock list ends, against the window and its scrolling container
FIT_JS = """() => {
  const table = document.querySelector('#result_list');
  const box = table.closest('.results') || table.parentElement;
  const heads = [...table.querySelectorAll('thead th')]
    .filter(th => !th.classList.contains('action-checkbox-column'));
  const cells = [...table.querySelectorAll('th, td')];
  return {
    scroll: box.scrollWidth, client: box.clientWidth,
    right: Math.max(...cells.map(c => c.getBoundingClientRect().right)),
    page: document.documentElement.scrollWidth,
    headers: heads.map(th => th.innerText.trim().toLowerCase()),
  };
}"""


def log_in(page: Any, base: str, username: str, password: str) -> None:
    page.goto(f"{base}/admin/login/?next={CHANGELIST}")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_url(f"**{CHANGELIST}")


def other_locks() -> None:
    """Rows in every state, so the list (and the screenshot) shows them all."""
    now = timezone.now()
    LockFactory(
        name="lock:checkout:user-17",
        owner="web-2 pid=3188 thread=Thread-14 (process_request_thread)",
        fence=5121,
        expire_at=now + dt.timedelta(seconds=45),
    )
    LockFactory(
        name="leader:scheduler",
        owner="worker-1 pid=977 thread=django-dlock-leader",
        fence=88,
        expire_at=now + dt.timedelta(seconds=14),
    )
    LockFactory(
        name="task:nightly-report",
        owner="cron-1 pid=2211 thread=MainThread",
        fence=4096,
        expired=True,
        token="5d41402abc4b2a76b9719d911017c592",  # ran out, never released
        acquired_at=now - dt.timedelta(hours=3),
    )
    LockFactory(
        name="lock:celery:billing.tasks.charge_customer_invoice:8f14e45fceea167a5a36dedd4bea2543",
        owner="worker-3 pid=4410 thread=MainThread",
        fence=733,
        expire_at=now + dt.timedelta(seconds=52),
    )
    LockFactory(
        name="lock:sync-catalog",
        owner="worker-2 pid=1502 task=Task-31",
        fence=3907,
        expired=True,
        acquired_at=now - dt.timedelta(hours=2),
    )


def test_force_release_in_a_real_browser(live_server, tmp_path):
    require_browser()
    get_user_model().objects.create_superuser("root", "root@example.com", "browser-pw")
    other_locks()
    lk = dlock.lock("invoice:1042", ttl=600)
    lk.acquire()
    assert lk.owned()
    token = lk.token
    write_docs = os.environ.get("DLOCK_WRITE_SCREENSHOT") == "1"
    shot = DOCS_IMG / "admin-locks.png" if write_docs else tmp_path / "admin-locks.png"
    shot.parent.mkdir(parents=True, exist_ok=True)

    def steps(page: Any) -> dict[str, Any]:
        log_in(page, live_server.url, "root", "browser-pw")
        row = page.locator("#result_list tbody tr", has_text="lock:invoice:1042")
        seen: dict[str, Any] = {
            "state_before": row.locator(".dlock-state").inner_text(),
            "page_before": page.content(),
            "fit": page.evaluate(FIT_JS),
        }
        page.screenshot(path=str(shot))
        row.locator("input.action-select").check()
        page.select_option("select[name=action]", "force_release")
        page.click("button[name=index]")
        page.wait_for_selector("#dlock-confirm")
        seen["confirm_title"] = page.locator("#content h1").inner_text()
        seen["confirm_rows"] = page.locator("#dlock-force-release-list tbody tr").count()
        page.click("#dlock-confirm")
        page.wait_for_selector("ul.messagelist")
        seen["message"] = page.locator("ul.messagelist").inner_text()
        row = page.locator("#result_list tbody tr", has_text="lock:invoice:1042")
        seen["state_after"] = row.locator(".dlock-state").inner_text()
        return seen

    seen = in_browser(steps, width=1280, height=900, sidebar=True)
    fit = seen["fit"]
    # The whole list fits a 1,280 px window with Django's navigation sidebar
    # open: no horizontal scrolling, every column inside the window.
    assert fit["scroll"] <= fit["client"], fit
    assert fit["right"] <= 1280 and fit["page"] <= 1280, fit
    assert fit["headers"] == ["name", "state", "owner", "fence", "acquired", "time left"]
    assert "held" in seen["state_before"]
    assert token not in seen["page_before"]  # never the full token
    assert seen["confirm_title"] == "Force-release locks: are you sure?"
    assert seen["confirm_rows"] == 1
    assert "Force-released 1 lock: lock:invoice:1042" in seen["message"]
    assert "released" in seen["state_after"]
    assert LockRow.objects.get(name="lock:invoice:1042").token == ""
    assert not lk.locked()
    with pytest.raises(dlock.LockLost):
        lk.release()  # the old holder learns it lost the lock
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_staff_without_the_permission_does_not_see_the_action(live_server):
    require_browser()
    user = get_user_model().objects.create_user("viewer", password="browser-pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_lock"))
    other_locks()

    def steps(page: Any) -> dict[str, Any]:
        log_in(page, live_server.url, "viewer", "browser-pw")
        options = page.locator("select[name=action] option").all_inner_texts()
        return {"options": options, "text": page.locator("#content").inner_text()}

    seen = in_browser(steps)
    assert "lock:checkout:user-17" in seen["text"]  # the list is visible
    assert not any("Force-release" in option for option in seen["options"])
    assert "Force-release" not in seen["text"]


#: a long name, as Celery task keys are (the widest cell of the advisory page)
LONG_NAME = (
    "lock:celery:billing.tasks.charge_customer_invoice:"
    "8f14e45fceea167a5a36dedd4bea2543c9f0f895fb98ab9159f51fd0297e236d:"
    "customer-000172934-invoice-000000082211-attempt-3"
)

#: what the advisory page looks like: its width and the colours of its rows
ADVISORY_JS = """() => {
  const rows = [...document.querySelectorAll('#dlock-advisory-list tbody tr')];
  const bg = el => getComputedStyle(el).backgroundColor;
  const buttons = [...document.querySelectorAll('#dlock-advisory-list a.dlock-terminate')];
  return {
    page: document.documentElement.scrollWidth,
    body: document.body.scrollWidth,
    table_right: document.querySelector('#dlock-advisory-list').getBoundingClientRect().right,
    content_right: document.querySelector('#content').getBoundingClientRect().right,
    buttons_right: Math.max(0, ...buttons.map(b => b.getBoundingClientRect().right)),
    buttons: buttons.length,
    waiting_rows: rows.filter(r => r.querySelector('.dlock-state-waiting')).length,
    waiting_buttons: rows.filter(r => r.querySelector('.dlock-state-waiting'))
      .filter(r => r.querySelector('a.dlock-terminate')).length,
    selected: rows.filter(r => r.classList.contains('selected')).map(r => ({
      text: r.innerText, row: bg(r), cell: bg(r.querySelector('td')) })),
    others: rows.filter(r => !r.classList.contains('selected')).map(r => ({
      text: r.innerText, row: bg(r), cell: bg(r.querySelector('td')) })),
  };
}"""


@pytest.fixture
def advisory_sessions():
    """PostgreSQL sessions: one holds advisory locks (one on a long name), one waits."""
    from django.db import DatabaseError, connections

    from django_dlock.keys import hash64

    LockFactory(name=LONG_NAME, owner="worker-3 pid=4410 thread=MainThread")
    other = connections["default"].copy()
    with other.cursor() as cur:
        cur.execute(
            "SET application_name = 'celery worker billing@worker-3.example.internal pid=4410'"
        )
        cur.execute("SELECT pg_advisory_lock(%s)", [hash64(LONG_NAME)])
        cur.execute("SELECT pg_advisory_lock(%s)", [hash64("leader:runworker")])
        cur.execute("SELECT pg_advisory_lock(%s, %s)", [7, -42])

    def wait() -> None:  # a standby worker, waiting for the election's lock
        waiter = connections["default"].copy()  # made in the thread that uses it
        try:
            with waiter.cursor() as cur:
                cur.execute("SET application_name = 'runworker standby'")
                cur.execute("SET lock_timeout = '60s'")
                cur.execute("SELECT pg_advisory_lock(%s)", [hash64("leader:runworker")])
        except DatabaseError:
            pass
        finally:
            waiter.close()

    def waiting() -> bool:
        with connections["default"].cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
            return bool(cur.fetchone()[0])

    thread = threading.Thread(target=wait)
    thread.start()
    try:
        wait_until(waiting)
        yield other
    finally:
        other.close()  # frees the locks: the waiter takes its lock and leaves
        thread.join(60)


def test_advisory_page_fits_1280_px_and_highlights_the_found_lock(
    live_server, tmp_path, advisory_sessions
):
    require_browser()
    get_user_model().objects.create_superuser("root", "root@example.com", "browser-pw")
    write_docs = os.environ.get("DLOCK_WRITE_SCREENSHOT") == "1"
    shot = DOCS_IMG / "admin-advisory.png" if write_docs else tmp_path / "admin-advisory.png"
    shot.parent.mkdir(parents=True, exist_ok=True)

    def steps(page: Any) -> dict[str, Any]:
        log_in(page, live_server.url, "root", "browser-pw")
        page.goto(f"{live_server.url}{CHANGELIST}advisory/")
        page.fill("#dlock-find-name", "leader:runworker")
        page.click("#dlock-find input[type=submit]")
        page.wait_for_selector("#dlock-advisory-list tr.selected")
        seen: dict[str, Any] = page.evaluate(ADVISORY_JS)
        page.screenshot(path=str(shot), full_page=True)
        return seen

    seen = in_browser(steps, width=1280, height=900, sidebar=True)
    # The whole page fits the window with Django's navigation sidebar open:
    # no horizontal scrolling, every Terminate button inside the window.
    assert seen["page"] <= 1280 and seen["body"] <= 1280, seen
    assert seen["table_right"] <= seen["content_right"], seen  # the table within the page
    assert seen["buttons"] == 3 and 0 < seen["buttons_right"] <= 1280, seen
    # a waiting session is offered no Terminate: only the rows that hold a lock
    assert seen["waiting_buttons"] == 0 and seen["waiting_rows"] == 1, seen
    assert any(LONG_NAME[:40] in row["text"] for row in seen["others"])  # the name is shown
    # The found lock's row stands out from the others.
    # The found lock's rows (the holder's and the waiter's) stand out from the others.
    assert len(seen["selected"]) == 2 and len(seen["others"]) == 2, seen
    transparent = ("rgba(0, 0, 0, 0)", "transparent")
    for selected in seen["selected"]:
        assert "leader:runworker" in selected["text"]
        assert selected["row"] not in transparent and selected["cell"] not in transparent
        for other in seen["others"]:
            assert other["row"] != selected["row"] and other["cell"] != selected["cell"], seen
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_force_release_from_the_lock_page_in_a_real_browser(live_server):
    require_browser()
    get_user_model().objects.create_superuser("root", "root@example.com", "browser-pw")
    lk = dlock.lock("invoice:2048", ttl=600)
    lk.acquire()
    row = LockRow.objects.get(name="lock:invoice:2048")

    def steps(page: Any) -> dict[str, Any]:
        log_in(page, live_server.url, "root", "browser-pw")
        page.goto(f"{live_server.url}{CHANGELIST}{row.pk}/change/")
        seen: dict[str, Any] = {"detail": page.locator("#content").inner_text()}
        page.click("#dlock-force-release")
        page.wait_for_selector("#dlock-confirm")
        seen["confirm_title"] = page.locator("#content h1").inner_text()
        seen["confirm_rows"] = page.locator("#dlock-force-release-list tbody tr").all_inner_texts()
        page.click("#dlock-confirm")
        page.wait_for_selector("ul.messagelist")
        seen["message"] = page.locator("ul.messagelist").inner_text()
        seen["url"] = page.url
        return seen

    seen = in_browser(steps, width=1280, height=900, sidebar=True)
    assert "Expires at" in seen["detail"] and "UTC" in seen["detail"]
    assert seen["confirm_title"] == "Force-release locks: are you sure?"
    assert len(seen["confirm_rows"]) == 1 and "lock:invoice:2048" in seen["confirm_rows"][0]
    assert "Force-released 1 lock: lock:invoice:2048" in seen["message"]
    assert seen["url"].endswith(CHANGELIST)
    assert not lk.locked()
    with pytest.raises(dlock.LockLost):
        lk.release()


def test_holder_metadata_and_who_waits_in_a_real_browser(live_server, tmp_path):
    """A lock taken while serving a request shows the request in the lock list's
    owner, and the "Who waits on whom" page shows its holder and its queue."""
    from django.db import connections

    from django_dlock.identity import doing
    from django_dlock.models import Waiter

    require_browser()
    get_user_model().objects.create_superuser("root", "root@example.com", "browser-pw")

    served: list[bool] = []

    def waiter() -> None:
        try:
            with doing("celery billing.charge"), dlock.lock("invoice:42", timeout=60):
                served.append(True)
        finally:
            connections.close_all()

    shot = (
        DOCS_IMG / "admin-waiting.png"
        if os.environ.get("DLOCK_WRITE_SCREENSHOT")
        else tmp_path / "admin-waiting.png"
    )

    def steps(page: Any) -> dict[str, Any]:
        log_in(page, live_server.url, "root", "browser-pw")
        row = page.locator("#result_list tbody tr", has_text="lock:invoice:42")
        owner = row.locator("td.field-owner").inner_text()
        page.click("text=Who waits on whom")
        page.wait_for_selector(".dlock-tree")
        tree = page.locator(".dlock-tree").first.inner_text()
        page.screenshot(path=str(shot), full_page=True)
        return {"owner": owner, "tree": tree}

    thread = threading.Thread(target=waiter)
    try:
        with doing("POST /invoice/42/pay/"), dlock.lock("invoice:42", ttl=120):
            thread.start()
            wait_until(lambda: Waiter.objects.filter(name="lock:invoice:42").exists())
            seen = in_browser(steps, width=1280, height=480)
    finally:  # the block is left: the waiter takes the lock and goes
        if thread.ident is not None:
            thread.join(90)
    assert "(POST /invoice/42/pay/)" in seen["owner"] and "thread=MainThread" in seen["owner"]
    tree = seen["tree"]
    assert tree.index("holder") < tree.index("(POST /invoice/42/pay/)") < tree.index("1.")
    assert "(celery billing.charge)" in tree.split("1.", 1)[1]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert served == [True]  # the waiter got the lock once the block was left


def test_a_lock_held_long_is_flagged_in_the_list_and_signalled_once(live_server, settings):
    """A lease renewed past ``DLOCK_LONG_HOLD`` shows "held long" in the lock
    list, and ``lock_held_long`` is sent once, however often it is renewed."""
    from django_dlock import signals

    require_browser()
    get_user_model().objects.create_superuser("root", "root@example.com", "browser-pw")
    settings.DLOCK_LONG_HOLD = 1.0
    sent: list[dict[str, Any]] = []

    def receiver(sender: Any, **kwargs: Any) -> None:
        sent.append(kwargs)

    signals.lock_held_long.connect(receiver)
    other_locks()
    lk = dlock.lock("report:2026-q4", ttl=0.9, renew=True)  # renewed every 0.3 s

    def steps(page: Any) -> dict[str, str]:
        log_in(page, live_server.url, "root", "browser-pw")
        rows = page.locator("#result_list tbody tr")
        return {
            "long": rows.filter(has_text="lock:report:2026-q4")
            .locator("td.field-state")
            .inner_text(),
            # acquired 3 h ago, but no longer held: not flagged
            "ended": rows.filter(has_text="task:nightly-report")
            .locator("td.field-state")
            .inner_text(),
        }

    try:
        with lk:
            wait_until(lambda: len(sent) == 1, timeout=30)
            (holding,) = lk._holdings()
            assert holding.renewer is not None
            renewals = holding.renewer.renewals
            wait_until(lambda: holding.renewer.renewals >= renewals + 3, timeout=30)
            seen = in_browser(steps, width=1280, height=640)
    finally:
        signals.lock_held_long.disconnect(receiver)
    assert len(sent) == 1  # once, after more renewals
    assert sent[0]["name"] == "lock:report:2026-q4" and sent[0]["held"] >= 1.0
    assert "held long" in seen["long"] and "held" in seen["long"]
    assert "held long" not in seen["ended"]
