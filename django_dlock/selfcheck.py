"""``manage.py dlock_selfcheck``: does locking work on this deployment?

Runs against the configured database, through whatever pooler the settings
name, with real processes:

1. **one lock, here**: an acquire and a release in this process. A strategy
   the database (or its pooler) cannot do fails here, with the library's own
   error, and nothing else runs;
   **sessions** (PostgreSQL ``advisory``): whether a pooler in between shares
   one server session among clients (transaction mode), which would let one
   client's lock be another's;
   **replication** (PostgreSQL): whether the standbys streaming from this
   server are synchronous. With asynchronous replication a fail-over can
   lose the last lease writes, and fencing numbers stay increasing across a
   promotion only while the members' clocks agree; a standby whose clock
   is seen to differ is named;
2. **wake-ups** (PostgreSQL): whether waiters can be woken by ``NOTIFY``
   (a transaction-mode pooler cannot deliver it: waiters then poll);
3. **mutual exclusion**: N processes take one key for S seconds, each doing
   a deliberately non-atomic read-modify-write of a counter inside: any
   overlap loses an update, so the count must equal the acquisitions, and the
   fencing numbers must increase in the order of the counter;
4. **hand-off**: acquisitions per second and how long an acquire waited.

Each check ends with PASS, WARN or FAIL; a FAIL makes the command exit with
status 1.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Verdict", "selfcheck"]

#: seconds the wake-ups check waits for a notification to come back
WAKE_UP_WAIT = 10.0


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: ``PASS``, ``WARN`` or ``FAIL``, and what was seen."""

    check: str
    result: str
    detail: str


def _bootstrap(settings_module: str | None, args: tuple[Any, ...]) -> None:
    if settings_module:
        os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    import django

    django.setup()
    from django.db import connections

    try:
        _work(*args)
    finally:
        connections.close_all()


def _work(alias: str, strategy: str, seconds: float, key: str, counter: str, log: str) -> None:
    """One process: take ``key`` again and again for ``seconds``; inside, add one
    to the counter file by a read, a pause and a write."""
    from django.db import transaction

    import django_dlock as dlock
    from django_dlock.strategies import traits

    in_transaction = traits(strategy)[1]
    end = time.monotonic() + seconds
    with open(log, "w") as out:
        while time.monotonic() < end:
            started = time.monotonic()
            scope = transaction.atomic(using=alias) if in_transaction else contextlib.nullcontext()
            with scope, dlock.lock(key, strategy=strategy, using=alias, ttl=60, timeout=60) as lk:
                waited = time.monotonic() - started
                value = int(Path(counter).read_text() or 0) + 1
                time.sleep(0.001)
                Path(counter).write_text(str(value))
                out.write(f"{value} {lk.fence} {waited:.6f}\n")


def selfcheck(alias: str, strategy: str, processes: int, seconds: float) -> list[Verdict]:
    """Run the checks (module docstring) and return their verdicts."""
    verdicts = [_one_lock(alias, strategy)]
    if verdicts[0].result == "FAIL":
        return verdicts
    sessions = _sessions(alias, strategy)
    if sessions is not None:
        verdicts.append(sessions)
        if sessions.result == "FAIL":
            return verdicts
    replication = _replication(alias)
    if replication is not None:
        verdicts.append(replication)
    verdicts.append(_wake_ups(alias, strategy))
    verdicts.extend(_processes(alias, strategy, processes, seconds))
    return verdicts


def _one_lock(alias: str, strategy: str) -> Verdict:
    from django.db import transaction

    import django_dlock as dlock
    from django_dlock.strategies import traits

    key = f"dlock-selfcheck:{uuid.uuid4().hex[:12]}"
    try:
        in_transaction = traits(strategy)[1]
        scope = transaction.atomic(using=alias) if in_transaction else contextlib.nullcontext()
        with scope, dlock.lock(key, strategy=strategy, using=alias, timeout=10) as lk:
            fence = lk.fence
    except Exception as exc:  # the library's error says what is wrong
        return Verdict("one lock, here", "FAIL", f"{type(exc).__name__}: {exc}")
    return Verdict("one lock, here", "PASS", f"acquired and released (fence {fence})")


