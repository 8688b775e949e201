"""Settings of the example site, read from the environment (django-environ).

``DATABASE_URL`` picks the database; the default is a SQLite file next to
``manage.py``, so the demo needs no server::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/dlock python manage.py dlock_demo
"""

from __future__ import annotations

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env(
    DEBUG=(bool, True),
    SECRET_KEY=(str, "testproject-insecure-key-for-local-use-only"),
    ALLOWED_HOSTS=(list, ["localhost", "127.0.0.1"]),
    DLOCK_DEFAULT_STRATEGY=(str, "lease"),
)
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

DEBUG = env("DEBUG")
SECRET_KEY = env("SECRET_KEY")
ALLOWED_HOSTS = env("ALLOWED_HOSTS")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dlock",
    "testproject.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_dlock.middleware.LockMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"
ASGI_APPLICATION = "testproject.asgi.application"

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

DATABASES = {
    "default": env.db("DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
}

USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DLOCK_DEFAULT_STRATEGY = env("DLOCK_DEFAULT_STRATEGY")

# One checkout at a time per user (or anonymous session): a double-submitted
# form gets 423 Locked instead of a second order.
DLOCK_MIDDLEWARE_RULES = [
    {"path": r"^/checkout/$", "methods": ["POST"], "key": "checkout:{user}", "name": "checkout"},
]

# manage.py dlock_runworker: jobs that run on the elected leader only.
DLOCK_WORKER_JOBS = [
    {"job": "testproject.demo.jobs.heartbeat", "interval": 10},
    {"job": "django_dlock.jobs.cleanup", "interval": 3600},
]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_dlock": {"handlers": ["console"], "level": "WARNING"},
        # the example jobs' lines (heartbeat) are news, not warnings
        "testproject": {"handlers": ["console"], "level": "INFO"},
    },
}
