"""Settings of the benchmark run: the test settings on their own databases.

``default`` is the PostgreSQL database ``dlock_bench``; ``big`` is
``dlock_bench_big``, which holds a million expired lease rows for the scale
benchmark. Both are created and migrated by the run.
"""

from __future__ import annotations

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES as _TEST_DATABASES

_pg = {k: v for k, v in _TEST_DATABASES["default"].items() if k != "TEST"}
DATABASES = {
    "default": {**_pg, "NAME": "dlock_bench"},
    "big": {**_pg, "NAME": "dlock_bench_big"},
}

# As a production site would run: acquisitions are logged at DEBUG, which is
# off. (The test settings turn it on to exercise the log calls.)
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"django_dlock": {"level": "WARNING"}},
}
