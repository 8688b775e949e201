"""One call through a handful of files: the path of an uncontended ``with lock(...)``.

A newcomer follows ``with dlock.lock("k"): ...`` (``lease`` on PostgreSQL,
a new lock per call, as users write it) down through the package without
climbing back: each call goes to a module the caller builds on (imports),
or to what the caller was handed (a callback defined in a function, a
coroutine it drives).
These tests trace that call, warm, and pin both.
"""

from __future__ import annotations

import inspect
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import django_dlock as dlock
from django_dlock.strategies.connection import close_private_connections

from .unit.test_layers import MODULES, imports

pytestmark = pytest.mark.django_db(transaction=True, databases=["default"])

PACKAGE = Path(dlock.__file__).resolve().parent
BY_PATH = {str(path.resolve()): name for name, path in MODULES.items()}

#: at most this many package files run for one uncontended lock and release
MAX_FILES = 13


@pytest.fixture
def quiet_logger() -> Iterator[None]:
    # as in a project that leaves django_dlock's logger at its default level
    logger = logging.getLogger("django_dlock")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)
    close_private_connections()


def _above(module: str) -> set[str]:
    """The package modules that build on ``module`` (import it), however high."""
    users: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for found in imports(name, runtime=False):
            users[found].add(name)
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in users[todo.pop()]:
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def _trace() -> list[tuple[str | None, str, Any]]:
    """(caller module or None, callee module, callee code) of every package call."""
    calls: list[tuple[str | None, str, Any]] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee = BY_PATH.get(frame.f_code.co_filename)
        if callee is None:
            return
        back = frame.f_back
        caller = None if back is None else BY_PATH.get(back.f_code.co_filename)
        calls.append((caller, callee, frame.f_code))

    for _ in range(3):  # warm: keys, strategies and statements prepared
        with dlock.lock("call-path"):
            pass
    sys.setprofile(profile)
    try:
        with dlock.lock("call-path"):
            pass
    finally:
        sys.setprofile(None)
    return calls


def test_an_uncontended_lock_runs_in_a_handful_of_files(quiet_logger):
    files = sorted({callee for _, callee, _ in _trace()})
    assert "django_dlock.locks" in files and "django_dlock.strategies.connection" in files
    assert len(files) <= MAX_FILES, ", ".join(files)


def test_an_uncontended_lock_never_climbs_back_up(quiet_logger):
    climbs = set()
    for caller, callee, code in _trace():
        if caller is None or caller == callee:
            continue
        # a callback, or a coroutine handed to a runner that drives it
        handed_down = bool(code.co_flags & (inspect.CO_NESTED | inspect.CO_COROUTINE))
        if callee in _above(caller) and not handed_down:
            climbs.add(f"{caller} -> {callee}.{code.co_name}")
    assert sorted(climbs) == [], "\n".join(sorted(climbs))
