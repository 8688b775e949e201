"""The ``lease`` strategy: a row in the ``Lock`` table with an expiry.

Works on PostgreSQL, SQLite and MySQL/MariaDB. Every operation is one atomic
statement (or, on MySQL/MariaDB, one short transaction) that checks the
holder's token and judges the lease on the database clock:

* **acquire** inserts the row, or takes it over when its lease has ended
  (``expire_at <= now``) and no live waiter's ticket is ahead of the caller
  (see :mod:`django_dlock.strategies.queue`: waiters are served first come,
  first served), or when it is already the caller's, and returns a new
  fencing number (every acquire is a new grant);
* **release** ends the lease (``expire_at = now``, empty token) only if the
  token matches, and on PostgreSQL, only if the key has waiters, sends
  ``NOTIFY django_dlock`` addressed to the next one;
* **extend** moves ``expire_at`` only if the token matches.

Fencing numbers: on PostgreSQL every acquisition takes
``nextval('django_dlock_fence')`` (and at least the row's number + 1):
strictly greater than every number issued before for that key.
``dlock_cleanup`` raises the sequence above every number it deletes. After
a fail-over (a promoted standby: a new timeline) the sequence first jumps to
the server's clock in microseconds, so numbers a standby never received are
not issued again (see :mod:`django_dlock.strategies.fence`).

Durability (PostgreSQL): by default each lease write waits for its WAL
flush, like any commit. With ``DLOCK_LEASE_SYNCHRONOUS_COMMIT = False`` lease
writes commit with ``synchronous_commit = off`` (set for the statement's own
transaction, in the same statement): about twice as fast, but a crash of the
*database server* can lose the last fraction of a second of lease writes, so
a lock acquired just before the crash can be free again after it (its holder
learns it on its next renew, extend or release: ``LockLost``). Fencing
numbers then also follow the database clock (microseconds since the epoch),
so they keep increasing across such a crash, as long as the database
server's clock is not set back. On SQLite and MySQL/MariaDB a key's number is its row's
number + 1, and a new row starts above ``FenceFloor.value``, which
``dlock_cleanup`` raises to the highest number it deletes.

The package: :mod:`.sql` (the statements), :mod:`.acquire` (one try),
:mod:`.waiting` (how a waiter with a ticket waits), :mod:`.handoff` (an
async step's cancellation), :mod:`.pins` (a lease row its holder's own
transaction keeps locked) and :mod:`.strategy` (:class:`LeaseStrategy`).
"""

from __future__ import annotations

from django_dlock.strategies.lease.sql import NOTIFY_CHANNEL, TABLE, WAITERS
from django_dlock.strategies.lease.strategy import LeaseStrategy, lease
from django_dlock.strategies.lease.waiting import (
    EXPIRY_MARGIN,
    MAX_OUTAGE_PAUSE,
    MAX_PARK,
    Look,
    Outage,
    Step,
)

__all__ = [
    "EXPIRY_MARGIN",
    "MAX_OUTAGE_PAUSE",
    "MAX_PARK",
    "NOTIFY_CHANNEL",
    "TABLE",
    "WAITERS",
    "LeaseStrategy",
    "Look",
    "Outage",
    "Step",
    "lease",
]
