"""Deadlock detection for lease waiters: a cycle in the wait-for graph.

Who waits on whom is in the database: each waiter's ticket (a row of the
waiter table: the key, the waiter's token, its number) and each holder's
lease (a row of the lock table: the key, the holder's token). A token is
one thread or asyncio task of one process, so one token may hold several
keys and wait for one. A waiter that has waited longer than
``DLOCK_DEADLOCK_TIMEOUT`` (see :func:`due`) reads that graph and asks
whether it is part of a deadlock (:func:`check`).

The graph. A ticket of token ``W`` for key ``K`` is blocked by:

* the holder of ``K``'s lease (its token), or, when readers hold ``K``
  (the key's row says ``(readers)``), every reader: a writer waits for all
  of them (and a reader queued behind a writer waits for them through it);
* every live ticket ahead of it in ``K``'s queue (first come, first
  served: those are served first, and then they hold ``K``);
* for a semaphore (its key's name starts with ``semaphore:``), any one of
  the holders of its permits: a freed permit is enough, so a semaphore's
  waiter is deadlocked only when every holder of a permit is.

Nothing blocks a waiter on its own token (a re-entry, a reader upgrading).

Which waiters are deadlocked: the graph is reduced, as for a system of
AND and OR requests: a token that waits for nothing can go on (and will
release what it holds); a ticket is satisfiable when all its AND blockers
can go on and, for a semaphore, one of the permits' holders can (or none
is held); a token can go on when one of its tickets is satisfiable (a
token with two tickets holds one place kept by ``enqueue()``). What is
left cannot go on, ever, unless a waiter gives up.

Who is told: only waiters on a cycle (a strongly connected part of the
deadlocked graph), not those merely queued behind one, and of each cycle
only the ticket with the highest number: the waiter that began to wait
last, the youngest. Every member of the cycle reads the same graph and
picks the same one, so exactly one gets :class:`~django_dlock.LockDeadlock`;
its wait ends, its ticket is deleted, and once its ``with`` blocks are
left its keys go to the others. A cycle found is read a second time
before it is reported: the keys' rows and the queue are read in one
statement (one snapshot), but the readers' and permits' rows, when a cycle
goes through them, in a second one.

The cost: nothing until a waiter has waited ``DLOCK_DEADLOCK_TIMEOUT``;
then one read (two when readers or permits are involved) every
``DLOCK_DEADLOCK_TIMEOUT`` while it waits, of the live tickets and the
leases of the keys they wait for (never the whole lock table). See
:data:`stats`.

Limits: the graph is one database's: a cycle through keys of two
databases (two aliases, a quorum) is not seen. A waiter killed less than
``DLOCK_QUEUE_TICKET_TTL`` ago still has a live ticket, so it counts as
waiting until the ticket runs out. A place kept by ``enqueue()`` counts
as waiting for its key.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock import dbclock
from django_dlock.conf import conf
from django_dlock.exceptions import LockDeadlock
from django_dlock.strategies.base import Request
from django_dlock.strategies.connection import cursor, with_reconnect
from django_dlock.strategies.lease.sql import TABLE, WAITERS

__all__ = [
    "Cycle",
    "Graph",
    "check",
    "cycles",
    "deadlock_error",
    "due",
    "read_graph",
    "stats",
    "victim_cycle",
]

logger = logging.getLogger("django_dlock")

#: the token of a key's row while readers hold it (``shared.READERS``, not
#: imported: the shared module imports the lease strategy, which imports this)
READERS = "(readers)"
#: the part of a reader's row name after its key's name (``shared.READER_INFIX``)
READER_INFIX = "#reader:"
#: a semaphore's key names start so; its permits' rows are ``<name>#<n>``
SEMAPHORE = "semaphore:"
_PERMIT = re.compile(r"#\d+\Z")


def due() -> float | None:
    """Seconds a lease waiter waits before it looks for a deadlock
    (``DLOCK_DEADLOCK_TIMEOUT``); ``None``: it never looks."""
    return conf.DEADLOCK_TIMEOUT


# -- the graph ---------------------------------------------------------------------


@dataclass(frozen=True)
class Ticket:
    """A live ticket: ``token`` waits for the key ``name``."""

    number: int
    name: str
    token: str


@dataclass
class Graph:
    """Who waits for which key, and who holds the keys waited for (one database)."""

    tickets: list[Ticket] = field(default_factory=list)
    #: key name -> tokens of its live holders (the lease, the readers, the permits)
    holders: dict[str, set[str]] = field(default_factory=dict)
    #: token -> owner (host, pid and thread or task), as the admin shows it
    owners: dict[str, str] = field(default_factory=dict)
    #: semaphores with a free permit's row (released, or its lease over): a
    #: waiter for one is served at its next look, not blocked
    free: set[str] = field(default_factory=set)
    #: semaphore name -> its number of permits, where known (the looking
    #: waiter's own semaphore): fewer live holders than that leaves a permit free
    permits: dict[str, int] = field(default_factory=dict)

    def queues(self) -> dict[str, list[Ticket]]:
        """Each waited-for key's tickets, in the order they are served."""
        found: dict[str, list[Ticket]] = {}
        for ticket in sorted(self.tickets, key=lambda t: t.number):
            found.setdefault(ticket.name, []).append(ticket)
        return found

    def owner(self, token: str) -> str:
        return self.owners.get(token) or f"token {token[:8]}…"


