from __future__ import annotations

from django.apps import AppConfig


class DLockConfig(AppConfig):
    name = "django_dlock"
    verbose_name = "Distributed locks"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # checks registers the system checks
        from django_dlock import checks, metrics, tracing  # noqa: F401

        metrics.configure()  # DLOCK_METRICS
        tracing.configure()  # DLOCK_TRACING

        from django.core.signals import setting_changed

        from django_dlock import identity

        identity.load_holder_info()  # DLOCK_HOLDER_INFO
        setting_changed.connect(identity.load_holder_info, dispatch_uid="django_dlock.holder_info")
