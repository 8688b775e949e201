"""Cost of ``DLOCK_TRACING``: uncontended ``with dlock.lock(k)`` pairs, tracing off vs on.

``python -m tests.benchmarks.tracing [--rounds 21] [--seconds 0.5]``

* **before**: ``Lock.acquire`` without the observers' hook (no test of
  ``metrics.observer`` and ``tracing.tracer``), run by a subclass;
* **off**: today's ``Lock`` with ``DLOCK_TRACING = None`` (the default);
* **on**: with ``DLOCK_TRACING = "opentelemetry"``, the OpenTelemetry SDK's
  ``TracerProvider`` and a ``BatchSpanProcessor`` whose exporter drops the
  spans (what an application pays in its own process; the export to a
  collector happens on the processor's thread);
* **unsampled**: on, inside a request whose trace the sampler dropped (the
  SDK's default sampler follows the parent's decision).

Rounds are interleaved (before, off, on, ...) and the report gives the
median of the ratios of the same round, on PostgreSQL (the lease strategy)
and on an in-memory SQLite database (no network: the relative cost is
largest there). Then it prints one real trace: a request that waited for a
lock another holder kept for 0.3 s, as the spans were recorded. Not part of
the test run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.benchmarks.metrics_settings")


def install_provider() -> Any:
    """The SDK's provider with a batch processor that drops what it exports, and an
    in-memory exporter switched on only for the example trace."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    class WhenAsked(SimpleSpanProcessor):
        recording = False

        def on_end(self, span: Any) -> None:
            if self.recording:
                super().on_end(span)

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    memory = InMemorySpanExporter()
    example = WhenAsked(memory)
    provider.add_span_processor(example)
    trace.set_tracer_provider(provider)
    return example, memory


def contenders(alias: str) -> dict[str, tuple[Callable[[], None], Any]]:
    """name -> (pair, settings to run its rounds under)."""
    import django_dlock as dlock
    from django_dlock.locks import UNSET
    from django_dlock.retry import Deadline

    class Before(dlock.Lock):
        def acquire(self, blocking: bool = True, timeout: Any = UNSET) -> bool:
            deadline = Deadline(self._resolve_timeout(blocking, timeout))
            return self._acquire(self._options(), deadline)

    before = Before("bench-tracing", using=alias)
    now = dlock.lock("bench-tracing", using=alias)

    def run_before() -> None:
        with before:
            pass

    def run_now() -> None:
        with now:
            pass

    from opentelemetry import context, trace

    # a request whose trace the sampler dropped (ParentBased: so are its children)
    dropped = trace.set_span_in_context(
        trace.NonRecordingSpan(
            trace.SpanContext(
                trace_id=0x1F, span_id=0x2F, is_remote=True, trace_flags=trace.TraceFlags(0)
            )
        )
    )

    def run_unsampled() -> None:
        token = context.attach(dropped)
        try:
            with now:
                pass
        finally:
            context.detach(token)

    return {
        "before": (run_before, None),
        "off": (run_now, None),
        "on": (run_now, {"DLOCK_TRACING": "opentelemetry"}),
        "unsampled": (run_unsampled, {"DLOCK_TRACING": "opentelemetry"}),
    }


def measure(alias: str, rounds: int, seconds: float) -> dict[str, list[float]]:
    from .common import measure_in_turn

    return measure_in_turn(contenders(alias), rounds, seconds)


def example_trace(example: Any, memory: Any) -> list[str]:
    """A request waits for a lock another holder keeps for 0.3 s: its spans, as a tree."""
    from django.test.utils import override_settings
    from opentelemetry import trace

    import django_dlock as dlock
    from django_dlock.identity import doing

    held, let_go = threading.Event(), threading.Event()

    def other_request() -> None:
        with dlock.lock("invoice:42"):
            held.set()
            let_go.wait(10)
        from django.db import connections

        connections.close_all()

    with override_settings(DLOCK_TRACING="opentelemetry"):
        holder = threading.Thread(target=other_request)
        holder.start()
        held.wait(10)
        threading.Timer(0.3, let_go.set).start()
        example.recording = True
        memory.clear()
        tracer = trace.get_tracer("example")
        with (
            tracer.start_as_current_span("GET /invoice/42/"),
            doing("GET /invoice/42/"),
            dlock.lock("invoice:42", timeout=10),
        ):
            time.sleep(0.1)  # the view's work
        example.recording = False
        holder.join(10)
    spans = [s for s in memory.get_finished_spans() if s.name != "dlock.hold" or s.parent]
    root = next(s for s in spans if s.name == "GET /invoice/42/")
    by_parent: dict[int, list[Any]] = {}
    for span in spans:
        if span.parent is not None:
            by_parent.setdefault(span.parent.span_id, []).append(span)
    lines: list[str] = []

    def show(span: Any, depth: int) -> None:
        took = (span.end_time - span.start_time) / 1e6
        lines.append(f"{'   ' * depth}{span.name}  ({took:.0f} ms)")
        for key, value in sorted((span.attributes or {}).items()):
            shown = f"{value:.3f}" if isinstance(value, float) else value
            lines.append(f"{'   ' * depth}   {key}={shown}")
        for child in sorted(by_parent.get(span.context.span_id, []), key=lambda s: s.start_time):
            show(child, depth + 1)

    show(root, 0)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.tracing")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args(argv)

    from .common import ensure_databases, setup_django

    setup_django()
    ensure_databases()
    example, memory = install_provider()
    print("| database | off, pairs/s (median) | off / before | on / off | unsampled / off |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for alias, label in (("default", "PostgreSQL"), ("memory", "SQLite (memory)")):
        rates = measure(alias, args.rounds, args.seconds)
        off = statistics.median(rates["off"])
        # ratios of the same round (paired): drift between rounds cancels out
        off_before = statistics.median(
            a / b for a, b in zip(rates["off"], rates["before"], strict=True)
        )
        on_off = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
        unsampled = statistics.median(
            a / b for a, b in zip(rates["unsampled"], rates["off"], strict=True)
        )
        print(f"| {label} | {off:,.0f} | {off_before:.3f} | {on_off:.3f} | {unsampled:.3f} |")
    print()
    print("\n".join(example_trace(example, memory)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
