"""Tasks of tests/test_tasks_workers.py, run by real ``db_worker`` processes.

``DLOCK_TASKS_LOG`` names the file their runs append their lines to
(``start <key> <pid>``, ``end <key> <pid>``, ``inside <key> <n> <pid>``,
``OVERLAP ...``), one write per line on an ``O_APPEND`` file, so lines of
several processes never interleave. Skips are logged by a ``lock_skipped``
receiver (``skip <lock name> <pid>``).
"""

from __future__ import annotations

import fcntl
import os
import time
from typing import Any

from django.dispatch import receiver

from django_dlock import signals
from django_dlock.contrib.tasks import locked_task

#: the file every run, skip and overlap of this process is appended to
LOG = os.environ.get("DLOCK_TASKS_LOG", os.devnull)


def log(*words: object) -> None:
    line = " ".join(str(w) for w in (*words, os.getpid())) + "\n"
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@receiver(signals.lock_skipped)
def _skipped(sender: Any, name: str, **kwargs: Any) -> None:
    if str(kwargs.get("task", "")).startswith(__name__):
        log("skip", name)


class Inside:
    """Detects overlapping bodies across processes: a file only one body can create."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.path = f"{LOG}.{key}.inside"

    def __enter__(self) -> None:
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            log("OVERLAP", self.key)
            raise
        log("start", self.key)

    def __exit__(self, *exc: object) -> None:
        log("end", self.key)
        os.remove(self.path)


class Counted:
    """Counts bodies inside at once across processes (a file under flock)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.path = f"{LOG}.{key}.count"

    def _change(self, by: int) -> int:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            now = int(os.read(fd, 32) or b"0") + by
            os.lseek(fd, 0, os.SEEK_SET)
            os.ftruncate(fd, 0)
            os.write(fd, str(now).encode())
            return now
        finally:
            os.close(fd)

    def __enter__(self) -> None:
        log("inside", self.key, self._change(+1))

    def __exit__(self, *exc: object) -> None:
        self._change(-1)
        log("end", self.key)


@locked_task(key="exclusive:{key}", ttl=1)
def exclusive(key: str, seconds: float) -> str:
    """Skip mode; a 1 s lease, renewed while the body runs."""
    with Inside(key):
        time.sleep(seconds)
    return key


@locked_task(key="queued:{key}", on_busy="retry", retry_after=0.2, ttl=2)
def queued(key: str, seconds: float) -> str:
    with Inside(key):
        time.sleep(seconds)
    return key


@locked_task(key="limited:{key}", permits=2, on_busy="retry", retry_after=0.2, ttl=2)
def limited(key: str, seconds: float) -> str:
    with Counted(key):
        time.sleep(seconds)
    return key