def _sessions(alias: str, strategy: str) -> Verdict | None:
    """PostgreSQL ``advisory`` locks live in a server session: a pooler that hands
    one server session to several clients (transaction or statement mode) would
    let one client's lock be another's. Two clients connect; while the first
    is connected, the second asks for its server session's pid. Only a pooler
    that shares sessions can give it the first one's."""
    from django.db import connections

    from django_dlock.strategies import implementation
    from django_dlock.strategies.connection import behind_pooler

    connection = connections[alias]
    if connection.vendor != "postgresql":
        return None
    found = implementation(strategy, connection.vendor)
    if found.leased or found.transaction_scoped:
        return None  # not a lock kept by a session of its own
    if not behind_pooler(connection):
        return Verdict("sessions", "PASS", "a direct connection: a session of its own per client")
    params = connection.get_connection_params()
    first = connection.get_new_connection(params)
    second = connection.get_new_connection(params)
    try:
        pids = []
        for raw in (first, second):
            raw.autocommit = True
            with raw.cursor() as cur:
                cur.execute("SELECT pg_backend_pid()")
                pids.append(int(cur.fetchone()[0]))
    finally:
        first.close()
        second.close()
    if pids[0] == pids[1]:
        return Verdict(
            "sessions",
            "FAIL",
            "this pooler hands one server session to several clients (transaction mode): "
            "advisory locks would leak between them. Use the lease strategy, a pooler in "
            "session mode, or a direct connection",
        )
    return Verdict("sessions", "PASS", "behind a pooler that keeps a session per client")


#: seconds a standby's clock may differ from the primary's before it is named
#: (its reply time is up to ``wal_receiver_status_interval`` old)
CLOCK_SLACK = 1.0


def _replication(alias: str) -> Verdict | None:
    """PostgreSQL: what a fail-over to one of this server's standbys keeps.

    Reads ``pg_stat_replication`` (every role sees its rows; without
    ``pg_read_all_stats`` some columns are empty) and the server's
    ``synchronous_commit``. A standby's ``reply_time`` is its own clock when
    it last answered: later than the primary's ``now()`` means a clock ahead;
    older than the reply interval allows means a clock behind (or a standby
    that stopped answering)."""
    from django.db import connections

    from django_dlock.strategies.connection import cursor

    connection = connections[alias]
    if connection.vendor != "postgresql":
        return None
    with cursor(connection) as cur:
        cur.execute(
            "SELECT pg_is_in_recovery(), current_setting('synchronous_commit'), "
            "current_setting('wal_receiver_status_interval')"
        )
        in_recovery, commit, interval = cur.fetchone()
        if in_recovery:
            return Verdict(
                "replication", "FAIL", "this server is a standby: locks need the primary"
            )
        cur.execute(
            "SELECT coalesce(application_name, ''), coalesce(sync_state, ''), "
            "extract(epoch FROM now() - reply_time) FROM pg_stat_replication"
        )
        standbys = cur.fetchall()
    if not standbys:
        return Verdict(
            "replication",
            "PASS",
            "no standby streams from this server (a managed service's standby may not "
            "show here: see the high availability page)",
        )
    every = len(standbys)
    synchronous = [name for name, state, _ in standbys if state in ("sync", "quorum")]
    waits = commit in ("on", "remote_write", "remote_apply")
    replies = _seconds(interval)  # 0: standbys do not report (no clock to compare)
    skewed = [
        f"{name or 'a standby'} ({'ahead' if age < 0 else 'behind'} by at least "
        f"{-age if age < 0 else age - replies:.1f} s)"
        for name, _, age in standbys
        if replies and age is not None and (age < -CLOCK_SLACK or age > replies + CLOCK_SLACK)
    ]
    findings = []
    if not (synchronous and waits):
        findings.append(
            f"{every} standby(s), none synchronous for this server's commits "
            f"(synchronous_commit = {commit}): a fail-over can lose the last lease writes "
            "(their holders are told at the next renewal), and fencing numbers keep increasing "
            "across it only while the members' clocks agree to within the fail-over's length. "
            "Make replication synchronous (Patroni: synchronous_mode) to keep both without "
            "the clocks"
        )
    if skewed:
        findings.append(
            "a standby's clock seems to differ from this server's: "
            + ", ".join(skewed)
            + " (keep the members' clocks synchronised: NTP or chrony)"
        )
    if findings:
        return Verdict("replication", "WARN", "; ".join(findings))
    return Verdict(
        "replication",
        "PASS",
        f"{len(synchronous)} of {every} standby(s) synchronous: a fail-over to one keeps every "
        "lease and fencing number",
    )


def _seconds(setting: str) -> float:
    """A duration setting as PostgreSQL shows it (``10s``, ``1min``, ``500ms``, ``0``)."""
    units = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
    for unit in sorted(units, key=len, reverse=True):
        if setting.endswith(unit) and setting[: -len(unit)].strip().isdigit():
            return int(setting[: -len(unit)]) * units[unit]
    return float(setting) if setting.isdigit() else 10.0


