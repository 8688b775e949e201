"""Strategy registry: the name given to ``lock(strategy=...)`` -> implementation."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

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
