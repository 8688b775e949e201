"""The queue is visible: dlock_show lists a key's waiters, dlock_list counts them,
and the admin's lock page shows them in the order they will be served."""

from __future__ import annotations

import functools
import re
import threading
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connections
from django.test import Client
from django.urls import reverse

import django_dlock as dlock
from django_dlock.models import Lock as LockRow
from django_dlock.strategies import queue

from .helpers import wait_until

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"])


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


class Queued:
    """``count`` threads queued, in order, on a key held by this test."""

    def __init__(self, alias: str, key: str, count: int) -> None:
        self.holder = dlock.lock(key, using=alias, ttl=60)
        assert self.holder.acquire(timeout=0)
        self.threads = []
        for index in range(count):
            thread = threading.Thread(target=self._wait, args=(alias, key))
            thread.start()
            self.threads.append(thread)
            wait_until(functools.partial(self._queued_are, alias, index + 1))

    def _queued_are(self, alias: str, count: int) -> bool:
        return sum(r[4] for r in queue.waiters(alias, [self.holder.name])) == count

    @staticmethod
    def _wait(alias: str, key: str) -> None:
        try:
            with dlock.lock(key, using=alias, timeout=60):
                pass
        finally:
            connections.close_all()

    def finish(self) -> None:
        self.holder.release()
        for thread in self.threads:
            thread.join(60)


def test_dlock_show_and_list_show_the_queue(alias):
    queued = Queued(alias, "visible", 2)
    try:
        shown = run("dlock_show", "visible", "--using", alias)
        assert re.search(r"^waiters +2$", shown, re.MULTILINE)
        lines = [line.split() for line in shown.splitlines() if line.startswith("  ")]
        positions = [cells[0] for cells in lines[1:]]
        assert positions == ["1", "2"]
        listed = run("dlock_list", "--using", alias)
        row = next(line for line in listed.splitlines() if line.startswith("lock:visible"))
        assert row.split()[-1] == "2"
    finally:
        queued.finish()
    assert re.search(r"^waiters +0$", run("dlock_show", "visible", "--using", alias), re.MULTILINE)


def test_admin_lock_page_lists_waiters(pg):
    queued = Queued(pg, "admin-visible", 2)
    try:
        user = get_user_model().objects.create_superuser("root", "root@example.com", "x")
        client = Client()
        client.force_login(user)
        row = LockRow.objects.get(name="lock:admin-visible")
        page = client.get(reverse("admin:django_dlock_lock_change", args=[row.pk]))
        assert page.status_code == 200
        html = page.content.decode()
        assert "waiting since" in html
        assert html.count("<tr><td>") == 2
    finally:
        queued.finish()
