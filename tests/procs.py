"""Real OS processes for concurrency and fault tests.

Children are started with the ``spawn`` method (a fresh interpreter, never a
fork of a process that has database connections and threads), set up Django
on the *test* databases and run a module-level function.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any


def _bootstrap(func: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.environ["DLOCK_TEST_CHILD"] = "1"
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.db import connections

    try:
        func(*args)
    finally:
        connections.close_all()


def start(func: Callable[..., Any], *args: Any) -> multiprocessing.process.BaseProcess:
    """Start ``func(*args)`` in a new process (not joined)."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_bootstrap, args=(func, args), daemon=True)
    proc.start()
    return proc


def run_all(
    func: Callable[..., Any], arg_lists: list[tuple[Any, ...]], timeout: float = 300
) -> None:
    """Run ``func(*args)`` in one process per entry; fail if any fails."""
    procs = [start(func, *args) for args in arg_lists]
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            raise AssertionError(f"worker {proc.pid} did not finish within {timeout}s")
        assert proc.exitcode == 0, f"worker {proc.pid} exited with {proc.exitcode}"


class FileCounter:
    """A counter in a file, updated by a deliberately non-atomic read-modify-write."""

    def __init__(self, path: str) -> None:
        self.path = path

    def reset(self) -> None:
        with open(self.path, "w") as f:
            f.write("0")

    def read(self) -> int:
        try:
            with open(self.path) as f:
                return int(f.read() or 0)
        except FileNotFoundError:
            return 0

    def increment(self, pause: float = 0.0) -> int:
        import time

        value = self.read()
        if pause:
            time.sleep(pause)
        with open(self.path, "w") as f:
            f.write(str(value + 1))
            f.flush()
        return value + 1
