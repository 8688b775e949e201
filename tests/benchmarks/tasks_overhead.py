"""Cost of ``locked_task``: a body called plain, under a bare lock pair, and as a locked task.

``python -m tests.benchmarks.tasks_overhead [--rounds 21] [--seconds 0.5]``

* **body**: ``Task.call()`` of a plain ``@task`` (the framework's own call of
  the function, what a worker does once it has the run);
* **pair**: the same body inside ``with dlock.lock(key, timeout=0, ttl=60,
  renew=True)``, the one pair of lock statements a locked run adds;
* **pair, no renewal**: the same without ``renew=True`` (what the renewer's
  start and stop cost);
* **locked_task**: ``Task.call()`` of the same function under
  ``@locked_task(key="bench-tasks:{n}", ttl=60)``: the key built from the
  arguments, the holder's text, the pair, the renewer.

Rounds are interleaved (body, pair, locked_task, body, ...) and the report
gives the median time per call and the median of the same round's ratios.
On PostgreSQL (a database of its own, suffixed with ``DLOCK_TEST_DB_SUFFIX``).
The worker's own cost per run (claiming the run, saving its result) is not
in any of them. Not part of the test run.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.metrics_settings")


def body(n: int) -> int:
    return n


def contenders() -> dict[str, tuple[Callable[[], None], Any]]:
    import django_dlock as dlock
    from django_dlock.contrib.tasks import framework_task, locked_task

    def locked_body(n: int) -> int:
        return n

    locked_body.__qualname__ = "locked_body"  # a module-level function, for the framework
    plain = framework_task(body, backend="immediate")
    locked = locked_task(key="bench-tasks:{n}", ttl=60, backend="immediate")(locked_body)

    def run_body() -> None:
        plain.call(1)

    def run_pair() -> None:
        with dlock.lock("bench-tasks:1", timeout=0, ttl=60, renew=True):
            plain.call(1)

    def run_pair_no_renewal() -> None:
        with dlock.lock("bench-tasks:1", timeout=0, ttl=60):
            plain.call(1)

    def run_locked() -> None:
        assert locked.call(1) == 1

    return {
        "body": (run_body, None),
        "pair": (run_pair, None),
        "pair, no renewal": (run_pair_no_renewal, None),
        "locked_task": (run_locked, None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.tasks_overhead")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)

    from .common import ensure_databases, measure_in_turn, setup_django

    setup_django()
    ensure_databases()
    rates = measure_in_turn(contenders(), args.rounds, args.seconds)

    def us(name: str) -> float:
        return 1e6 / statistics.median(rates[name])

    def paired(a: str, b: str) -> float:  # time of a / time of b, per round
        return statistics.median(y / x for x, y in zip(rates[a], rates[b], strict=True))

    print("| call | µs per call (median) | vs the bare pair |")
    print("| --- | ---: | ---: |")
    print(f"| the body, `Task.call()` of a plain `@task` | {us('body'):,.1f} | |")
    print(f"| the body in `with dlock.lock(key, renew=True)` | {us('pair'):,.0f} | 1.00x |")
    print(
        f"| the same without `renew=True` | {us('pair, no renewal'):,.0f} "
        f"| {paired('pair, no renewal', 'pair'):.2f}x |"
    )
    print(
        f"| `Task.call()` of a `@locked_task` | {us('locked_task'):,.0f} "
        f"| {paired('locked_task', 'pair'):.2f}x |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