def read_graph(alias: str) -> Graph:
    """Read the wait-for graph of ``alias``: its live tickets and the live
    leases of the keys they wait for (one statement; a second one for the
    rows of readers and permits, when such keys are waited for)."""

    def run(connection: BaseDatabaseWrapper) -> Graph:
        now = dbclock.now_sql(connection)
        graph = Graph()
        with cursor(connection) as cur:
            cur.execute(
                f"SELECT 0, w.name, w.token, w.owner, w.id FROM {WAITERS} w "
                f"WHERE w.expire_at > {now} "
                "UNION ALL "
                f"SELECT 1, l.name, l.token, l.owner, l.fence FROM {TABLE} l "
                f"WHERE l.name IN (SELECT q.name FROM {WAITERS} q WHERE q.expire_at > {now}) "
                f"AND l.expire_at > {now} AND l.token <> ''"
            )
            rows = cur.fetchall()
        _STATS.statements += 1
        readers: list[str] = []
        for kind, name, token, owner, number in rows:
            if kind == 0:
                graph.tickets.append(Ticket(int(number), name, token))
            elif token == READERS:
                readers.append(name)
            else:
                graph.holders.setdefault(name, set()).add(token)
            if token != READERS:
                graph.owners.setdefault(token, owner)
        semaphores = sorted({t.name for t in graph.tickets if t.name.startswith(SEMAPHORE)})
        if readers or semaphores:
            _read_prefixed(connection, graph, readers, semaphores)
        return graph

    found, _ = with_reconnect(alias, run)
    return found


def _read_prefixed(
    connection: BaseDatabaseWrapper, graph: Graph, readers: list[str], semaphores: list[str]
) -> None:
    """Add the holders of keys held by readers (their rows ``<key>#reader:…``)
    and of semaphores (their permits' rows ``<key>#<n>``)."""
    now = dbclock.now_sql(connection)
    prefixes = [(name, name + READER_INFIX) for name in readers]
    prefixes += [(name, name + "#") for name in semaphores]
    where: list[str] = []
    params: list[str] = []
    for _name, prefix in prefixes:
        if connection.vendor == "sqlite":  # (its LIKE ignores case: a range of the index)
            where.append("(name >= %s AND name < %s)")
            params += [prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)]
        else:
            where.append("name LIKE %s ESCAPE '!'")
            params.append(prefix.replace("!", "!!").replace("%", "!%").replace("_", "!_") + "%")
    with cursor(connection) as cur:
        # every row, live or not: a permit's row that is not live is a free permit
        cur.execute(
            f"SELECT name, token, owner, CASE WHEN expire_at > {now} AND token <> '' "
            f"THEN 1 ELSE 0 END FROM {TABLE} WHERE ({' OR '.join(where)})",
            params,
        )
        rows = cur.fetchall()
    _STATS.statements += 1
    for row_name, token, owner, live in rows:
        for name, prefix in prefixes:
            if not row_name.startswith(prefix):
                continue
            if name in semaphores and not _PERMIT.fullmatch(row_name[len(name) :]):
                continue
            if not live:
                if name in semaphores:
                    graph.free.add(name)
                continue
            graph.holders.setdefault(name, set()).add(token)
            graph.owners.setdefault(token, owner)


# -- what is deadlocked --------------------------------------------------------------