def _wake_ups(alias: str, strategy: str) -> Verdict:
    """Whether a release's ``NOTIFY`` reaches this process's listener. The
    listener's verdict is read only once it has heard back (or given up on)
    its own ping; then a notification is sent the way a release sends it,
    through ``alias``, and must wake a waiter registered for it."""
    from django.db import connections

    from django_dlock import notify
    from django_dlock.strategies import traits

    if connections[alias].vendor != "postgresql" or not traits(strategy)[2]:
        return Verdict("wake-ups", "PASS", "not used by this strategy and database")
    from django_dlock.strategies.lease.waiting import listener

    listen = listener(alias)
    if listen is None:
        return Verdict("wake-ups", "WARN", "no LISTEN without psycopg 3: waiters poll")
    if not listen.wait_checked(WAKE_UP_WAIT):
        return Verdict(
            "wake-ups",
            "WARN",
            f"the listener did not hear back from its own test notification within "
            f"{WAKE_UP_WAIT:g} s: waiters poll until it does",
        )
    if not listen.healthy:
        return Verdict(
            "wake-ups",
            "WARN",
            "LISTEN cannot hear through this connection (a transaction-mode pooler?): waiters "
            "poll; name a direct connection in DLOCK_DIRECT_DATABASES",
        )
    name = f"dlock-selfcheck:{uuid.uuid4().hex[:12]}"
    waiter = notify.Waiter()
    listen.register(name, waiter)
    try:
        notify.wake(alias, name)
        heard = waiter.thread_event.wait(WAKE_UP_WAIT)
    finally:
        listen.unregister(name, waiter)
    if not heard:
        return Verdict(
            "wake-ups",
            "WARN",
            f"a notification sent through this connection did not reach the listener within "
            f"{WAKE_UP_WAIT:g} s: waiters poll",
        )
    return Verdict("wake-ups", "PASS", "LISTEN/NOTIFY: a release wakes the next waiter")


def _processes(alias: str, strategy: str, processes: int, seconds: float) -> list[Verdict]:
    key = f"dlock-selfcheck:{uuid.uuid4().hex[:12]}"
    context = multiprocessing.get_context("spawn")
    settings_module = os.environ.get("DJANGO_SETTINGS_MODULE")
    with tempfile.TemporaryDirectory(prefix="dlock-selfcheck-") as tmp:
        counter = Path(tmp) / "counter"
        counter.write_text("0")
        logs = [Path(tmp) / f"log{i}" for i in range(processes)]
        children = [
            context.Process(
                target=_bootstrap,
                args=(settings_module, (alias, strategy, seconds, key, str(counter), str(log))),
                daemon=True,
            )
            for log in logs
        ]
        started = time.monotonic()
        for child in children:
            child.start()
        for child in children:
            child.join(seconds + 120)
        elapsed = time.monotonic() - started
        failed = [c.exitcode for c in children if c.exitcode != 0]
        for child in children:
            if child.is_alive():
                child.kill()
        seen = [
            line.split() for log in logs if log.exists() for line in log.read_text().splitlines()
        ]
        count = int(counter.read_text() or 0)
    if failed:
        return [
            Verdict(
                "mutual exclusion",
                "FAIL",
                f"{len(failed)} of {processes} processes failed (exit codes {failed})",
            )
        ]
    values = sorted(int(v) for v, _, _ in seen)
    exclusive = values == list(range(1, len(values) + 1)) and count == len(values)
    fences = [f for _, f, _ in sorted(seen, key=lambda row: int(row[0]))]
    numbered = [int(f) for f in fences if f != "None"]
    ordered = all(a < b for a, b in zip(numbered, numbered[1:], strict=False))
    verdicts = [
        Verdict(
            "mutual exclusion",
            "PASS" if exclusive and values else "FAIL",
            f"{len(values)} acquisitions by {processes} processes, counter {count}"
            + ("" if exclusive else ": updates were lost, two holders overlapped"),
        )
    ]
    if numbered:
        verdicts.append(
            Verdict(
                "fencing order",
                "PASS" if ordered and len(numbered) == len(fences) else "FAIL",
                "every holding's number is greater than the one before"
                if ordered
                else "a holding's number is not greater than the one before it",
            )
        )
    waits = sorted(float(w) for _, _, w in seen)
    if waits:
        p99 = waits[min(len(waits) - 1, int(len(waits) * 0.99))]
        verdicts.append(
            Verdict(
                "hand-off",
                "PASS",
                f"{len(waits) / elapsed:,.0f} acquisitions/s; an acquire waited "
                f"{statistics.median(waits) * 1000:.1f} ms (median), {p99 * 1000:.1f} ms (p99)",
            )
        )
    return verdicts
