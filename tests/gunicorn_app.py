"""The tests' site as a WSGI application for gunicorn (tests/test_pooling.py).

Django's connection pool on the PostgreSQL alias (4 connections, a dry pool
fails after 3 s) and ``ATOMIC_REQUESTS``: each request runs in a
transaction that holds one of the pool's connections.
"""

from __future__ import annotations

import os

os.environ["DLOCK_TEST_CHILD"] = "1"
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.gunicorn_settings"

from django.core.wsgi import get_wsgi_application  # noqa: E402

application = get_wsgi_application()
