from __future__ import annotations

import datetime as dt
import secrets

import factory
from django.utils import timezone

from django_dlock.models import Lock


class LockFactory(factory.django.DjangoModelFactory):
    """A lease row. ``held`` (default) expires in an hour, ``expired`` an hour ago."""

    class Meta:
        model = Lock

    class Params:
        expired = factory.Trait(
            expire_at=factory.LazyFunction(lambda: timezone.now() - dt.timedelta(hours=1)),
            token="",
        )

    name = factory.Sequence(lambda n: f"lock:factory-{n}")
    token = factory.LazyFunction(lambda: secrets.token_hex(16))
    owner = "factory host pid=1 thread=MainThread"
    fence = factory.Sequence(lambda n: n + 1)
    acquired_at = factory.LazyFunction(timezone.now)
    expire_at = factory.LazyFunction(lambda: timezone.now() + dt.timedelta(hours=1))
