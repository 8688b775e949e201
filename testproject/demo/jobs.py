"""Jobs of the example site.

``manage.py dlock_runworker`` runs ``heartbeat`` (and the built-in cleanup
job) on the elected leader only (see ``DLOCK_WORKER_JOBS`` in the settings):
start it on as many machines as you like, exactly one acts.
"""

from __future__ import annotations

import logging
import os
import socket

import django_dlock as dlock
from django_dlock.leader import current_leadership

logger = logging.getLogger(__name__)


def heartbeat() -> None:
    """A leader-only job: logs who leads and the leadership term (its fence)."""
    leadership = current_leadership()
    term = leadership.term if leadership else None
    logger.info("heartbeat from %s pid %s, term %s", socket.gethostname(), os.getpid(), term)


@dlock.TaskLock("nightly-report", min_hold=60, max_hold=600)
def nightly_report() -> str:
    """A scheduled job any worker may fire; it runs at most once a minute."""
    return "report generated"
