"""The base of transaction-scoped strategies (``advisory_xact`` and ``row``).

A transaction-scoped lock is taken on the caller's own Django connection,
inside the caller's ``transaction.atomic`` block, and the database releases
it when that transaction ends (commit or rollback), or when the savepoint it
was taken in is rolled back. Nothing can release it earlier, so:

* acquiring outside ``transaction.atomic`` is a :class:`TransactionRequired`
  that names the fix (``transaction.atomic`` or :func:`django_dlock.lock_and_atomic`);
* an explicit ``release()`` is a :class:`DLockError`; leaving a ``with``
  block (or a decorated function) ends the holding in Python, and the
  database keeps the lock until the transaction ends;
* a fencing number (PostgreSQL) is drawn only when it is first read
  (:meth:`TransactionScoped.draw_fence`): most holders never read it, and
  drawing one costs a transaction of its own, committed and flushed;
* a holding never outlives its transaction: each acquisition registers a
  marker with ``transaction.on_commit``. Django runs the marker at commit,
  and drops it at rollback and at the rollback of an enclosing savepoint,
  exactly when the database drops the lock. A holding whose marker is no
  longer pending has ended (:meth:`TransactionScoped.ended`), and the front
  object forgets it, so a later ``acquire`` in a new transaction takes the
  lock again instead of counting a re-entry.

From async code a transaction-scoped lock is acquired in the thread that
runs the transaction (``sync_to_async``, thread-sensitive), which is where
Django runs a transaction that an async function is nested in. Two tasks
that share one transaction share its locks in the database; django-dlock
keeps them apart: the second gets the lock only when the first has left its
block (a try fails; a wait is an error, since the first cannot finish while
the second blocks their common thread).
"""

from __future__ import annotations

import threading
import weakref

from asgiref.sync import sync_to_async
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DLockError, TransactionRequired
from django_dlock.retry import Deadline
from django_dlock.strategies.base import Grant, Request
from django_dlock.strategies.connection import _closed, deadline_end, guard_statements
from django_dlock.strategies.fence import durable_fence

#: markers kept before ended ones are swept
_SWEEP_AT = 1000


class Marker:
    """A pending ``on_commit`` callback that stands for one transaction-scoped holding.

    Pending exactly while the database still holds the lock: Django calls it
    at commit, and forgets it on rollback (also of the savepoint it was
    registered in).
    """

    __slots__ = ("__weakref__", "active", "connection", "done", "key", "token")

    def __init__(self, connection: BaseDatabaseWrapper, key: tuple[str, str, str]) -> None:
        self.connection = weakref.ref(connection)
        self.key = key
        self.token = key[1]
        self.done = False
        #: the holder has not left its block yet (see the sibling check)
        self.active = True

    def __call__(self) -> None:  # on commit
        self.done = True
        _forget(self)

    def pending(self) -> bool:
        if self.done:
            return False
        connection = self.connection()
        if connection is None or not connection.in_atomic_block:
            return False
        return any(entry[1] is self for entry in connection.run_on_commit)


# (alias, token, name) -> marker of the holder's holding
_markers: dict[tuple[str, str, str], Marker] = {}
# (id(connection), name) -> the latest marker on that connection
_by_connection: dict[tuple[int, str], Marker] = {}
_mutex = threading.Lock()


def _forget(marker: Marker) -> None:
    with _mutex:
        if _markers.get(marker.key) is marker:
            del _markers[marker.key]
        connection = marker.connection()
        slot = (id(connection), marker.key[2])
        if _by_connection.get(slot) is marker:
            del _by_connection[slot]


def _sweep() -> None:
    with _mutex:
        ended = [m for m in _markers.values() if not m.pending()]
        ended += [m for m in _by_connection.values() if not m.pending()]
    for marker in ended:
        _forget(marker)


