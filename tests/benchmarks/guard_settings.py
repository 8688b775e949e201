"""Settings of ``tests.benchmarks.guarded_writes``: one database of its own on
each server (suffixed with ``DLOCK_TEST_DB_SUFFIX``), created by the run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tests.benchmarks.settings import *  # noqa: F403
from tests.benchmarks.settings import DATABASES as _BENCH_DATABASES
from tests.settings import DATABASES as _TEST_DATABASES

_suffix = os.environ.get("DLOCK_TEST_DB_SUFFIX", "")
_mysql = {k: v for k, v in _TEST_DATABASES["mysql"].items() if k != "TEST"}
DATABASES = {
    "default": {**_BENCH_DATABASES["default"], "NAME": f"dlock_bench_guard{_suffix}"},
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(Path(tempfile.gettempdir()) / f"dlock_bench_guard{_suffix}.sqlite3"),
    },
    "mysql": {**_mysql, "NAME": f"dlock_bench_guard{_suffix}"},
}
