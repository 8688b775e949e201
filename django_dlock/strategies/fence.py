"""The next fencing number on PostgreSQL, also across a fail-over.

Every strategy that issues fencing numbers on PostgreSQL takes them from the
``django_dlock_fence`` sequence through :data:`NEXT_FENCE`. A sequence is
WAL-logged ahead, 32 numbers at a time (see "Sequence Manipulation
Functions" in the PostgreSQL documentation): if the primary dies before a
standby received the record of the latest batch, the promoted standby hands
out numbers of that batch again, numbers the old primary already gave to
holders. A fencing number must never go backwards, so:

* promotion starts a new **timeline** (PostgreSQL's "Timelines" in
  "Continuous Archiving and Point-in-Time Recovery"), visible at once in the
  name of the current WAL file, ``pg_walfile_name(pg_current_wal_lsn())``,
  whose first eight hex digits are the timeline ID;
* the first number taken on a timeline ``t`` that is below
  ``(t - 1) * 2**44`` raises the sequence by that much (``setval``), so
  every number of timeline ``t`` is above every number of the timelines
  before (as long as fewer than 2**44, about 1.7e13, numbers are taken per
  timeline). On timeline 1, a database never promoted, nothing changes;
* a session that has seen the sequence at or above its timeline's epoch
  says so in its setting :data:`ABOVE_EPOCH` and takes plain ``nextval``
  from then on: a sequence only goes up, a session never outlives its
  timeline, and a standby takes no number (``nextval`` fails in a read-only
  transaction), so a session open on a standby that is promoted reads the
  new timeline at its first number.

The raise is stored in the sequence itself: a copy of the database
(``pg_dump``, logical replication) carries it along. ``setval`` needs the
``UPDATE`` privilege on the sequence; a role that has only ``USAGE`` gets
``(t - 1) * 2**44`` added to the sequence's number instead (just as
increasing, but not stored), until a role that may raise the sequence
takes a number. Two statements that
raise at the same moment may return the same number for two different keys;
per key, numbers stay strictly increasing (each strategy also takes at
least the key's previous number + 1 where it keeps one).

A number must also survive a **crash** of the server. ``nextval`` is not
rolled back with its transaction, but its WAL record is flushed only by a
commit that waits for the flush; a number drawn in a transaction that never
commits (the server crashed first) can come back after the restart. The
``lease`` strategy draws its number in a statement that commits before the
number is handed out. The transaction-scoped strategies (``row``,
``advisory_xact``) hold their lock in the caller's transaction, so they draw
it with :func:`durable_fence`: a statement of its own, committed (and
flushed) before the number is returned.
"""

from __future__ import annotations

from django_dlock.strategies.connection import fetch_one, unwatched, with_reconnect
from django_dlock.tables import FENCE_SEQUENCE

#: bits below the timeline in a fencing number (numbers per timeline: 2**44)
TIMELINE_SHIFT = 44

#: the session setting that says this session saw the sequence at or above
#: its timeline's epoch (set by ``django_dlock_next_fence``, migration 0010)
ABOVE_EPOCH = "django_dlock.fence_above_epoch"

#: a SQL expression (no parameters): the next fencing number. A PL/pgSQL
#: function (migrations 0009 and 0010) takes ``nextval``, reads the timeline
#: from ``pg_walfile_name(pg_current_wal_lsn())`` and raises the sequence when
#: the number is below the timeline's epoch ``(timeline - 1) << TIMELINE_SHIFT``
#: (only ``has_sequence_privilege(..., 'UPDATE')``; else the epoch is added).
#: Once it found the sequence at or above the epoch, it sets
#: :data:`ABOVE_EPOCH` for the session, and the session's later numbers are a
#: plain ``nextval``: a sequence only goes up, and a session lives on one
#: timeline (a standby takes no number). A function, not an expression with
#: a subquery (PostgreSQL sets a subquery up at every execution); and called
#: only until the session knows (a PL/pgSQL call cost about 6 % of the
#: server's work in an uncontended lease pair).
NEXT_FENCE = (
    f"CASE WHEN current_setting('{ABOVE_EPOCH}', true) = 'on' "
    f"THEN nextval('{FENCE_SEQUENCE}') ELSE django_dlock_next_fence() END"
)

#: the next fencing number in a transaction of its own, committed and flushed before
#: it is returned: an xid makes the commit write a record, and synchronous_commit
#: (for this transaction) makes it wait until that record, and every WAL record
#: before it (the sequence's), is on disk
_DURABLE_FENCE = (
    f"SELECT {NEXT_FENCE}, pg_current_xact_id(), set_config('synchronous_commit', 'on', true)"
)


def durable_fence(alias: str) -> int:
    """A fencing number of ``alias``'s database that no crash can issue again.

    Drawn on the thread's lock connection (outside the caller's transaction:
    :func:`~django_dlock.strategies.connection.lock_connection`), never given
    up half-way at an acquire's deadline: the lock it numbers is already held.

    Raises:
        DatabaseUnavailable: the database could not be reached.
    """
    with unwatched():
        row, _ = with_reconnect(alias, lambda connection: fetch_one(connection, _DURABLE_FENCE, []))
    return int(row[0])
