"""Mutual exclusion under load, per strategy: 8 processes x 250 iterations
spread over 1,000 keys (one hot key, 8 processes x 100 hand-overs nearly all
contended, is the contract suite's ``test_processes_exclude_each_other``, on
every strategy and database). Inside
the lock each process does a deliberately non-atomic read-modify-write of
the key's counter (a file per key): every counter must be exact. Each
holding also records (key, counter value, fence): per key, ordered by
counter value, the fencing numbers the protected resource sees must
strictly increase.
"""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
from django.db import transaction

import django_dlock as dlock

from . import procs

pytestmark = [pytest.mark.slow]

PROCESSES, KEYS, ITERATIONS = 8, 1000, 250

CASES = [
    pytest.param(
        strategy,
        alias,
        marks=pytest.mark.django_db(transaction=True, databases=sorted({"default", alias})),
        id=f"{strategy}-{alias}",
    )
    for strategy, alias in [
        ("lease", "default"),
        ("lease", "sqlite"),
        ("lease", "mysql"),
        ("advisory", "default"),
        ("advisory_xact", "default"),
        ("row", "default"),
    ]
]


def _worker(strategy: str, alias: str, keys: int, directory: str, seed: int) -> None:
    from django.conf import settings

    settings.DLOCK_ADVISORY_FENCING = True  # advisory locks issue fences too
    rng = random.Random(seed)
    transactional = strategy in ("advisory_xact", "row")
    with open(Path(directory) / f"log-{seed}", "w") as log:
        for _ in range(ITERATIONS):
            key = rng.randrange(keys)
            lk = dlock.lock(f"load:{key}", strategy=strategy, using=alias, timeout=300, ttl=60)
            if transactional:
                with transaction.atomic(using=alias), lk:
                    value = procs.FileCounter(str(Path(directory) / f"c{key}")).increment()
                    fence = lk.fence
            else:
                with lk:
                    value = procs.FileCounter(str(Path(directory) / f"c{key}")).increment()
                    fence = lk.fence
            log.write(f"{key} {value} {fence}\n")


def _check(directory: Path, keys: int) -> None:
    seen: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for log in directory.glob("log-*"):
        for line in log.read_text().splitlines():
            key, value, fence = (int(x) for x in line.split())
            seen[key].append((value, fence))
    assert sum(len(v) for v in seen.values()) == PROCESSES * ITERATIONS
    for key, holdings in seen.items():
        values = sorted(v for v, _ in holdings)
        assert values == list(range(1, len(values) + 1)), f"key {key}: lost updates"
        assert procs.FileCounter(str(directory / f"c{key}")).read() == len(values)
        fences = [f for _, f in sorted(holdings)]
        assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), f"key {key}"


@pytest.mark.parametrize(("strategy", "alias"), CASES)
def test_mutual_exclusion_under_load(strategy, alias, tmp_path):
    procs.run_all(_worker, [(strategy, alias, KEYS, str(tmp_path), i) for i in range(PROCESSES)])
    _check(tmp_path, KEYS)