@dataclass(frozen=True)
class Cycle:
    """A deadlock, as :class:`~django_dlock.LockDeadlock` tells it.

    ``holders[i]`` holds ``keys[i]`` (or is queued ahead for it) and waits
    for ``keys[i + 1]``; the last holder, the waiter it is told to, waits
    for ``keys[0]``.
    """

    keys: tuple[str, ...]
    #: owners, as the admin shows them
    holders: tuple[str, ...]
    #: the tickets of the cycle's waits, in the order of ``keys``
    tickets: tuple[int, ...]
    #: the ticket that is told (the youngest)
    victim: int


def _stuck(graph: Graph) -> set[str]:
    """The tokens that can never go on (the reduction in the module docstring).

    Each pass walks each key's queue in order, counting the stuck tokens
    ahead, so a pass costs one look at each ticket however long the queues.
    """
    stuck = {t.token for t in graph.tickets}
    queues = graph.queues()
    changed = True
    while changed:
        changed = False
        for name, tickets in queues.items():
            held = graph.holders.get(name, set())
            any_of = name.startswith(SEMAPHORE)
            ahead: Counter[str] = Counter()  # stuck tokens ahead, by token
            total = 0
            for ticket in tickets:
                token = ticket.token
                if token in stuck:
                    others = held - {token}
                    # a semaphore: a free permit, or one holder that can go on
                    # and free one
                    if any_of and (name in graph.free or len(held) < graph.permits.get(name, 0)):
                        free = True
                    else:
                        free = not others <= stuck if any_of else not others & stuck
                    served = not others or free
                    if served and total == ahead[token]:  # no other stuck token ahead
                        stuck.discard(token)
                        changed = True
                if token in stuck:
                    ahead[token] += 1
                    total += 1
    return stuck


def _edges(graph: Graph, stuck: set[str]) -> dict[str, list[tuple[Ticket, str]]]:
    """token -> (its ticket, a stuck token it waits for), among stuck tokens.

    A ticket waits for the stuck holders of its key and for the nearest
    stuck ticket ahead of it (of another token): that one waits for the
    next one ahead, and so on, so every stuck token ahead is reached.
    """
    edges: dict[str, list[tuple[Ticket, str]]] = {}
    for name, tickets in graph.queues().items():
        held = graph.holders.get(name, set()) & stuck
        last: Ticket | None = None  # the nearest stuck ticket ahead
        other: Ticket | None = None  # the nearest one ahead of another token than last's
        for ticket in tickets:
            if ticket.token not in stuck:
                continue
            ahead = last if last is not None and last.token != ticket.token else other
            out = edges.setdefault(ticket.token, [])
            for token in sorted(held - {ticket.token}):
                out.append((ticket, token))
            if ahead is not None:
                out.append((ticket, ahead.token))
            if last is not None and last.token != ticket.token:
                other = last
            last = ticket
    return edges


