"""Who holds a lock: the worker identity and the per-thread / per-task holder.

* The **worker** is this process: host, pid and random bits. It is renewed in
  a child after ``fork`` so that two processes never share an identity.
* A **holder** is the current asyncio task if one is running in this thread,
  else the current thread. Two threads, or two tasks in one thread, are two
  holders and contend with each other.
* A holder's **token** (``<worker bits>-<holder bits>``) is what the database
  stores to say who owns a lease. The same holder always presents the same
  token; the token is random, so it cannot be guessed from the ``owner``
  text that the admin shows.

Each holder keeps its own re-entrancy table (``holder.holdings``): the locks
it holds, with their counts. The table dies with the thread or task. A
lower layer that finds a lock lost (the advisory session watcher) does not
touch the holding: it calls :meth:`Holder.report_lost`, which runs the
callback the holding's owner registered in ``holder.losses``.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_dlock.holdings import Holding


@dataclass
class Worker:
    """This process's identity."""

    host: str
    pid: int
    bits: str

    @property
    def label(self) -> str:
        return f"{self.host} pid={self.pid}"


def _new_worker() -> Worker:
    return Worker(host=socket.gethostname()[:100], pid=os.getpid(), bits=secrets.token_hex(8))


_worker = _new_worker()


def worker() -> Worker:
    """The identity of this process (renewed after ``fork``)."""
    return _worker


#: where a holder keeps one held key: (database alias, strategy family, key name)
Slot = tuple[str, str, str]


@dataclass(eq=False)
class Holder:
    """A thread or an asyncio task that can hold locks."""

    kind: str  # "thread" or "task"
    label: str
    bits: str = field(default_factory=lambda: secrets.token_hex(8))
    #: re-entrancy table: slot -> what is held there (see :mod:`django_dlock.holdings`)
    holdings: dict[Slot, Holding] = field(default_factory=dict)
    #: who hears that the database dropped the lock in a slot: registered by
    #: the front object (or the leader election) when it takes the lock
    losses: dict[Slot, Callable[[str], None]] = field(default_factory=dict)

    def report_lost(self, slot: Slot, reason: str) -> bool:
        """Tell whoever registered ``slot`` that its lock is lost; False if nobody did."""
        report = self.losses.get(slot)
        if report is None:
            return False
        report(reason)
        return True

    def token(self, worker_bits: str | None = None) -> str:
        return f"{worker_bits or _worker.bits}-{self.bits}"

    def owner(self, worker_label: str | None = None) -> str:
        return f"{worker_label or _worker.label} {self.kind}={self.label}"[:255]


_threads = threading.local()
_tasks: weakref.WeakKeyDictionary[asyncio.Task[Any], Holder] = weakref.WeakKeyDictionary()
_tasks_mutex = threading.Lock()


def current_task() -> asyncio.Task[Any] | None:
    # (``_get_running_loop`` answers None without raising: most callers run
    # in a thread without an event loop, and a raised error costs more)
    loop = asyncio._get_running_loop()
    if loop is None:
        return None
    return asyncio.current_task(loop)


def current_holder() -> Holder:
    """The holder for the calling context: its asyncio task, else its thread."""
    task = current_task()
    if task is not None:
        with _tasks_mutex:
            holder = _tasks.get(task)
            if holder is None:
                holder = Holder(kind="task", label=task.get_name())
                _tasks[task] = holder
        return holder
    holder = getattr(_threads, "holder", None)
    if holder is None:
        holder = Holder(kind="thread", label=threading.current_thread().name)
        _threads.holder = holder
    return holder


def holder_alive() -> Callable[[], bool]:
    """A cheap test of whether the calling thread or asyncio task still runs."""
    task = current_task()
    if task is not None:
        task_ref = weakref.ref(task)

        def task_alive() -> bool:
            found = task_ref()
            return found is not None and not found.done()

        return task_alive
    thread_ref = weakref.ref(threading.current_thread())

    def thread_alive() -> bool:
        found = thread_ref()
        return found is not None and found.is_alive()

    return thread_alive


def _after_fork_in_child() -> None:
    # A child must not inherit the parent's identity or believe it holds the
    # parent's locks.
    global _worker, _threads, _tasks, _tasks_mutex
    _worker = _new_worker()
    _threads = threading.local()
    _tasks = weakref.WeakKeyDictionary()
    _tasks_mutex = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
