"""``manage.py runworker``: an alias of ``manage.py dlock_runworker``.

The same command class under the short name. Django Channels also has a
``runworker`` command; with both apps installed, Django runs the command of
the app listed first in ``INSTALLED_APPS``. ``dlock_runworker`` never clashes.
"""

from __future__ import annotations

from django_dlock.management.commands.dlock_runworker import Command

__all__ = ["Command"]
