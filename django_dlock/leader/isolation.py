"""``LeaderElection.run(target, isolate=True)``: the target in a child process.

Both sides: :func:`run_isolated` (the leader's process: start the child,
send it each new deadline, stop it when the term is lost) and
:func:`_isolated_main` (the child: set Django up, run the target, answer).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import connections

from django_dlock.exceptions import DLockError
from django_dlock.leader.leadership import Leadership, _current, _now

__all__ = ["TargetDied", "run_isolated"]

logger = logging.getLogger("django_dlock")

T = TypeVar("T")


class TargetDied(DLockError):
    """An isolated target's process ended without returning (killed, crashed)."""


def _stop_process(process: Any, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    process.terminate()
    process.join(grace)
    if process.is_alive():
        process.kill()
        process.join()


class _ChildLeadership(Leadership):
    """The term as the isolated child sees it: the leader sends each new deadline.

    A thread reads the leader's messages; but a target that holds the GIL
    keeps that thread from running, so before a deadline is declared passed,
    the messages that are waiting are read first: a term the leader has
    renewed meanwhile is not mistaken for an ended one.
    """

    def __init__(self, conn: Any, name: str, term: int, identity: str) -> None:
        super().__init__(name, term, identity)
        self._conn = conn
        self._reading = threading.Lock()

    def _expired(self) -> bool:
        if _now() < self._valid_until:
            return False
        self._drain()
        return _now() >= self._valid_until

    def _drain(self) -> bool:
        """Read the waiting messages; False once the leader process is gone."""
        with self._reading:
            try:
                while self._conn.poll():
                    kind, value = self._conn.recv()
                    if kind == "until":
                        self._valid_until = value
                    elif kind == "end":
                        self._end(value)
            except (EOFError, OSError):
                self._end("lost: the leader process is gone")
                return False
        return True

    def _listen(self) -> None:
        with contextlib.suppress(OSError):
            while self._drain():
                self._conn.poll(None)
        # The leader process is gone: nobody renews this term any more.
        os._exit(70)


def _die_with_the_leader() -> None:
    """End this child when the leader process dies, even a SIGKILLed one.

    The child's listening thread notices a dead leader, but a target that
    holds the GIL keeps that thread from running, and the target would go on
    while a standby has taken over. On Linux the kernel kills the child
    instead (``PR_SET_PDEATHSIG``); elsewhere only the listening thread is
    there.
    """
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(70)  # the leader died before the kernel was told


def _isolated_main(
    conn: Any,
    settings_module: str,
    target: Callable[[Leadership], Any],
    term: tuple[str, int, str],
    valid_until: float,
) -> None:
    """The child process of :meth:`LeaderElection.run` with ``isolate=True``."""
    _die_with_the_leader()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader handles Ctrl-C
    if settings_module:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    import django

    django.setup()
    leadership = _ChildLeadership(conn, *term)
    leadership._valid_until = valid_until
    threading.Thread(
        target=leadership._listen, name="django-dlock-isolated-listen", daemon=True
    ).start()
    _current.set(leadership)
    try:
        answer: tuple[str, Any] = ("returned", target(leadership))
    except BaseException as exc:
        answer = ("raised", exc)
    finally:
        connections.close_all()
    try:
        conn.send(answer)
    except Exception as exc:  # the value or the exception cannot be pickled
        conn.send(("raised", TargetDied(f"the isolated target's answer cannot be sent: {exc!r}")))
    conn.close()


def run_isolated(
    target: Callable[[Leadership], T], leadership: Leadership, name: str, grace: float
) -> T:
    """Run ``target`` for ``leadership`` in a child process (the leader's side).

    The child gets each new deadline and, on a graceful stop, the request to
    finish; when the term is lost it is stopped (SIGTERM, then SIGKILL after
    ``grace`` seconds).
    """
    import multiprocessing.connection

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(
        target=_isolated_main,
        args=(
            theirs,
            os.environ.get("DJANGO_SETTINGS_MODULE", ""),
            target,
            (leadership.name, leadership.term, leadership.identity),
            leadership._valid_until,
        ),
        name=f"django-dlock-isolated {name}",
        daemon=True,
    )
    child.start()
    theirs.close()
    sent_until = leadership._valid_until
    told_to_finish = False
    try:
        while True:
            ready = multiprocessing.connection.wait([ours, child.sentinel], timeout=0.05)
            if ours in ready:
                try:
                    kind, value = ours.recv()
                except (EOFError, OSError):
                    kind, value = "died", None
                if kind == "returned":
                    result: T = value
                    return result
                if kind == "raised":
                    assert isinstance(value, BaseException)
                    raise value
            elif child.sentinel in ready and not ours.poll():
                kind = "died"
            else:
                kind = ""
            if kind == "died":
                child.join(grace)
                if leadership.ended:
                    leadership.check()
                raise TargetDied(
                    f"the isolated target of {name!r} (pid {child.pid}) ended "
                    f"without an answer (exit code {child.exitcode})"
                )
            if leadership.ended and not leadership.stepping_down:
                logger.warning(
                    "django-dlock: %s: term %s is over; stopping its isolated target (pid %s)",
                    name,
                    leadership.term,
                    child.pid,
                )
                _stop_process(child, grace)
                leadership.check()
            with contextlib.suppress(OSError):
                if leadership._valid_until != sent_until:
                    sent_until = leadership._valid_until
                    ours.send(("until", sent_until))
                if leadership.stepping_down and not told_to_finish:
                    told_to_finish = True
                    ours.send(("end", leadership.reason))
    finally:
        ours.close()
        if child.is_alive():
            _stop_process(child, grace)
