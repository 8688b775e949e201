"""One strategy name, an implementation per database vendor.

``lock(strategy="advisory")`` means PostgreSQL's session advisory locks on
PostgreSQL (:mod:`django_dlock.strategies.advisory.postgresql`) and ``GET_LOCK`` user
locks on MySQL/MariaDB (:mod:`django_dlock.strategies.advisory.mysql`). The
object registered under the name picks the implementation from the vendor
of the request's database alias, so the front object and everything above
it see a single strategy.
"""

from __future__ import annotations

from importlib import import_module

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_dlock.conf import RetryInterval
from django_dlock.exceptions import StrategyNotSupported
from django_dlock.keys import Key
from django_dlock.retry import Deadline
from django_dlock.strategies._pg import require_psycopg3
from django_dlock.strategies.base import Grant, Request, Strategy


class ByVendor:
    """A strategy that delegates to the implementation for the alias's vendor."""

    def __init__(self, name: str, family: str, implementations: dict[str, str]) -> None:
        self.name = name
        self.family = family
        #: vendor -> "module:attribute", imported on first use
        self.implementations = implementations
        self._loaded: dict[str, Strategy] = {}
        #: ENGINE setting -> vendor (``connections[alias]`` costs a thread-local lookup)
        self._vendors: dict[str, str] = {}

    def _vendor_names(self) -> str:
        names = {"postgresql": "PostgreSQL", "mysql": "MySQL/MariaDB"}
        return " or ".join(names.get(v, v) for v in self.implementations)

    def for_vendor(self, vendor: str) -> Strategy | None:
        """The implementation for ``vendor`` (``None`` if there is none)."""
        found = self._loaded.get(vendor)
        if found is None:
            path = self.implementations.get(vendor)
            if path is None:
                return None
            module, _, attribute = path.partition(":")
            found = self._loaded[vendor] = getattr(import_module(module), attribute)
        return found

    def _vendor(self, alias: str) -> str:
        database = connections.settings.get(alias)
        if database is None:
            return connections[alias].vendor  # raises ConnectionDoesNotExist
        engine = database["ENGINE"]
        vendor = self._vendors.get(engine)
        if vendor is None:
            vendor = self._vendors[engine] = connections[alias].vendor
        return vendor

    def _for(self, alias: str) -> Strategy:
        vendor = self._vendor(alias)
        if vendor == "postgresql":  # its sessions are psycopg 3 connections of its own
            require_psycopg3(f"the {self.name} strategy on PostgreSQL")
        found = self.for_vendor(vendor)
        if found is None:
            raise StrategyNotSupported(
                f"the {self.name} strategy needs {self._vendor_names()}; database {alias!r} is "
                f"{vendor}: use the lease strategy"
            )
        return found

    #: advisory locks are session-level on every vendor
    transaction_scoped = False
    leased = False

    def ended(self, req: Request) -> bool:
        return False  # a session lock ends only when released or its session ends

    def check_supported(self, connection: BaseDatabaseWrapper) -> None:
        self._for(connection.alias).check_supported(connection)

    def implementation(self, alias: str) -> Strategy:
        """The implementation for ``alias``'s database (:class:`StrategyNotSupported` if none)."""
        return self._for(alias)

    def acquire(self, req: Request, deadline: Deadline, policy: RetryInterval) -> Grant | None:
        return self._for(req.alias).acquire(req, deadline, policy)

    async def aacquire(
        self, req: Request, deadline: Deadline, policy: RetryInterval
    ) -> Grant | None:
        return await self._for(req.alias).aacquire(req, deadline, policy)

    def try_acquire(self, req: Request) -> int | None:
        return self._for(req.alias).try_acquire(req)

    def release(self, req: Request) -> bool:
        return self._for(req.alias).release(req)

    def extend(self, req: Request, ttl: float) -> bool:
        return self._for(req.alias).extend(req, ttl)

    def locked(self, alias: str, key: Key) -> bool:
        return self._for(alias).locked(alias, key)

    def owned(self, req: Request) -> bool:
        return self._for(req.alias).owned(req)

    def loss_reason(self, req: Request) -> str | None:
        return self._for(req.alias).loss_reason(req)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}: {', '.join(self.implementations)}>"


advisory = ByVendor(
    "advisory",
    "advisory",
    {
        "postgresql": "django_dlock.strategies.advisory.postgresql:advisory",
        "mysql": "django_dlock.strategies.advisory.mysql:advisory_mysql",
    },
)
_implements_strategy: Strategy = advisory  # (checked by mypy)
