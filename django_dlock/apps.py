from __future__ import annotations

from django.apps import AppConfig


class DLockConfig(AppConfig):
    name = "django_dlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django_dlock import checks  # noqa: F401  (registers the system checks)
