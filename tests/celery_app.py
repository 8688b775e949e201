"""The Celery app of tests/test_celery.py, run by real ``celery worker`` / ``celery beat``.

Its environment (set by the test): ``DLOCK_CELERY_QUEUE`` (a queue of this
test run only), ``DLOCK_CELERY_LOG`` (the file every task run, skip, retry
and failure is appended to), ``DLOCK_TEST_CHILD=1`` (the test databases),
``DLOCK_CELERY_BEAT_EVERY`` (seconds: beat sends ``digest`` that often).
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ["DLOCK_TEST_CHILD"] = "1"

import django  # noqa: E402
from django.apps import apps  # noqa: E402
from django.dispatch import receiver  # noqa: E402

if not apps.ready:
    django.setup()

from celery import Celery, signals  # noqa: E402
from kombu import Exchange, Queue  # noqa: E402

from django_dlock import signals as dlock_signals  # noqa: E402
from django_dlock.contrib.celery import SingleInstanceTask  # noqa: E402

QUEUE = os.environ.get("DLOCK_CELERY_QUEUE", "dlock-test")
LOG = os.environ.get("DLOCK_CELERY_LOG", os.devnull)

app = Celery("tests.celery_app", broker="amqp://guest:guest@127.0.0.1:5672//")
app.conf.update(
    task_queues=[Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE, auto_delete=True)],
    task_default_queue=QUEUE,
    task_default_exchange=QUEUE,
    task_default_routing_key=QUEUE,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
if os.environ.get("DLOCK_CELERY_BEAT_EVERY"):
    app.conf.beat_schedule = {
        "digest": {
            "task": "tests.celery_app.digest",
            "schedule": float(os.environ["DLOCK_CELERY_BEAT_EVERY"]),
            "options": {"queue": QUEUE},
        }
    }


def log(*words: object) -> None:
    """Append one line (one write on an O_APPEND file: lines never interleave)."""
    line = " ".join(str(w) for w in (*words, os.getpid())) + "\n"
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class Inside:
    """Detects overlapping runs across processes: a file only one run can create."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.path = f"{LOG}.{key}.inside"

    def __enter__(self) -> None:
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            log("OVERLAP", self.path)
            raise
        log("start", self.key)

    def __exit__(self, *exc: object) -> None:
        log("end", self.key)
        os.remove(self.path)


class Counted:
    """Counts runs inside at once across processes (a file under flock); logs
    ``inside <key> <n>`` as each run starts."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.path = f"{LOG}.{key}.count"

    def _change(self, by: int) -> int:
        import fcntl

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


@app.task(base=SingleInstanceTask, lock_args=["key"], lock_permits=2)
def limited(key: str, seconds: float) -> str:
    with Counted(key):
        time.sleep(seconds)
    return key


@app.task(base=SingleInstanceTask, lock_args=["key"])
def exclusive(key: str, seconds: float) -> str:
    with Inside(key):
        time.sleep(seconds)
    return key


@app.task(
    base=SingleInstanceTask,
    lock_args=["key"],
    on_locked="retry",
    lock_retry_countdown=0.2,
    max_retries=200,
)
def exclusive_retry(key: str, seconds: float) -> str:
    with Inside(key):
        time.sleep(seconds)
    return key


@app.task(base=SingleInstanceTask, lock_args=["key"], lock_ttl=1.0)
def slow(key: str, seconds: float) -> str:
    """Runs longer than its 1 s lease: the renewal must keep it."""
    with Inside(key):
        for step in range(int(seconds / 0.5)):
            time.sleep(0.5)
            log("step", step)
    return key


@app.task(base=SingleInstanceTask, lock_args=["key"], lock_ttl=5.0, acks_late=True)
def late(key: str) -> str:
    """Acknowledged after it ran; runs while the file ``<LOG>.<key>.hold`` exists."""
    with Inside(key):
        step = 0
        while os.path.exists(f"{LOG}.{key}.hold"):
            time.sleep(0.2)
            log("step", key, step)
            step += 1
    return key


@app.task(base=SingleInstanceTask, lock_args=["key", "n"])
def pair(key: object, n: object) -> None:
    """Logs its arguments, then runs while the file ``<LOG>.pair.hold`` exists."""
    log("pair", json.dumps([key, n], separators=(",", ":")))
    while os.path.exists(f"{LOG}.pair.hold"):
        time.sleep(0.1)


@app.task(base=SingleInstanceTask, once_per=600)
def digest() -> None:
    with Inside("digest"):
        time.sleep(0.2)


@receiver(dlock_signals.lock_skipped)
def _skipped(sender: object, name: str, **kwargs: object) -> None:
    log("skip", name)


@signals.task_retry.connect
def _retry(request: object = None, **kwargs: object) -> None:
    log("retry")


@signals.task_failure.connect
def _failure(exception: object = None, **kwargs: object) -> None:
    log("failure", type(exception).__name__)


@signals.worker_ready.connect
def _ready(**kwargs: object) -> None:
    log("ready")


@signals.beat_init.connect
def _beat(**kwargs: object) -> None:
    log("beat")
