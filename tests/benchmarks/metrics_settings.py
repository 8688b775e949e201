"""Settings of ``tests.benchmarks.metrics_overhead``: a PostgreSQL database of its
own (suffixed with ``DLOCK_TEST_DB_SUFFIX``) and an in-memory SQLite database."""

from __future__ import annotations

import os

from tests.benchmarks.settings import *  # noqa: F403
from tests.benchmarks.settings import DATABASES as _BENCH_DATABASES

_suffix = os.environ.get("DLOCK_TEST_DB_SUFFIX", "")
DATABASES = {
    "default": {**_BENCH_DATABASES["default"], "NAME": f"dlock_bench_metrics{_suffix}"},
    "memory": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
}