def _reach(edges: dict[str, list[tuple[Ticket, str]]], start: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        token = todo.pop()
        if token in seen:
            continue
        seen.add(token)
        todo.extend(to for _, to in edges.get(token, ()))
    return seen


def _component(edges: dict[str, list[tuple[Ticket, str]]], token: str) -> set[str]:
    """The strongly connected part of the graph that holds ``token`` (empty:
    it is on no cycle)."""
    forward = _reach(edges, (to for _, to in edges.get(token, ())))
    if token not in forward:
        return set()
    backward: dict[str, list[tuple[Ticket, str]]] = {}
    for source, out in edges.items():
        for ticket, to in out:
            backward.setdefault(to, []).append((ticket, source))
    return forward & _reach(backward, [token])


def _path(
    graph: Graph, edges: dict[str, list[tuple[Ticket, str]]], part: set[str], first: Ticket
) -> Cycle:
    """The shortest cycle that starts with ``first``'s wait, inside ``part``."""
    me = first.token
    came: dict[str, tuple[str, Ticket]] = {}
    todo: list[str] = []
    for ticket, to in edges.get(me, ()):
        if ticket == first and to in part and to not in came:
            came[to] = (me, ticket)
            todo.append(to)
    while todo and me not in came:
        nxt: list[str] = []
        for token in todo:
            for ticket, to in edges.get(token, ()):
                if to in part and to not in came:
                    came[to] = (token, ticket)
                    nxt.append(to)
        todo = nxt
    steps: list[tuple[Ticket, str]] = []  # (a wait, the token it waits for)
    token = me
    while True:
        source, ticket = came[token]
        steps.append((ticket, token))
        token = source
        if token == me:
            break
    steps.reverse()
    return Cycle(
        keys=tuple(ticket.name for ticket, _ in steps),
        holders=tuple(graph.owner(to) for _, to in steps),
        tickets=tuple(ticket.number for ticket, _ in steps),
        victim=max(ticket.number for ticket, _ in steps),
    )


def _victim(graph: Graph, edges: dict[str, list[tuple[Ticket, str]]], part: set[str]) -> Ticket:
    """The youngest ticket that waits inside ``part``."""
    return max(
        (ticket for token in part for ticket, to in edges.get(token, ()) if to in part),
        key=lambda t: t.number,
    )


def victim_cycle(graph: Graph, number: int) -> Cycle | None:
    """The cycle that ticket ``number`` must break: ``None`` unless it waits on
    a cycle of the graph and is the youngest ticket of that cycle."""
    mine = next((t for t in graph.tickets if t.number == number), None)
    if mine is None:
        return None
    stuck = _stuck(graph)
    if mine.token not in stuck:
        return None
    edges = _edges(graph, stuck)
    part = _component(edges, mine.token)
    if not part or _victim(graph, edges, part) != mine:
        return None
    return _path(graph, edges, part, mine)


def cycles(graph: Graph) -> list[Cycle]:
    """Every deadlock of ``graph``: one cycle per strongly connected part,
    seen from its youngest ticket (the one that is told)."""
    stuck = _stuck(graph)
    edges = _edges(graph, stuck)
    found: list[Cycle] = []
    seen: set[str] = set()
    for token in sorted(stuck):
        if token in seen:
            continue
        part = _component(edges, token)
        if not part:
            continue
        seen |= part
        found.append(_path(graph, edges, part, _victim(graph, edges, part)))
    return found


# -- the waiter's check --------------------------------------------------------------


class Stats:
    """What the checks of this process cost (read by the tests and benchmarks)."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.checks = 0
        self.statements = 0
        self.seconds = 0.0
        self.found = 0


_STATS = Stats()
#: the checks made by this process so far
stats = _STATS


def deadlock_error(cycle: Cycle, waiting_for: str) -> LockDeadlock:
    """The error told to the youngest waiter of ``cycle``."""
    steps = []
    for key, holder in zip(cycle.keys, cycle.holders, strict=True):
        steps.append(f"{key!r} is held by (or queued ahead for by) {holder}")
    return LockDeadlock(
        f"deadlock while waiting for {waiting_for!r}: "
        + ", which waits: ".join(steps)
        + " (this waiter, the last to begin waiting, gives up)",
        keys=cycle.keys,
        holders=cycle.holders,
    )


def check(req: Request, ticket: int) -> None:
    """Look for a deadlock through ``ticket`` (``req``'s waiter): raise
    :class:`~django_dlock.LockDeadlock` if this waiter is the one of its
    cycle to give up. A database error ends the look quietly (the wait goes on)."""
    started = time.perf_counter()

    def read() -> Graph:
        graph = read_graph(req.alias)
        if req.queue_rows and req.key.name.startswith(SEMAPHORE):  # its permits' rows
            graph.permits[req.key.name] = len(req.queue_rows)
        return graph

    try:
        cycle = victim_cycle(read(), ticket)
        if cycle is not None:  # seen twice before it is told
            again = victim_cycle(read(), ticket)
            cycle = again if again is not None and again.tickets == cycle.tickets else None
    except Exception as exc:  # a look must not end the wait
        logger.debug("django-dlock: could not look for a deadlock on %s: %s", req.key.name, exc)
        return
    finally:
        with _STATS.mutex:
            _STATS.checks += 1
            _STATS.seconds += time.perf_counter() - started
    if cycle is None:
        return
    with _STATS.mutex:
        _STATS.found += 1
    error = deadlock_error(cycle, req.key.name)
    logger.warning(
        "django-dlock: %s",
        error,
        extra={
            "lock_name": req.key.name,
            "lock_owner": req.owner,
            "lock_cycle": list(cycle.keys),
        },
    )
    from django_dlock import metrics

    if metrics.observer is not None:
        metrics.observer.deadlocks.inc()
    raise error
