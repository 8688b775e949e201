"""Background renewal of a lease, and loss detection.

A :class:`Renewer` is a daemon thread that calls ``extend`` about every
``ttl / 3`` seconds. ``max_hold`` bounds the whole holding: the renewer
shortens the last renewals so the lease ends ``max_hold`` seconds after it
was acquired, then stops. (The expiry itself is always computed by the
database, ``now() + ttl``; the renewer only counts elapsed seconds.)

The renewer stops, without a word to the database, when its holder (the
thread or asyncio task that acquired the lock) is gone without releasing:
it logs a warning naming the lock, and the lease then runs out on its own
within its TTL.

When ``extend`` reports that the caller no longer owns the lease (taken over,
force-released or run out), the lock is lost at once. When ``extend`` raises (the
database is unreachable), the renewer retries quickly until the lease would
have run out, then declares the lock lost. When ``extend`` does not answer at
all (a server that stopped answering, a network that drops packets), the
lock is lost when the lease would have run out: each renewal runs on a
worker thread of the renewer, which waits for it only until then. "Would
have run out" is measured on this process's monotonic clock from the moment
the last successful statement was *sent* (the statement that granted the
lease, then each renewal; for a waiter, its last try, not its first):
the database stamped that lease at or after then, so it cannot have lasted
longer. Either way ``on_lost(reason)`` is called once, from the renewer's
thread. The worker closes its database connection when the renewer ends,
and the renewer keeps any unexpected exception for :meth:`stop` to re-raise.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from django_dlock._threads import close_thread_connections

logger = logging.getLogger("django_dlock")


class Renewer(threading.Thread):
    #: the reason given to ``on_lost`` when the database refused a renewal
    REFUSED = "the renewal was refused: the lease is no longer ours"

    def __init__(
        self,
        *,
        name: str,
        alias: str,
        ttl: float,
        extend: Callable[[float], bool],
        on_lost: Callable[[str], None],
        max_hold: float | None = None,
        interval: float | None = None,
        holder_alive: Callable[[], bool] | None = None,
        lease_end: float | None = None,
    ) -> None:
        super().__init__(name=f"django-dlock-renew {name}", daemon=True)
        self.alias = alias
        self.ttl = ttl
        self.extend = extend
        self.on_lost = on_lost
        self.interval = interval if interval is not None else ttl / 3.0
        self.started_at = time.monotonic()
        self.hold_until = None if max_hold is None else self.started_at + max_hold
        self.renewals = 0
        self.holder_alive = holder_alive
        self.lock_name = name
        #: monotonic time the lease surely lasts until (the acquire's send time + ttl)
        self.lease_end = self.started_at + ttl if lease_end is None else lease_end
        self._halt = threading.Event()
        self._error: BaseException | None = None
        self._worker = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=f"django-dlock-renew-sql {name}"
        )

    def halt(self) -> None:
        """Stop renewing soon, without waiting for the thread."""
        self._halt.set()

    def stop(self) -> None:
        """Stop renewing and wait for the thread; re-raise what it caught."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # kept for stop() to re-raise
            self._error = exc
        finally:
            # after a renewal still stuck on a server that stopped answering, if any
            self._worker.submit(close_thread_connections, self.alias)
            self._worker.shutdown(wait=False)

    def _extend(self, ttl: float, until: float) -> bool:
        """``extend(ttl)`` on the worker thread, waiting for it at most ``until``.

        Raises:
            TimeoutError: no answer by then.
        """
        future = self._worker.submit(self.extend, ttl)
        try:
            return future.result(max(0.0, until - time.monotonic()))
        except concurrent.futures.TimeoutError:
            raise TimeoutError("the database did not answer") from None

    def _loop(self) -> None:
        lease_end = self.lease_end
        wait = min(self.interval, max(0.0, lease_end - time.monotonic()))
        while not self._halt.wait(wait):
            if self.holder_alive is not None and not self.holder_alive():
                logger.warning(
                    "django-dlock: the holder of %s ended without releasing it; renewal "
                    "stopped, the lease runs out within its ttl",
                    self.lock_name,
                )
                return
            now = time.monotonic()
            ttl = self.ttl
            if self.hold_until is not None:
                ttl = min(ttl, self.hold_until - now)
                if ttl <= 0:
                    return  # max_hold reached: let the lease run out
            try:
                still_owned = self._extend(ttl, lease_end)
            except TimeoutError:
                self.on_lost(
                    "no renewal reached the database before the lease ran out (on this "
                    "process's clock, from when the last renewal was sent)"
                )
                return
            except Exception as exc:
                if time.monotonic() >= lease_end:
                    self.on_lost(f"renewal failed until the lease ran out: {exc}")
                    return
                logger.warning("django-dlock: renewal of %s failed, retrying: %s", self.name, exc)
                wait = min(self.interval, max(0.05, (lease_end - time.monotonic()) / 4))
                continue
            if not still_owned:
                self.on_lost(self.REFUSED)
                return
            self.renewals += 1
            lease_end = now + ttl
            wait = self.interval
