"""The API reference's signatures show what a user passes (no database).

mkdocstrings renders the signatures from Griffe's view of the package, with
the extension in tools/griffe_sphinx_roles.py (mkdocs.yml). The reference
once showed ``= UNSET`` (the internal sentinel) six times and
``timeout=self.timeout``: neither is something a caller can write.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra (pip install -e '.[docs]')")

ROOT = Path(__file__).resolve().parent.parent.parent


def _documented_paths() -> list[str]:
    page = (ROOT / "docs" / "api.md").read_text()
    return re.findall(r"^::: ([\w.]+)", page, re.MULTILINE)


def _functions(obj, seen=None):
    seen = set() if seen is None else seen
    target = obj.final_target if obj.is_alias else obj
    if target.path in seen:
        return
    seen.add(target.path)
    if target.is_function:
        yield target
    for member in target.members.values():
        if member.name.startswith("_") and member.name != "__init__":
            continue
        try:
            yield from _functions(member, seen)
        except griffe.AliasResolutionError:
            continue


def test_no_signature_shows_the_sentinel_or_an_expression_of_self():
    extensions = griffe.load_extensions(str(ROOT / "tools" / "griffe_sphinx_roles.py:SphinxRoles"))
    package = griffe.load(
        "django_dlock", search_paths=[str(ROOT)], extensions=extensions, resolve_aliases=True
    )
    shown = {}
    for path in _documented_paths():
        obj = package[path.removeprefix("django_dlock.")] if path != "django_dlock" else package
        for function in _functions(obj):
            for number, signature in enumerate([function, *(function.overloads or [])]):
                for parameter in signature.parameters:
                    if parameter.default is not None:
                        where = f"{function.path}#{number}({parameter.name})"
                        shown[where] = str(parameter.default)
    assert shown["django_dlock.locks.Lock.acquire#0(timeout)"] == "..."
    assert shown["django_dlock.locks.lock#3(timeout)"] == "..."  # an overload
    bad = {
        where: default
        for where, default in shown.items()
        if "UNSET" in default or "self." in default
    }
    assert bad == {}
