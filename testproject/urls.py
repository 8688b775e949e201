from __future__ import annotations

from django.contrib import admin
from django.urls import path

from testproject.demo import views

urlpatterns = [
    path("", views.index),
    path("invoices/<int:invoice_id>/pay/", views.pay_invoice),
    path("catalog/sync/", views.sync_catalog),
    path("reports/nightly/", views.nightly_report),
    path("checkout/", views.CheckoutView.as_view()),
    path("admin/", admin.site.urls),
]