class TransactionScoped:
    """What the transaction-scoped strategies (``advisory_xact``, ``row``) share."""

    name = ""
    family = ""
    #: read by the front object: ``release()`` is refused, holdings end with
    #: the transaction (see :meth:`ended`)
    transaction_scoped = True
    leased = False
    shares = False

    def loss_reason(self, req: Request) -> str | None:
        """Nothing to add: the lock ended with its transaction."""
        return None

    def atomic_connection(self, req: Request) -> BaseDatabaseWrapper:
        """The caller's connection, which must be inside ``transaction.atomic``."""
        connection = connections[req.alias]
        if deadline_end() is not None:  # an acquire with a timeout: its statements are watched
            guard_statements(connection)
        if not connection.in_atomic_block:
            raise TransactionRequired(
                f"the {self.name!r} strategy holds {req.key.name!r} until the end of the "
                f"current transaction, and there is none on database {req.alias!r}: wrap "
                f"the code in `with transaction.atomic(using={req.alias!r}):` or use "
                "`django_dlock.lock_and_atomic(...)`"
            )
        return connection

    def sibling_holds(self, connection: BaseDatabaseWrapper, req: Request) -> bool:
        """Whether another holder (task) holds ``req``'s key in this very transaction."""
        other = _by_connection.get((id(connection), req.key.name))
        return (
            other is not None
            and other.token != req.token
            and other.active
            and other.connection() is connection
            and other.pending()
        )

    def refuse_sibling_wait(self, req: Request) -> DLockError:
        return DLockError(
            f"{req.key.name!r} is held by another task that shares this database "
            "transaction; tasks in one transaction cannot wait for each other (the "
            "other one cannot finish while this one blocks their thread): give each "
            "task its own transaction, or use timeout=0"
        )

    def remember(self, connection: BaseDatabaseWrapper, req: Request) -> None:
        """Register the holding's marker once the lock is held."""
        key = (req.alias, req.token, req.key.name)
        marker = Marker(connection, key)
        connection.on_commit(marker)
        with _mutex:
            _markers[key] = marker
            _by_connection[(id(connection), req.key.name)] = marker
            crowded = len(_markers) + len(_by_connection) > _SWEEP_AT
        if crowded:
            _sweep()

    def marker(self, req: Request) -> Marker | None:
        return _markers.get((req.alias, req.token, req.key.name))

    def ended(self, req: Request) -> bool:
        """Whether the holding's transaction (or savepoint) has ended (no query)."""
        marker = self.marker(req)
        if marker is None or not marker.pending():
            if marker is not None:
                _forget(marker)
            return True
        return False

    # -- the fencing number -------------------------------------------------------

    def draw_fence(self, req: Request) -> int | None:
        """The holding's fencing number, drawn now (it is first read); ``None``
        if the lock is no longer held (no number is given out).

        The number comes from :func:`~django_dlock.strategies.fence.durable_fence`:
        a transaction of its own on the thread's lock connection, committed
        and flushed before it is returned, so no crash of the server can
        issue it again. It must also be above every earlier holder's and
        below every later one's: the lock must be held when it is drawn.
        So, once it is drawn, the caller's transaction is asked whether it
        still lives (one ``SELECT 1`` on its session): a transaction that
        answers has held the lock since it took it, through the draw (a
        transaction-scoped lock ends only with its transaction, or the
        savepoint it was taken in, which the holding's marker follows), and
        every holder after it draws later. Earlier holders drew theirs while
        they held the lock, before this transaction took it.

        Called from the holder's thread (async holders draw theirs at once,
        in the transaction's thread: see :meth:`aacquire`).

        Raises:
            DatabaseUnavailable: the number could not be drawn.
        """
        if self.ended(req):
            return None
        number = durable_fence(req.alias)
        marker = self.marker(req)
        if marker is None or not marker.pending():
            return None
        connection = marker.connection()
        if connection is None or not _answers(connection):
            return None
        return number

    # -- the protocol ----------------------------------------------------------

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        """Async ``acquire``, in the thread of the caller's transaction; a
        fencing number is drawn there at once (async code cannot read it
        later without a query on the event loop)."""
        return await sync_to_async(self._acquire_drawn)(req, deadline, policy)

    def _acquire_drawn(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        grant: Grant | None = self.acquire(req, deadline, policy)  # type: ignore[attr-defined]
        if grant is None or not grant.later:
            return grant
        return Grant(self.draw_fence(req))

    def try_acquire(self, req: Request) -> int | None:
        grant: Grant | None = self.acquire(req, Deadline(0), 0.0)  # type: ignore[attr-defined]
        if grant is None:
            return None
        return 0 if grant.fence is None else grant.fence

    def release(self, req: Request) -> bool:
        """The holder left its block: the database keeps the lock until the transaction ends.

        ``False`` if the transaction (or the savepoint the lock was taken in)
        had already ended.
        """
        marker = self.marker(req)
        if marker is None:
            return False
        marker.active = False
        still = marker.pending()
        with _mutex:
            if _markers.get(marker.key) is marker:
                del _markers[marker.key]
        return still

    def extend(self, req: Request, ttl: float) -> bool:
        """Nothing to extend: true while the database still holds the lock (:meth:`owned`)."""
        return self.owned(req)  # type: ignore[attr-defined, no-any-return]


def _answers(connection: BaseDatabaseWrapper) -> bool:
    """Whether the caller's session still answers inside its transaction: one
    ``SELECT 1`` on its driver connection (not Django's cursor, which refuses
    any statement in a transaction that had an error). An error from a
    server that answered (an aborted transaction, which holds its locks until
    it ends) is an answer; a connection that broke is none."""
    raw = connection.connection
    if raw is None:
        return False
    try:
        with raw.cursor() as cur:
            cur.execute("SELECT 1")
    except Exception:
        return not _closed(raw)
    return True
