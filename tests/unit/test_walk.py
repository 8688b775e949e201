"""The acquiring walk (all keys or none, in order, re-entry) against a strategy
kept in memory: no database, so these run in a second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.acquiring import Attempt
from django_dlock.conf import RetryInterval
from django_dlock.exceptions import DatabaseUnavailable, LockReentrantError
from django_dlock.identity import current_holder
from django_dlock.keys import Key, make_key
from django_dlock.options import Options
from django_dlock.retry import Deadline
from django_dlock.strategies.base import Grant, Request


class Refused(Exception):
    """What the in-memory strategy raises for a key it was told to fail on."""


@dataclass
class MemoryStrategy:
    """A strategy whose database is a dict: key name -> holder token."""

    name: str = "memory"
    family: str = "memory"
    transaction_scoped: bool = False
    leased: bool = False
    held: dict[str, str] = field(default_factory=dict)
    fences: int = 0
    #: every call, in order: ("acquire" | "release", key name)
    calls: list[tuple[str, str]] = field(default_factory=list)
    #: key names whose acquire raises :class:`Refused`
    failing: set[str] = field(default_factory=set)
    #: the database is away for this many more acquire calls (each raises
    #: DatabaseUnavailable, and so does a release meanwhile)
    away_for: int = 0
    #: keys whose acquire is answered by a database that is away
    away_keys: set[str] | None = None

    def ended(self, req: Request) -> bool:
        return False

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        pass

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        fence = self.try_acquire(req)
        return None if fence is None else Grant(fence)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        return self.acquire(req, deadline, policy)

    def try_acquire(self, req: Request) -> int | None:
        name = req.key.name
        self.calls.append(("acquire", name))
        if name in self.failing:
            raise Refused(name)
        if self.away_for and (self.away_keys is None or name in self.away_keys):
            self.away_for -= 1
            raise DatabaseUnavailable(f"database 'default' could not be reached ({name})")
        if self.held.get(name, req.token) != req.token:
            return None
        self.held[name] = req.token
        self.fences += 1
        return self.fences

    def release(self, req: Request) -> bool:
        self.calls.append(("release", req.key.name))
        if self.away_for:
            raise DatabaseUnavailable("database 'default' could not be reached")
        return self.held.pop(req.key.name, None) == req.token

    def extend(self, req: Request, ttl: float) -> bool:
        return self.owned(req)

    def locked(self, alias: str, key: Key) -> bool:
        return key.name in self.held

    def owned(self, req: Request) -> bool:
        return self.held.get(req.key.name) == req.token

    def loss_reason(self, req: Request) -> str | None:
        return None


@pytest.fixture
def memory() -> Iterator[MemoryStrategy]:
    strategy = MemoryStrategy()
    yield strategy
    holder = current_holder()
    for slot in [slot for slot in holder.holdings if slot[1] == "memory"]:
        del holder.holdings[slot]


def _options(strategy: MemoryStrategy, *names: str) -> Options:
    """What a lock on ``names`` hands down to the walk (keys sorted, as Lock sorts them)."""
    return Options(
        keys=tuple(sorted((make_key(name) for name in names), key=lambda key: key.name)),
        alias="default",
        strategy=strategy,
        strategy_name=strategy.name,
        quorum=None,
        ttl=30.0,
        max_hold=None,
        renew=False,
        reentrant=True,
        shared=False,
        upgradeable=False,
        hold_at_least=0.0,
        retry_interval=0.1,
        on_lost=None,
        signal_sender=Options,
        queues_waiters=False,
    )


def _walk(
    strategy: MemoryStrategy, *names: str, timeout: float | None = 0
) -> tuple[Attempt, Request | None]:
    opts = _options(strategy, *names)
    attempt = Attempt(opts, current_holder(), Deadline(timeout))
    return attempt, attempt.run(opts.keys)


def test_every_key_is_taken_in_sorted_order(memory):
    attempt, busy = _walk(memory, "b", "c", "a")
    assert busy is None
    assert memory.calls == [("acquire", "lock:a"), ("acquire", "lock:b"), ("acquire", "lock:c")]
    assert [key.name for key in attempt.taken] == ["lock:a", "lock:b", "lock:c"]


def test_a_busy_key_gives_back_what_was_taken_last_first(memory):
    memory.held["lock:c"] = "someone else"
    attempt, busy = _walk(memory, "a", "b", "c", "d")
    assert busy is not None and busy.key.name == "lock:c"
    assert memory.calls[-2:] == [("release", "lock:b"), ("release", "lock:a")]
    assert ("acquire", "lock:d") not in memory.calls  # the walk stops at the busy key
    assert memory.held == {"lock:c": "someone else"}
    assert attempt.taken == []


def test_an_error_gives_back_what_was_taken_and_is_raised(memory):
    memory.failing.add("lock:b")
    with pytest.raises(Refused):
        _walk(memory, "a", "b")
    assert memory.calls == [("acquire", "lock:a"), ("acquire", "lock:b"), ("release", "lock:a")]
    assert memory.held == {}


def test_a_key_the_holder_holds_is_re_entered_without_asking_again(memory):
    first, _ = _walk(memory, "a")
    second, busy = _walk(memory, "a", "b")
    assert busy is None
    assert memory.calls == [("acquire", "lock:a"), ("acquire", "lock:b")]
    second.undo()  # one level of "a", and "b"
    assert memory.held == {"lock:a": current_holder().token()}
    first.undo()
    assert memory.held == {}


def test_the_async_walk_is_the_same_walk(memory):
    memory.held["lock:b"] = "someone else"
    opts = _options(memory, "a", "b")

    async def walk() -> Request | None:
        return await Attempt(opts, current_holder(), Deadline(0)).arun(opts.keys)

    busy = asyncio.run(walk())
    assert busy is not None and busy.key.name == "lock:b"
    assert memory.calls == [("acquire", "lock:a"), ("acquire", "lock:b"), ("release", "lock:a")]


def test_a_holder_that_may_not_re_enter_is_refused_and_keeps_one_level(memory):
    first, _ = _walk(memory, "a")
    opts = _options(memory, "a")._replace(reentrant=False)
    with pytest.raises(LockReentrantError):
        Attempt(opts, current_holder(), Deadline(0)).run(opts.keys)
    holding = current_holder().holdings[("default", "memory", "lock:a")]
    assert holding.count == 1
    first.undo()
    assert memory.held == {}


# -- an acquire that starts while the database is away -------------------------


def test_an_acquire_with_a_timeout_rides_out_an_outage(memory):
    memory.away_for = 3
    attempt, busy = _walk(memory, "a", timeout=10)
    assert busy is None
    assert memory.calls == [("acquire", "lock:a")] * 4
    assert memory.held == {"lock:a": current_holder().token()}
    attempt.undo()


def test_a_try_once_raises_at_once(memory):
    memory.away_for = 3
    with pytest.raises(DatabaseUnavailable):
        _walk(memory, "a", timeout=0)
    assert memory.calls == [("acquire", "lock:a")]


def test_the_outage_error_is_raised_at_the_deadline(memory):
    memory.away_for = 10**6
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable):
        _walk(memory, "a", timeout=0.3)
    assert time.monotonic() - started >= 0.3
    # backing off: a few tries, not a busy loop
    assert 2 <= len(memory.calls) <= 8, memory.calls


def test_a_lock_of_the_callers_transaction_raises_at_once(memory):
    memory.transaction_scoped = True
    memory.away_for = 3
    with pytest.raises(DatabaseUnavailable):
        _walk(memory, "a", timeout=10)
    assert memory.calls == [("acquire", "lock:a")]


def test_an_outage_in_the_middle_of_a_walk_walks_every_key_again(memory):
    # "a" was taken before the database went away: it is given back (the
    # release fails too, and the holding is forgotten), and the walk starts
    # again from "a", so every key is taken after the outage.
    memory.away_keys = {"lock:b"}
    memory.away_for = 1
    attempt, busy = _walk(memory, "a", "b", timeout=10)
    assert busy is None
    assert memory.calls == [
        ("acquire", "lock:a"),
        ("acquire", "lock:b"),
        ("release", "lock:a"),
        ("acquire", "lock:a"),
        ("acquire", "lock:b"),
    ]
    assert [key.name for key in attempt.taken] == ["lock:a", "lock:b"]
    holding = current_holder().holdings[("default", "memory", "lock:a")]
    assert holding.count == 1
    attempt.undo()
    assert memory.held == {}


def test_keys_held_before_the_walk_stay_held_through_an_outage(memory):
    # wait() after enqueue(): the keys before the queued one were taken
    # earlier; an outage while taking the rest walks only the rest again.
    first, _ = _walk(memory, "a")
    memory.away_for = 1
    opts = _options(memory, "a", "b")
    attempt = Attempt(opts, current_holder(), Deadline(10), opts.keys[:1])
    assert attempt.run(opts.keys[1:]) is None
    assert memory.calls == [("acquire", "lock:a"), ("acquire", "lock:b"), ("acquire", "lock:b")]
    attempt.undo()
    assert memory.held == {}


def test_the_async_walk_rides_out_an_outage_too(memory):
    memory.away_for = 2
    opts = _options(memory, "a")

    async def walk() -> Request | None:
        attempt = Attempt(opts, current_holder(), Deadline(10))
        busy = await attempt.arun(opts.keys)
        assert memory.held == {"lock:a": current_holder().token()}
        await attempt.aundo()
        return busy

    assert asyncio.run(walk()) is None
    assert memory.calls == [("acquire", "lock:a")] * 3 + [("release", "lock:a")]
    assert memory.held == {}
