"""Views for the decorator, middleware and admin tests.

A ``Probe`` records who is inside a view at the same time; a view can be
held at its ``gate`` (a bounded wait) so a test decides when it finishes.
"""

from __future__ import annotations

import asyncio
import threading
import time

from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.utils.decorators import method_decorator
from django.views import View

from django_dlock.decorators import Contention, with_lock


class Probe:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.mutex = threading.Lock()
        self.entered = 0
        self.active = 0
        self.max_active = 0
        self.gate = threading.Event()
        self.gate.set()

    def close_gate(self) -> None:
        self.gate.clear()

    def enter(self) -> None:
        with self.mutex:
            self.entered += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def leave(self) -> None:
        with self.mutex:
            self.active -= 1

    def run(self, hold: float = 0.0) -> None:
        self.enter()
        try:
            assert self.gate.wait(60), "the test never opened the gate"
            if hold:
                time.sleep(hold)
        finally:
            self.leave()

    async def arun(self) -> None:
        self.enter()
        try:
            end = time.monotonic() + 60
            while not self.gate.is_set():
                assert time.monotonic() < end, "the test never opened the gate"
                await asyncio.sleep(0.01)
        finally:
            self.leave()


PROBE = Probe()


@with_lock("invoice:{invoice_id}")
def invoice(request: HttpRequest, invoice_id: int) -> HttpResponse:
    PROBE.run()
    return HttpResponse(f"paid {invoice_id}")


@with_lock("export:{fmt}", permits=2)
def export(request: HttpRequest, fmt: str) -> HttpResponse:
    PROBE.run()
    return HttpResponse(f"exported {fmt}")


@with_lock("serial:{invoice_id}", on_contention="wait", timeout=60)
def invoice_wait(request: HttpRequest, invoice_id: int) -> HttpResponse:
    PROBE.run(hold=0.02)
    return HttpResponse("done")


@with_lock("ainvoice:{invoice_id}")
async def invoice_async(request: HttpRequest, invoice_id: int) -> HttpResponse:
    await PROBE.arun()
    return HttpResponse(f"async {invoice_id}")


@method_decorator(with_lock("cbv:{invoice_id}", on_contention=409, retry_after=3), name="post")
class InvoiceView(View):
    def get(self, request: HttpRequest, invoice_id: int) -> HttpResponse:
        return HttpResponse("unlocked get")

    def post(self, request: HttpRequest, invoice_id: int) -> HttpResponse:
        PROBE.run()
        return HttpResponse(f"cbv {invoice_id}")


@with_lock("order:{order_id}")
def wrong_kwarg(request: HttpRequest, **kwargs: object) -> HttpResponse:
    return HttpResponse("never")


def busy(contention: Contention) -> HttpResponse:
    return HttpResponse(f"busy: {contention.resource}", status=503)


@with_lock(lambda request, invoice_id: ("invoice", invoice_id), on_contention=busy)
def invoice_callable(request: HttpRequest, invoice_id: int) -> HttpResponse:
    PROBE.run()
    return HttpResponse("callable")


@with_lock("stream:{invoice_id}", ttl=60)
def stream(request: HttpRequest, invoice_id: int) -> StreamingHttpResponse:
    def chunks():
        yield b"one,"
        PROBE.run()
        yield b"two"

    return StreamingHttpResponse(chunks(), content_type="text/plain")


def checkout(request: HttpRequest, **kwargs: object) -> HttpResponse:
    PROBE.run()
    return HttpResponse("checked out")


async def acheckout(request: HttpRequest) -> HttpResponse:
    await PROBE.arun()
    return HttpResponse("async checked out")


#: four requests inside ``together`` at once (served by gunicorn in tests/test_pooling.py)
TOGETHER = threading.Barrier(4, timeout=20)


@with_lock("together:{n}", timeout=5)
def together(request: HttpRequest, n: int) -> HttpResponse:
    TOGETHER.wait()  # each request holds its transaction's connection and its lock
    return HttpResponse("together")
