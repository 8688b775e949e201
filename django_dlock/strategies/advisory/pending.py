"""Two-phase acquire on the ``advisory`` strategy (PostgreSQL): a pending lock.

``Lock.enqueue()`` on a busy key starts ``pg_advisory_lock`` on the holder's
dedicated session, in a thread of its own: the statement waits in
PostgreSQL's own lock queue, which grants the key first come, first served,
so the place is held by the server while the caller does other work.
``Lock.wait(timeout)`` waits for that statement; on a timeout it cancels the
wait in the server, and a lock granted in the meantime is given back.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable

from django_dlock._threads import start_db_thread
from django_dlock.identity import Holder
from django_dlock.retry import Deadline
from django_dlock.strategies.advisory.acquire import AsyncWait, SessionAsyncAcquire
from django_dlock.strategies.base import Grant, Request, Strategy

#: longest a give-up waits for the cancelled statement to come back
GIVE_UP_SECONDS = 30.0
#: how often a give-up sends the cancel again while the statement still waits
CANCEL_AGAIN_SECONDS = 0.2
#: how often a place checks whether it is still wanted
WATCH_SECONDS = 0.25


def pending_capable(strategy: Strategy, vendor: str) -> SessionAsyncAcquire | None:
    """The PostgreSQL advisory implementation behind ``strategy``, if it is one."""
    from django_dlock.strategies.advisory.postgresql import AdvisoryStrategy

    return strategy if isinstance(strategy, AdvisoryStrategy) else None


class Pending:
    """A ``pg_advisory_lock`` waiting in PostgreSQL's queue for one holder.

    The place is kept while ``wanted()`` says so; a place nobody wants any
    more (see :func:`django_dlock.two_phase.enqueue`) is given up by a
    watcher thread: the wait is cancelled in the server, and a lock granted
    meanwhile, which nobody would ever release, is given back.
    """

    def __init__(
        self,
        strategy: SessionAsyncAcquire,
        req: Request,
        holder: Holder,
        wanted: Callable[[], bool],
    ) -> None:
        self.strategy = strategy
        self.req = req
        self.waiter = AsyncWait(place=True)
        self.future: concurrent.futures.Future[Grant | None] = concurrent.futures.Future()
        self._mutex = threading.Lock()
        #: "waiting", then "claimed" by wait(), "ended" once given up
        self._state = "waiting"
        self._settled = threading.Event()
        start_db_thread(lambda: self._run(holder), "django-dlock-pending")
        threading.Thread(
            target=self._watch, args=(wanted,), name="django-dlock-pending-watch", daemon=True
        ).start()

    def _watch(self, wanted: Callable[[], bool]) -> None:
        while not self._settled.wait(WATCH_SECONDS):
            if not wanted():
                self._end(("waiting",))
                return

    def _run(self, holder: Holder) -> None:
        try:
            result = self.strategy._acquire(self.req, Deadline(None), lambda: holder, self.waiter)
        except BaseException as exc:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def claim(self) -> bool:
        """``wait()`` takes the place; ``False`` if it was given up already."""
        with self._mutex:
            if self._state != "waiting":
                return False
            self._state = "claimed"
        self._settled.set()
        return True

    def wait(self, timeout: float | None) -> Grant | None:
        """The grant, or ``None`` after giving the place up at ``timeout``."""
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            self.give_up()
            return None

    def give_up(self) -> None:
        """Cancel the wait in the server; give back a lock granted meanwhile.

        Once per place: a later call does nothing.
        """
        self._end(("waiting", "claimed"))

    def _end(self, states: tuple[str, ...]) -> None:
        with self._mutex:
            if self._state not in states:
                return
            self._state = "ended"
        self._settled.set()
        # A cancel that reaches the server just before the statement does is
        # ignored there (nothing runs yet): sent again until the wait ends.
        give_up_at = time.monotonic() + GIVE_UP_SECONDS
        while True:
            self.waiter.cancel()
            try:
                grant = self.future.result(CANCEL_AGAIN_SECONDS)
            except concurrent.futures.TimeoutError:
                if time.monotonic() < give_up_at:
                    continue
                return
            except Exception:
                return
            break
        if grant is not None:  # granted just before the cancellation reached it
            self.strategy.release(self.req)
