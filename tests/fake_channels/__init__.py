"""A stand-in app for Django Channels: it defines a ``runworker`` command too.

Only for tests of which app's command Django runs (see test_runworker.py);
never in ``INSTALLED_APPS`` outside ``override_settings``.
"""
