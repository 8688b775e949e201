from __future__ import annotations

import gc

import pytest

from django_dlock.strategies.advisory import sessions
from django_dlock.strategies.connection import close_private_connections

from ..helpers import wait_until


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    # Every test gives back what it took: no session of this process may
    # still hold a lock (threads that ended are buried by the watcher).
    gc.collect()
    wait_until(lambda: not sessions.holding_sessions(), timeout=30)
    sessions.close_all()
    close_private_connections()
