"""A Griffe extension for the API reference: Sphinx roles become links.

It also shows an ``UNSET`` default as ``...`` (see :data:`UNSET_SHOWN`).

The docstrings are Google style, and some cross-reference other objects with
Sphinx roles (``:class:`~django_dlock.locks.Lock```, ``:meth:`run```).
mkdocstrings shows those roles as raw text; this extension, loaded by
``mkdocs.yml`` (``extensions`` of the Python handler), turns each into an
optional autorefs cross-reference: a link where the target is documented on
the site, plain code where it is not (no warning either way).
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(class|meth|func|attr|exc|mod|data|obj):`(~?)([^`<>]+)`")
CALLABLE_ROLES = {"meth", "func"}

#: how a signature shows a parameter whose default is the ``UNSET`` sentinel:
#: ``...``, as stub files show a default (the argument may be left out; its
#: docstring says what applies then: the lock's own value, or a setting).
#: Neither ``UNSET`` nor an expression such as ``self.timeout`` is something
#: a user could pass.
UNSET_SHOWN = "..."


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path of ``target`` as seen from ``obj``'s docstring, if known."""
    scopes: list[griffe.Object] = []
    scope: griffe.Object | None = obj
    while scope is not None:
        scopes.append(scope)
        scope = scope.parent
    if target.startswith("."):  # relative to the package of obj's module
        package = obj.module.parent
        return f"{package.path}{target}" if package is not None else None
    head, _, rest = target.partition(".")
    for scope in scopes:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            continue
        return f"{path}.{rest}" if rest else path
    if head == obj.package.name:
        return target
    return None


def _title(role: str, short: bool, target: str) -> str:
    text = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
    if role in CALLABLE_ROLES:
        text += "()"
    return text


def convert(text: str, obj: griffe.Object) -> str:
    """``text`` with every Sphinx role replaced by an optional cross-reference."""

    def replace(match: re.Match[str]) -> str:
        role, short, target = match.group(1), bool(match.group(2)), match.group(3)
        code = f"<code>{html.escape(_title(role, short, target))}</code>"
        path = _resolve(obj, target)
        if path is None:
            return code
        return f'<autoref identifier="{html.escape(path)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of the loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        self._walk(pkg, set())

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value, obj)
        if isinstance(obj, griffe.Function):
            for signature in [obj, *(obj.overloads or [])]:  # (typing.overload's too)
                for parameter in signature.parameters:
                    if str(parameter.default) == "UNSET":
                        parameter.default = UNSET_SHOWN
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
