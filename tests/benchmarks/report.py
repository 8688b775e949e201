"""Render the benchmark results: a markdown report and a PNG chart."""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .common import Series
from .failover import TIMING, Failover
from .handoff import Handoff
from .scale import Cleanup
from .uncontended import FLOORS

ANCHORS = "earlier measurements (2 vCPU VM, PostgreSQL 15, Redis 7)"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def uncontended_table(results: dict[str, Series]) -> list[str]:
    lines = [
        "| contender | pairs/s (median) | p50 µs | p99 µs | vs its raw floor |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, series in results.items():
        floor = FLOORS.get(name)
        ratio = _ratio(series.rate, results[floor].rate) if floor in results else ""
        lines.append(
            f"| {name} | {series.rate:,.0f} | {series.p(50) * 1e6:,.0f} | "
            f"{series.p(99) * 1e6:,.0f} | {ratio} |"
        )
    return lines


def handoff_table(results: list[Handoff]) -> list[str]:
    lines = [
        "| waiting method | acq/s | holder changes | hand-off p50 ms | p99 ms | worst ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for h in results:
        lines.append(
            f"| {h.name} | {h.acquisitions_per_second:,.0f} | {h.holder_changes:.0%} | "
            f"{h.p50_ms:.2f} | {h.p99_ms:.2f} | {h.worst_ms:.1f} |"
        )
    return lines


def scale_table(acq: dict[str, Series], cleanups: list[Cleanup]) -> list[str]:
    names = list(acq)
    lines = [
        "| lease acquire + release | pairs/s | p99 µs |",
        "| --- | ---: | ---: |",
        *(f"| {n} | {acq[n].rate:,.0f} | {acq[n].p(99) * 1e6:,.0f} |" for n in names),
        "",
        f"Time per pair, table with expired rows vs empty table: "
        f"**{_ratio(acq[names[0]].rate, acq[names[1]].rate)}**.",
        "",
        "| deleting 1,000,000 expired rows | seconds | rows | concurrent acquire p50 ms "
        "| p99 ms | worst ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in cleanups:
        lines.append(
            f"| {c.name} | {c.seconds:.2f} | {c.deleted:,} | {c.acquire_p50_ms:.2f} | "
            f"{c.acquire_p99_ms:.2f} | {c.acquire_worst_ms:.1f} |"
        )
    if len(cleanups) == 2:
        ratio = _ratio(cleanups[1].seconds, cleanups[0].seconds)
        lines += ["", f"Batched cleanup vs one DELETE: **{ratio}**."]
    return lines


def failover_table(results: list[Failover]) -> list[str]:
    lines = [
        f"Election timing: lease {TIMING['lease']} s, renew_deadline "
        f"{TIMING['renew_deadline']} s, retry {TIMING['retry']} s.",
        "",
        "| strategy | signal to the leader | median s | samples s |",
        "| --- | --- | ---: | --- |",
    ]
    for f in results:
        samples = ", ".join(f"{s:.3f}" for s in f.samples)
        lines.append(f"| {f.strategy} | {f.signal} | {f.median_s:.3f} | {samples} |")
    return lines


def targets(
    unc: dict[str, Series], hand: list[Handoff], acq: dict[str, Series], cleanups: list[Cleanup]
) -> list[str]:
    """The performance targets, judged on this run's numbers."""
    rows: list[tuple[str, str, bool]] = []

    def add(target: str, value: float, ok: bool, fmt: str = "{:.2f}x") -> None:
        rows.append((target, fmt.format(value), ok))

    if unc:
        adv, floor = unc["advisory"].rate, unc[FLOORS["advisory"]].rate
        add("`advisory` >= 0.80x the raw floor", adv / floor, adv / floor >= 0.80)
        pg = unc["django-pglock advisory"].rate
        add("`advisory` >= 1.15x django-pglock", adv / pg, adv / pg >= 1.15)
        lease, lfloor = unc["lease"].rate, unc[FLOORS["lease"]].rate
        add("`lease` >= 0.85x its raw floor", lease / lfloor, lease / lfloor >= 0.85)
        fast = unc["lease, fast durability"].rate
        add("fast durability vs durable `lease` (about 2x expected)", fast / lease, fast > lease)
    by = {h.name: h for h in hand}
    if by:
        add(
            "`advisory` hand-off p50 <= 1 ms",
            by["advisory"].p50_ms,
            by["advisory"].p50_ms <= 1.0,
            "{:.2f} ms",
        )
        add(
            "`lease` hand-off p50 <= 3 ms",
            by["lease"].p50_ms,
            by["lease"].p50_ms <= 3.0,
            "{:.2f} ms",
        )
        prl = by["python-redis-lock"].p50_ms
        add(
            f"`lease` hand-off p50 beats python-redis-lock ({prl:.2f} ms)",
            by["lease"].p50_ms,
            by["lease"].p50_ms < prl,
            "{:.2f} ms",
        )
    if acq:
        empty, big = (s.rate for s in acq.values())
        add("acquisition on the big table <= 1.2x the empty table", empty / big, empty / big <= 1.2)
    if len(cleanups) == 2:
        ratio = cleanups[1].seconds / cleanups[0].seconds
        add("`dlock_cleanup` <= 3x one DELETE", ratio, ratio <= 3.0)
        p99 = cleanups[1].acquire_p99_ms
        add("acquire p99 while `dlock_cleanup` runs < 50 ms", p99, p99 < 50, "{:.1f} ms")
    return [
        "| target | this run | holds |",
        "| --- | ---: | :---: |",
        *(f"| {t} | {v} | {'yes' if ok else '**no**'} |" for t, v, ok in rows),
    ]


def chart(results: dict[str, Series], handoffs: list[Handoff], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6))
    names = list(results)
    rates = [results[n].rate for n in names]
    colors = [
        "#9e9e9e"
        if n.startswith("raw")
        else "#c0392b"
        if ("redis" in n or "pglock" in n)
        else "#2e86c1"
        for n in names
    ]
    left.barh(names, rates, color=colors)
    left.invert_yaxis()
    left.set_xlabel("acquire + release pairs per second (median, higher is better)")
    left.set_title("Uncontended, one client")
    left.tick_params(axis="y", labelsize=8)
    names_h = [h.name for h in handoffs]
    ours = {"advisory", "lease"}
    xs = range(len(names_h))
    p50_colors = ["#2e86c1" if n in ours else "#c0392b" for n in names_h]
    p99_colors = ["#85c1e9" if n in ours else "#f1948a" for n in names_h]
    right.bar([x - 0.2 for x in xs], [h.p50_ms for h in handoffs], 0.4, color=p50_colors)
    right.bar([x + 0.2 for x in xs], [h.p99_ms for h in handoffs], 0.4, color=p99_colors)
    right.set_xticks(
        list(xs),
        [
            f"{n}\n({h.holder_changes:.0%} hand-offs)"
            for n, h in zip(names_h, handoffs, strict=True)
        ],
    )
    right.set_yscale("log")
    right.set_ylabel("ms (log): p50 dark, p99 light; lower is better")
    right.set_title("Hand-off, 4 processes, one key, ~1 ms work")
    fig.suptitle("django-dlock (blue) vs raw floors (grey) and other libraries (red)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(sections: dict[str, list[str]], meta: dict[str, Any]) -> str:
    head = [
        "# Benchmarks",
        "",
        "Measured by `python -m tests.benchmarks` in one run, side by side on the same",
        "PostgreSQL and Redis, interleaved round by round (A B A B …); rates are medians",
        "of the rounds. The machines are noisy (earlier runs saw the same row move by",
        "up to 45 % between two runs): compare the ratios within a run, not absolute",
        'numbers across runs. Rerun it yourself: `pip install -e ".[dev,bench]" && '
        "python -m tests.benchmarks`.",
        "",
        f"Run: {meta['when']} on {meta['machine']}; {meta['versions']}.",
        "",
        "![benchmark chart](img/benchmarks.png)",
        "",
    ]
    body: list[str] = []
    for title, lines in sections.items():
        body += [f"## {title}", "", *lines, ""]
    return "\n".join(head + body)


def meta() -> dict[str, Any]:
    import django
    import psycopg
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SHOW server_version")
        pg = cur.fetchone()[0]
    return {
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "versions": f"Python {platform.python_version()}, Django {django.get_version()}, "
        f"psycopg {psycopg.__version__}, PostgreSQL {pg}",
    }
