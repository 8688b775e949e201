"""The paused holder of tests/test_fenced.py, in a module a spawned child can
import before Django is set up (the test module defines models)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import django_dlock as dlock
from django_dlock.exceptions import DLockError
from django_dlock.fencing import fenced_update

from .helpers import publish


def stale_holder(alias: str, folder: str) -> None:
    """Take the lock, wait (paused) for ``go``, then write with the fence it had."""
    from .test_fenced import Account  # (a model: imported once Django is set up)

    base = Path(folder)
    lk = dlock.lock("fenced:paused", using=alias, ttl=1.0)
    assert lk.acquire(timeout=10)
    publish(base / "fence", str(lk.fence))
    while not (base / "go").exists():
        time.sleep(0.02)
    try:
        fenced_update(Account.objects.using(alias).filter(pk=1), lk, balance=-1)
        outcome = "written"
    except dlock.StaleFence:
        outcome = "StaleFence"
    (base / "outcome").write_text(outcome)
    with contextlib.suppress(DLockError):
        lk.release()
