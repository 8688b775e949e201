from __future__ import annotations

from django.apps import AppConfig


class DLockConfig(AppConfig):
    name = "django_dlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # checks registers the system checks
        from django_dlock import checks, metrics  # noqa: F401

        metrics.configure()  # DLOCK_METRICS
