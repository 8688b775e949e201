"""The ported peer suites of tests/test_peer_suites.py again, each test while
background load runs against its database (threads that take and release
other locks, a process that keeps a CPU busy: see ``Load`` there).

A module of its own, so that the quiet and the loaded runs go to two
workers side by side.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .test_peer_suites import *  # noqa: F403  (the same tests, collected here again)
from .test_peer_suites import Load, _every_test_both_ways, under_load  # noqa: F401

pytestmark = [
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True, databases=["default", "sqlite", "mysql"]),
]


@pytest.fixture
def load(request: pytest.FixtureRequest) -> Iterator[Load]:
    yield from under_load(request)
