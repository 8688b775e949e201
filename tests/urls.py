from __future__ import annotations

from django.contrib import admin
from django.urls import path

from tests import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("invoice/<int:invoice_id>/", views.invoice),
    path("invoice/<int:invoice_id>/wait/", views.invoice_wait),
    path("invoice/<int:invoice_id>/async/", views.invoice_async),  # type: ignore[arg-type]
    path("invoice/<int:invoice_id>/cbv/", views.InvoiceView.as_view()),
    path("invoice/<int:invoice_id>/wrong/", views.wrong_kwarg),
    path("invoice/<int:invoice_id>/callable/", views.invoice_callable),
    path("invoice/<int:invoice_id>/stream/", views.stream),
    path("checkout/", views.checkout),
    path("export/<slug:fmt>/", views.export),
    path("limited/<int:n>/", views.checkout),
    path("together/<int:n>/", views.together),
    path("checkout/async/", views.acheckout),  # type: ignore[arg-type]
    path("shop/<slug:shop>/checkout/", views.checkout),
]
