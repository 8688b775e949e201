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
import contextlib
import functools
import logging
import os
import secrets
import socket
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django_dlock.holdings import Holding


logger = logging.getLogger("django_dlock")


@dataclass
class Worker:
    """This process's identity."""

    host: str
    pid: int
    bits: str
    #: what this process runs, when it is a management command ("manage.py migrate")
    program: str = ""

    @functools.cached_property
    def label(self) -> str:
        """``host pid=N`` and the program (kept: asked for every lock taken)."""
        label = f"{self.host} pid={self.pid}"
        return f"{label} {self.program}" if self.program else label


def _program() -> str:
    """``manage.py <command>`` (or ``django-admin <command>``) for a management
    command's process; empty otherwise."""
    argv = sys.argv
    name = os.path.basename(argv[0]) if argv else ""
    if name in ("manage.py", "django-admin") and len(argv) > 1:
        return f"{name} {argv[1]}"[:60]
    return ""


def _new_worker() -> Worker:
    return Worker(
        host=socket.gethostname()[:100],
        pid=os.getpid(),
        bits=secrets.token_hex(8),
        program=_program(),
    )


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
        """Who holds, as the admin and ``dlock_list`` show it: the process, the
        thread or task, what it is doing (a request, a Celery task, a job) and
        what ``DLOCK_HOLDER_INFO`` adds. Never the token."""
        text = f"{worker_label or _worker.label} {self.kind}={self.label}"
        what = _DOING.get()
        if what is not None:
            text = f"{text} ({what})"
        if _info_hook is not None:
            added = _holder_info()
            if added:
                text = f"{text} {added}"
        return text[:255]


#: what the current thread or task is doing (a request, a task, a job): part
#: of the owner text of the locks it takes meanwhile
_DOING: ContextVar[str | None] = ContextVar("django_dlock_doing", default=None)


def what_it_is_doing() -> str | None:
    """What the current thread or task said it is doing (see :func:`doing`)."""
    return _DOING.get()


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """Within the block, locks taken by this thread or task say ``what`` it is
    doing in their owner text (``POST /invoice/42/``, a Celery task, a job)."""
    token = _DOING.set(what[:120])
    try:
        yield
    finally:
        _DOING.reset(token)


#: DLOCK_HOLDER_INFO, imported: a function () -> str | None (None: not set)
_info_hook: Callable[[], object] | None = None


def holder_info_hook(value: object) -> Callable[[], object] | None:
    """``DLOCK_HOLDER_INFO``'s function: the setting itself if callable, else
    the function its dotted path names (``None``: not set).

    Raises:
        ImportError: the path names nothing importable (check dlock.E042).
        TypeError: it names something that cannot be called.
    """
    from django.utils.module_loading import import_string

    if value is None:
        return None
    found = value if callable(value) else import_string(str(value))
    if not callable(found):
        raise TypeError(f"DLOCK_HOLDER_INFO names {value!r}, which is not a function")
    return found


def load_holder_info(**_: object) -> None:
    """Read ``DLOCK_HOLDER_INFO``: a function (or its dotted path) called with no
    arguments whose text is added to the owner of every lock this process
    takes. At start-up and when the setting changes; a bad value is reported
    by the system check dlock.E042, and leaves the owner text without it."""
    global _info_hook
    from django.conf import settings

    try:
        _info_hook = holder_info_hook(getattr(settings, "DLOCK_HOLDER_INFO", None))
    except (ImportError, TypeError):
        _info_hook = None


def _holder_info() -> str:
    hook = _info_hook
    if hook is None:
        return ""
    try:
        found = hook()
    except Exception:
        logger.exception("django-dlock: DLOCK_HOLDER_INFO raised; the owner text goes without it")
        return ""
    return "" if found is None else str(found)


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
    # (current_task, inline: asked for every acquire and release)
    loop = asyncio._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
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
