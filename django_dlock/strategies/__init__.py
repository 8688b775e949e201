"""The strategy registry: one table, name -> database vendor -> implementation.

``lock(strategy="advisory")`` names a way of locking; which code does it
depends on the database: PostgreSQL's session advisory locks on PostgreSQL,
``GET_LOCK`` user locks on MySQL/MariaDB. :data:`REGISTRY` says it once
for every strategy, and :func:`supported` resolves a name on a database
alias to the implementation that acts there, checked once per engine.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from django_dlock.exceptions import StrategyNotSupported
from django_dlock.validation import strategy_error

if TYPE_CHECKING:
    from django_dlock.exceptions import SemaphoreNotSupported
    from django_dlock.strategies.base import Strategy

__all__ = [
    "REGISTRY",
    "counts_permits",
    "implementation",
    "no_permits",
    "supported",
    "traits",
    "with_permits",
]

#: ``"*"``: one implementation for every database (it checks which it can do)
ANY = "*"

#: name -> vendor -> "module:attribute", imported on first use
REGISTRY: dict[str, dict[str, str]] = {
    "lease": {ANY: "django_dlock.strategies.lease:lease"},
    "advisory": {
        "postgresql": "django_dlock.strategies.advisory.postgresql:advisory",
        "mysql": "django_dlock.strategies.advisory.mysql:advisory_mysql",
    },
    "advisory_xact": {ANY: "django_dlock.strategies.xact:advisory_xact"},
    "row": {ANY: "django_dlock.strategies.row:row"},
}

_VENDOR_NAMES = {"postgresql": "PostgreSQL", "mysql": "MySQL/MariaDB", "sqlite": "SQLite"}

_loaded: dict[str, Strategy] = {}


def _vendors(name: str) -> dict[str, str]:
    problem = strategy_error(name)
    if problem is not None:
        raise StrategyNotSupported(problem)
    found = REGISTRY.get(name)
    if found is None:
        raise StrategyNotSupported(f"the {name!r} strategy is not available in this version")
    return found


def implementation(name: str, vendor: str) -> Strategy:
    """The implementation of the strategy ``name`` on a database of ``vendor``.

    Raises:
        StrategyNotSupported: the name is unknown, or that database has none.
    """
    vendors = _vendors(name)
    path = vendors.get(vendor) or vendors.get(ANY)
    if path is None:
        needs = " or ".join(_VENDOR_NAMES.get(each, each) for each in vendors)
        raise StrategyNotSupported(
            f"the {name} strategy needs {needs}; a {_VENDOR_NAMES.get(vendor, vendor)} "
            "database has no such locks: use the lease strategy"
        )
    found = _loaded.get(path)
    if found is None:
        module, _, attribute = path.partition(":")
        try:
            loaded = import_module(module)
        except ImportError:
            if vendor == "postgresql":  # sessions of its own need psycopg 3
                from django_dlock.strategies._pg import require_psycopg3

                require_psycopg3(f"the {name} strategy on PostgreSQL")
            raise
        found = _loaded[path] = getattr(loaded, attribute)
    return found


#: (strategy name, alias, ENGINE) -> the implementation, its support for that database checked
_SUPPORTED: dict[tuple[str, str, Any], Strategy] = {}


def supported(name: str, alias: str) -> Strategy:
    """The implementation of the strategy ``name`` on ``alias``, checked once per engine.

    A strategy the database cannot do raises :class:`StrategyNotSupported`
    at every call (nothing is remembered).
    """
    database = connections.settings.get(alias)
    slot = (name, alias, None if database is None else database.get("ENGINE"))
    found = _SUPPORTED.get(slot)
    if found is None:
        if not apps.is_installed("django_dlock"):  # (once: remembered below)
            from django_dlock.conf import NOT_INSTALLED

            raise ImproperlyConfigured(NOT_INSTALLED)
        connection = connections[alias]
        vendors = _vendors(name)
        if connection.vendor not in vendors and ANY not in vendors:
            needs = " or ".join(_VENDOR_NAMES.get(each, each) for each in vendors)
            raise StrategyNotSupported(
                f"the {name} strategy needs {needs}; database {alias!r} is "
                f"{connection.vendor}: use the lease strategy"
            )
        found = implementation(name, connection.vendor)
        found.check_supported(connection)
        _SUPPORTED[slot] = found
    return found


#: strategy name -> (family, transaction-scoped, takes tickets)
_TRAITS: dict[str, tuple[str, bool, bool]] = {}


def traits(name: str) -> tuple[str, bool, bool]:
    """The family of the strategy called ``name``, whether it is transaction-scoped,
    and whether its waiters take tickets in a queue of its own
    (:class:`~django_dlock.strategies.base.TakesTickets`): the same on
    every database."""
    found = _TRAITS.get(name)
    if found is None:
        from django_dlock.strategies.base import TakesTickets

        strategy = _any_implementation(name)
        found = _TRAITS[name] = (
            strategy.family,
            strategy.transaction_scoped,
            isinstance(strategy, TakesTickets),
        )
    return found


def counts_permits(name: str) -> bool:
    """Whether the strategy called ``name`` can hand out several holdings of
    one key (:class:`~django_dlock.strategies.base.CountsPermits`): a semaphore."""
    from django_dlock.strategies.base import CountsPermits

    return isinstance(_any_implementation(name), CountsPermits)


def no_permits(name: str) -> SemaphoreNotSupported:
    """The error for a semaphore asked of the strategy ``name``, which cannot count permits."""
    from django_dlock.exceptions import SemaphoreNotSupported

    return SemaphoreNotSupported(
        f"the {name} strategy cannot count permits: a semaphore needs the lease "
        "strategy (strategy='lease')"
    )


def with_permits(strategy: Strategy, permits: int) -> Strategy:
    """``strategy`` handing out ``permits`` holdings of a key at once (a semaphore).

    Raises:
        SemaphoreNotSupported: the strategy cannot count permits.
    """
    from django_dlock.strategies.base import CountsPermits

    if not isinstance(strategy, CountsPermits):
        raise no_permits(strategy.name)
    module, _, attribute = strategy.permits_by.partition(":")
    made: Strategy = getattr(import_module(module), attribute)(permits)
    return made


#: strategy class -> the strategy that keeps its shared holdings (None: itself)
_FOR_SHARED: dict[type, Strategy | None] = {}


def for_shared(strategy: Strategy) -> Strategy:
    """The strategy that keeps ``strategy``'s shared holdings: ``strategy``
    itself, or the one its :class:`~django_dlock.strategies.base.SharesApart`
    names (answered once per class). Only for a strategy that ``shares``."""
    kind = type(strategy)
    if kind not in _FOR_SHARED:
        from django_dlock.strategies.base import SharesApart

        made: Strategy | None = None
        if isinstance(strategy, SharesApart):
            module, _, attribute = strategy.shared_by.partition(":")
            made = getattr(import_module(module), attribute)
        _FOR_SHARED[kind] = made
    return _FOR_SHARED[kind] or strategy


def _any_implementation(name: str) -> Strategy:
    """An implementation of ``name`` that loads here (their traits are the same;
    one may need a driver this site does not have, as advisory on PostgreSQL)."""
    problem: StrategyNotSupported | None = None
    for vendor in _vendors(name):
        try:
            return implementation(name, vendor)
        except StrategyNotSupported as exc:
            problem = exc
    assert problem is not None
    raise problem


@receiver(setting_changed)
def _forget_supported(setting: str, **kwargs: Any) -> None:
    if setting in ("DATABASES", "INSTALLED_APPS"):
        _SUPPORTED.clear()
