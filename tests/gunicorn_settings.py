"""Settings of tests/gunicorn_app.py: the test settings, pooled, one transaction per request."""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["default"] = {
    **DATABASES["default"],
    "ATOMIC_REQUESTS": True,
    "OPTIONS": {"pool": {"min_size": 0, "max_size": 4, "timeout": 3}},
}
