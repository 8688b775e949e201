"""``LeaderElection.run(target, isolate=True)``: the target in a child process."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from django.db import connections

from django_dlock.exceptions import DLockError
from django_dlock.leader.leadership import Leadership, _current

__all__ = ["TargetDied"]


class TargetDied(DLockError):
    """An isolated target's process ended without returning (killed, crashed)."""


def _stop_process(process: Any, grace: float) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    process.terminate()
    process.join(grace)
    if process.is_alive():
        process.kill()
        process.join()


def _isolated_main(
    conn: Any,
    settings_module: str,
    target: Callable[[Leadership], Any],
    term: tuple[str, int, str],
    valid_until: float,
) -> None:
    """The child process of :meth:`LeaderElection.run` with ``isolate=True``."""
    import os

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader handles Ctrl-C
    if settings_module:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    import django

    django.setup()
    leadership = Leadership(*term)
    leadership._valid_until = valid_until

    def listen() -> None:
        try:
            while True:
                kind, value = conn.recv()
                if kind == "until":
                    leadership._valid_until = value
                elif kind == "end":
                    leadership._end(value)
        except (EOFError, OSError):
            # The leader process is gone: nobody renews this term any more.
            os._exit(70)

    threading.Thread(target=listen, name="django-dlock-isolated-listen", daemon=True).start()
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
