"""Leases held longer than usual: flagged once, when a renewal finds them so.

A lease held (renewed, by its background renewer or by ``extend()``) for
longer than ``DLOCK_LONG_HOLD`` seconds is a stuck job or a leaked lease
more often than real work: the renewal that first finds its holding that
old (on this process's clock, from the grant) flags it, once per holding:
a WARNING log line, the ``lock_held_long`` signal, and the
``dlock_long_holds_total`` metric. The admin and ``dlock_list`` mark such a
lease on their own, from its row (``acquired_at`` on the database clock),
whoever holds it.

Off by default (``DLOCK_LONG_HOLD = None``); when off, a renewal pays one
attribute read.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from django_dlock import signals
from django_dlock.conf import conf

if TYPE_CHECKING:
    from django_dlock.holdings import Holding

__all__ = ["bound", "note_renewed"]

logger = logging.getLogger("django_dlock")


def bound() -> float | None:
    """Seconds after which a held lease counts as held long (``None``: never)."""
    return conf.LONG_HOLD


def note_renewed(holding: Holding) -> None:
    """``holding`` was just renewed: flag it if it is held long, once."""
    if holding.held_long:
        return
    limit = conf.LONG_HOLD
    if limit is None:
        return
    held = time.monotonic() - holding.acquired_at
    if held < limit:
        return
    holding.held_long = True
    req = holding.request
    strategy = holding.strategy.name
    logger.warning(
        "django-dlock: %s has been held for %.0f s, longer than DLOCK_LONG_HOLD (%g s), by %s",
        req.key.name,
        held,
        limit,
        req.owner,
        extra={
            "lock_name": req.key.name,
            "lock_strategy": strategy,
            "lock_fence": holding.fence,
            "lock_held": held,
            "lock_owner": req.owner,
        },
    )
    from django_dlock import metrics

    if metrics.observer is not None:
        metrics.observer.long_holds.labels(strategy).inc()
    signals.lock_held_long.send(
        holding.sender, name=req.key.name, strategy=strategy, held=held, owner=req.owner
    )
