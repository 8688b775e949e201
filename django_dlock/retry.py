"""Waiting policies: deadlines, retry intervals with jitter, backoff.

``retry_interval`` is either seconds (a number: each wait is that long with
up to ±50 % random jitter, so waiters do not retry in step) or a function of
the attempt number, 0-based, returning seconds (used as is: no jitter, you
are in full control). Examples::

    retry_interval=0.05                                   # fixed, jittered
    retry_interval=lambda n: min(0.01 * 2**n, 1.0)        # exponential backoff
"""

from __future__ import annotations

import math
import random
import time

from django_dlock.conf import RetryInterval
from django_dlock.validation import MAX_SECONDS


class Deadline:
    """A wait budget: ``None`` waits forever, ``0`` tries once.

    A timeout longer than :data:`~django_dlock.validation.MAX_SECONDS`
    (about 31 years; ``float("inf")`` and ``sys.maxsize`` too) waits forever
    like ``None``: no wait ends that late, and the clocks and the system
    calls that waits use cannot count that far.
    """

    def __init__(self, timeout: float | None) -> None:
        if timeout is not None and timeout > MAX_SECONDS:
            timeout = None  # no wait ends that late: wait forever
        self.timeout = timeout
        self.start = time.monotonic()
        self.end = math.inf if timeout is None else self.start + timeout

    def remaining(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def elapsed(self) -> float:
        return time.monotonic() - self.start


#: the first pause before an acquire tries again to reach a database that is away
OUTAGE_FIRST_PAUSE = 0.05
#: the longest pause between two tries to reach a database that is away
OUTAGE_MAX_PAUSE = 1.0


def outage_pause(attempt: int) -> float:
    """Seconds to wait before try number ``attempt`` (0-based) to reach a
    database that is away: 50 ms, doubling up to a second, with ±20 %
    jitter so that the clients of a database that fails over do not all
    reconnect in step."""
    base = min(OUTAGE_MAX_PAUSE, OUTAGE_FIRST_PAUSE * 2.0 ** min(attempt, 16))
    return min(OUTAGE_MAX_PAUSE, base * random.uniform(0.8, 1.2))


def interval(policy: RetryInterval, attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (0-based)."""
    if callable(policy):
        return max(0.0, float(policy(attempt)))
    base = float(policy)
    return base * random.uniform(0.5, 1.5)
