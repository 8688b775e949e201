"""The next fencing number on PostgreSQL, also across a fail-over.

Every strategy that issues fencing numbers on PostgreSQL takes them from the
``django_dlock_fence`` sequence through :data:`NEXT_FENCE`. A sequence is
WAL-logged ahead, 32 numbers at a time (see "Sequence Manipulation
Functions" in the PostgreSQL documentation): if the primary dies before a
standby received the record of the latest batch, the promoted standby hands
out numbers of that batch again, numbers the old primary already gave to
holders. With asynchronous replication it can have missed far more (every
number of the old primary's last seconds). A fencing number must never
repeat or go backwards, so:

* promotion starts a new **timeline** (PostgreSQL's "Timelines" in
  "Continuous Archiving and Point-in-Time Recovery"), visible at once in the
  name of the current WAL file, ``pg_walfile_name(pg_current_wal_lsn())``,
  whose first eight hex digits are the timeline ID. The ID alone is no
  epoch: a standby that never followed the newest timeline (two
  switchovers in quick succession) gives its own new timeline an ID that is
  already used;
* a one-row table (:data:`~django_dlock.tables.FENCE_ERA_TABLE`) records the
  timeline on which the sequence was last raised. It is replicated with the
  data, so a promoted standby's copy names the last era *it* saw: when the
  timeline a number is taken on is not the recorded one, the first number of
  this new era raises the sequence to the server's clock in microseconds
  since the Unix epoch (``setval``) and records the timeline. The row's lock
  makes one session do it; the others wait for it and find the timeline
  recorded;
* every number the old primary issued is below that raise: it was at most
  its own era's raise plus the numbers taken since, fewer than one per
  microsecond, so below the old primary's clock, and the new primary's clock
  is later, as long as the members' clocks agree to within the time between
  two promotions (seconds; NTP keeps them within milliseconds). With
  synchronous replication the promoted standby already has every number
  issued, and the raise only moves the numbers up: no clock is involved;
* a database never promoted stays in its first era (the migration records
  the timeline it is on), and its numbers count from 1;
* a session that found its timeline recorded says so in its setting
  :data:`ERA_SEEN` and takes plain ``nextval`` from then on: a sequence
  only goes up, a primary's session never outlives its timeline, and a
  standby takes no number (``pg_current_wal_lsn()`` and ``nextval`` fail in
  recovery), so a session open on a standby that is promoted reads the new
  timeline at its first number.

The raise is stored in the sequence itself: a copy of the database
(``pg_dump``, logical replication) carries it along. ``setval`` needs the
``UPDATE`` privilege on the sequence (and the table's ``INSERT`` and
``UPDATE``); a role that has only ``USAGE`` gets ``GREATEST(nextval,
clock)`` instead (just as increasing, but not stored), until a role that
may raise the sequence takes a number. Two statements that take numbers at
the same moment may return the same number for two different keys; per key,
numbers stay strictly increasing (each strategy also takes at least the
key's previous number + 1 where it keeps one).

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

#: the session setting that says this session found its timeline recorded in
#: the era table (set by ``django_dlock_next_fence``, migration 0011)
ERA_SEEN = "django_dlock.fence_era_seen"

#: a SQL expression (no parameters): the next fencing number. A PL/pgSQL
#: function (migration 0011) reads the timeline from
#: ``pg_walfile_name(pg_current_wal_lsn())``; when the era table
#: (:data:`~django_dlock.tables.FENCE_ERA_TABLE`) names another one, it
#: raises the sequence to the server's clock (microseconds) and records the
#: timeline. It then sets :data:`ERA_SEEN` for the session,
#: and the session's later numbers are a plain ``nextval``: a sequence only
#: goes up, and a session lives on one timeline (a standby takes no number).
#: A function, not an expression with a subquery (PostgreSQL sets a subquery
#: up at every execution); and called only until the session knows (a
#: PL/pgSQL call cost about 6 % of the server's work in an uncontended lease
#: pair).
NEXT_FENCE = (
    f"CASE WHEN current_setting('{ERA_SEEN}', true) = 'on' "
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
