"""pytest fixtures of django-dlock's testing kit.

List the module in your ``conftest.py``::

    pytest_plugins = ["django_dlock.testing.fixtures"]

Each test then ends with the library's connections closed (the ``LISTEN``
connections that wake waiters, idle advisory sessions, quorum workers, a
thread's private lock connection), so the test database can be dropped at
the end of the run: PostgreSQL refuses to drop a database that still has
sessions. The ``dlock_testing`` fixture gives the helpers of
:mod:`django_dlock.testing`.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(autouse=True)
def _dlock_close_connections() -> Iterator[None]:
    """After each test, close what django-dlock opened (a test that used no
    lock pays nothing: only what was loaded is closed)."""
    yield
    import sys

    if "django_dlock.locks" in sys.modules:
        import django_dlock

        django_dlock.close_connections()


@pytest.fixture
def dlock_testing() -> ModuleType:
    """The helpers of :mod:`django_dlock.testing` (``assert_locked``,
    ``held_elsewhere``, ``expire``, ``force_release``, ``end_session``, ``reset``)."""
    from django_dlock import testing

    return testing
