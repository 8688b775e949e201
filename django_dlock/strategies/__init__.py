"""Strategy registry: the name given to ``lock(strategy=...)`` -> implementation."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from django.core.signals import setting_changed
from django.db import connections
from django.dispatch import receiver

from django_dlock.exceptions import StrategyNotSupported
from django_dlock.validation import strategy_error

if TYPE_CHECKING:
    from django_dlock.strategies.base import Strategy

# name -> "module:attribute", imported on first use
REGISTRY: dict[str, str] = {
    "lease": "django_dlock.strategies.lease:lease",
    "advisory": "django_dlock.strategies.advisory.vendors:advisory",  # PostgreSQL, MySQL/MariaDB
    "advisory_xact": "django_dlock.strategies.xact:advisory_xact",
    "row": "django_dlock.strategies.row:row",
}


_loaded: dict[str, Strategy] = {}


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``.

    Raises:
        StrategyNotSupported: the name is unknown or not available.
    """
    problem = strategy_error(name)
    if problem is not None:
        raise StrategyNotSupported(problem)
    if name not in REGISTRY:
        raise StrategyNotSupported(f"the {name!r} strategy is not available in this version")
    found = _loaded.get(name)
    if found is None:
        module, _, attribute = REGISTRY[name].partition(":")
        found = _loaded[name] = getattr(import_module(module), attribute)
    return found


#: (strategy name, alias, ENGINE) -> the strategy, its support for that database checked
_SUPPORTED: dict[tuple[str, str, Any], Strategy] = {}


def supported(name: str, alias: str) -> Strategy:
    """The strategy ``name`` on ``alias``, checked once per database engine.

    A strategy with one implementation per database (``advisory``: PostgreSQL
    or MySQL/MariaDB) resolves to the one for ``alias``, so that acquire and
    release do not look it up again. A strategy the database cannot do raises
    :class:`StrategyNotSupported` at every call (nothing is remembered).
    """
    database = connections.settings.get(alias)
    slot = (name, alias, None if database is None else database.get("ENGINE"))
    found = _SUPPORTED.get(slot)
    if found is None:
        from django_dlock.strategies.advisory.vendors import ByVendor

        found = get_strategy(name)
        found.check_supported(connections[alias])
        if isinstance(found, ByVendor):
            found = found.implementation(alias)
        _SUPPORTED[slot] = found
    return found


#: strategy name -> (family, transaction-scoped, takes tickets)
_TRAITS: dict[str, tuple[str, bool, bool]] = {}


def traits(name: str) -> tuple[str, bool, bool]:
    """The family of the strategy called ``name``, whether it is transaction-scoped,
    and whether its waiters take tickets in a queue of its own
    (:class:`~django_dlock.strategies.base.TakesTickets`)."""
    found = _TRAITS.get(name)
    if found is None:
        from django_dlock.strategies.base import TakesTickets

        strategy = get_strategy(name)
        found = _TRAITS[name] = (
            strategy.family,
            strategy.transaction_scoped,
            isinstance(strategy, TakesTickets),
        )
    return found


@receiver(setting_changed)
def _forget_supported(setting: str, **kwargs: Any) -> None:
    if setting == "DATABASES":
        _SUPPORTED.clear()
