"""Views of the example site, each guarded by django-dlock."""

from __future__ import annotations

import asyncio
import time

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.middleware.csrf import get_token
from django.utils.decorators import method_decorator
from django.utils.html import format_html
from django.views import View

import django_dlock as dlock
from django_dlock.decorators import with_lock

from . import jobs


def index(request: HttpRequest) -> HttpResponse:
    links = [
        ("/invoices/42/pay/", "pay invoice 42 (423 Locked while another payment runs)"),
        ("/catalog/sync/", "sync the catalog (async view; waits up to 10 s for its turn)"),
        ("/reports/nightly/", "run the nightly report (TaskLock: at most once a minute)"),
        ("/checkout/", "checkout (POST; the middleware serialises it per user)"),
        ("/admin/django_dlock/lock/", "the locks in the admin"),
    ]
    items = "".join(f'<li><a href="{url}">{url}</a>: {text}</li>' for url, text in links)
    return HttpResponse(f"<h1>django-dlock example site</h1><ul>{items}</ul>")


@with_lock("invoice:{invoice_id}", ttl=30)
def pay_invoice(request: HttpRequest, invoice_id: int) -> JsonResponse:
    """One payment per invoice at a time; a concurrent one gets 423 + Retry-After."""
    lk = dlock.lock(f"invoice:{invoice_id}")
    time.sleep(0.5)  # the payment provider is slow
    return JsonResponse({"invoice": invoice_id, "paid": True, "fence": lk.fence})


@with_lock("catalog", on_contention="wait", timeout=10, ttl=30)
async def sync_catalog(request: HttpRequest) -> JsonResponse:
    """Async view: concurrent syncs queue up instead of failing."""
    await asyncio.sleep(0.2)
    return JsonResponse({"synced": True})


def nightly_report(request: HttpRequest) -> JsonResponse:
    """Every click tries the job; it runs at most once a minute across all workers."""
    ran = jobs.nightly_report()
    return JsonResponse({"ran": ran is not None, "result": ran})


@method_decorator(with_lock(lambda request, *args, **kwargs: "checkout-stock"), name="post")
class CheckoutView(View):
    """The per-user rule of LockMiddleware applies first; the stock lock then
    serialises every checkout (a class-based view with ``method_decorator``)."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(
            format_html(
                '<form method="post"><input type="hidden" name="csrfmiddlewaretoken" '
                'value="{}">Checkout <button>buy</button></form>',
                get_token(request),
            )
        )

    def post(self, request: HttpRequest) -> JsonResponse:
        time.sleep(0.2)
        return JsonResponse({"ordered": True})
