"""Settings for the test suite: three real databases in one run.

* ``default``: PostgreSQL on 127.0.0.1:5432 (user ``postgres``)
* ``sqlite``: a SQLite file (a file, so that processes can share it)
* ``mysql``: MariaDB/MySQL on 127.0.0.1:3306 (user ``root``)

Override with ``DLOCK_TEST_PG_HOST``/``_PORT``/``_USER``,
``DLOCK_TEST_MYSQL_HOST``/``_PORT``/``_USER``/``_PASSWORD``. Set
``DLOCK_TEST_DB_SUFFIX`` to run two suites side by side on one server
(pytest-xdist workers add their own name to it).
Child processes started by the tests set ``DLOCK_TEST_CHILD=1`` to use the
test databases directly.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

try:  # a pure-Python MySQL driver, so the suite installs without C headers
    import MySQLdb  # noqa: F401  (mysqlclient, if installed, is used as is)
except ImportError:
    import pymysql

    # Django checks the mysqlclient version it was built for; PyMySQL speaks
    # the same DB-API and reports an older mysqlclient version.
    pymysql.version_info = (2, 2, 7, "final", 0)
    pymysql.install_as_MySQLdb()

env = os.environ.get
SUFFIX = env("DLOCK_TEST_DB_SUFFIX", "")
_WORKER = env("PYTEST_XDIST_WORKER")  # gw0, gw1, ... when pytest-xdist runs the suite
if _WORKER and not SUFFIX.endswith(f"_{_WORKER}"):
    # Each worker has its own databases (and so do the processes it starts,
    # which inherit this variable): tests/conftest.py keeps pytest-django from
    # adding a suffix of its own.
    SUFFIX = f"{SUFFIX}_{_WORKER}"
    os.environ["DLOCK_TEST_DB_SUFFIX"] = SUFFIX
CHILD = env("DLOCK_TEST_CHILD") == "1"

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dlock",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "tests.urls"
STATIC_URL = "/static/"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_sqlite_test = str(Path(tempfile.gettempdir()) / f"django_dlock_test{SUFFIX}.sqlite3")

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": f"dlock{SUFFIX}",
        "USER": env("DLOCK_TEST_PG_USER", "postgres"),
        "HOST": env("DLOCK_TEST_PG_HOST", "127.0.0.1"),
        "PORT": env("DLOCK_TEST_PG_PORT", "5432"),
        "TEST": {"NAME": f"test_dlock{SUFFIX}"},
    },
    "sqlite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": str(Path(tempfile.gettempdir()) / f"django_dlock{SUFFIX}.sqlite3"),
        "OPTIONS": {"timeout": 30},
        # created on its own: a test may use this database alone
        "TEST": {"NAME": _sqlite_test, "DEPENDENCIES": []},
    },
    "mysql": {
        "ENGINE": "django.db.backends.mysql",
        "NAME": f"dlock{SUFFIX}",
        "USER": env("DLOCK_TEST_MYSQL_USER", "root"),
        "PASSWORD": env("DLOCK_TEST_MYSQL_PASSWORD", ""),
        "HOST": env("DLOCK_TEST_MYSQL_HOST", "127.0.0.1"),
        "PORT": env("DLOCK_TEST_MYSQL_PORT", "3306"),
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {
            "NAME": f"test_dlock{SUFFIX}",
            "CHARSET": "utf8mb4",
            "COLLATION": "utf8mb4_unicode_ci",
            "DEPENDENCIES": [],
        },
    },
}

# Three independent PostgreSQL databases for quorum locks (tests/test_quorum.py).
for _n in (1, 2, 3):
    DATABASES[f"q{_n}"] = {
        **DATABASES["default"],
        "NAME": f"dlock_q{_n}{SUFFIX}",
        "TEST": {"NAME": f"test_dlock_q{_n}{SUFFIX}"},
    }

if CHILD:
    for _db in DATABASES.values():
        _db["NAME"] = _db["TEST"]["NAME"]  # type: ignore[index]

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_dlock": {"handlers": ["null"], "level": "DEBUG"}},
}

# Django's Tasks framework (django_dlock.contrib.tasks): on Django 6 its own
# ``django.tasks`` with django-tasks-db's ORM backend and ``db_worker``; on
# older Django the django-tasks backport, whose 0.9 series ships that backend.
from importlib.util import find_spec as _find_spec  # noqa: E402

import django as _django  # noqa: E402

if _django.VERSION >= (6, 0):
    if _find_spec("django_tasks_db"):
        INSTALLED_APPS.append("django_tasks_db")
        _TASKS_DB_BACKEND = "django_tasks_db.DatabaseBackend"
    else:
        _TASKS_DB_BACKEND = ""
    _TASKS_PREFIX = "django.tasks.backends"
elif _find_spec("django_tasks"):
    INSTALLED_APPS += ["django_tasks", "django_tasks.backends.database"]
    _TASKS_DB_BACKEND = "django_tasks.backends.database.DatabaseBackend"
    _TASKS_PREFIX = "django_tasks.backends"
else:
    _TASKS_DB_BACKEND = _TASKS_PREFIX = ""
if _TASKS_PREFIX:
    TASKS: dict[str, dict[str, object]] = {
        "immediate": {"BACKEND": f"{_TASKS_PREFIX}.immediate.ImmediateBackend"},
        "dummy": {"BACKEND": f"{_TASKS_PREFIX}.dummy.DummyBackend"},
    }
    if _TASKS_DB_BACKEND:
        TASKS["default"] = {"BACKEND": _TASKS_DB_BACKEND, "QUEUES": []}
    else:
        TASKS["default"] = TASKS["immediate"]
