"""The package's layers, read from its source (no database, nothing imported).

* Nothing below ``locks.py`` imports it: the modules ``locks.py`` builds on
  (what it imports, and what those import, all the way down) take values
  handed down to them and never reach back up into ``Lock``.
* No import cycle at run time: module-level and function-level imports,
  ``if TYPE_CHECKING:`` blocks aside, form no loop.
* Generic code asks strategies for capabilities, never for a concrete class
  or a strategy's name: outside ``strategies/`` no module names a concrete
  strategy class or compares a strategy name with ``"lease"``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "django_dlock"


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {
    _name(path): path for path in sorted(PACKAGE.rglob("*.py")) if "migrations" not in path.parts
}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(body: list[ast.stmt], runtime: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if runtime and _type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _import_nodes([child], runtime)
            elif isinstance(child, ast.excepthandler):
                yield from _import_nodes(child.body, runtime)


def imports(module: str, *, runtime: bool) -> set[str]:
    """The package modules ``module`` imports (``runtime``: TYPE_CHECKING blocks aside)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text()).body, runtime):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        for alias in node.names:
            full = f"{base}.{alias.name}"
            found.add(full if full in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


def _below(module: str) -> set[str]:
    """Every package module ``module`` builds on, however deep."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        for name in imports(todo.pop(), runtime=False):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_the_reader_sees_the_imports_it_must_see():
    # a guard for the guards below: if the reader missed imports they would pass
    assert "django_dlock.acquiring" in imports("django_dlock.locks", runtime=True)
    assert "django_dlock.locks" in imports("django_dlock.tasklock", runtime=True)
    assert "django_dlock.holdings" in imports("django_dlock.identity", runtime=False)
    assert "django_dlock.holdings" not in imports("django_dlock.identity", runtime=True)


def test_nothing_below_locks_imports_it():
    below = _below("django_dlock.locks")
    assert {"django_dlock.acquiring", "django_dlock.two_phase", "django_dlock.metrics"} <= below
    reaching_up = sorted(
        name for name in below if "django_dlock.locks" in imports(name, runtime=False)
    )
    assert reaching_up == []
    assert "django_dlock.locks" not in below


def test_no_import_cycle_at_run_time():
    graph = {name: imports(name, runtime=True) for name in MODULES}
    cycles = []
    for start in graph:
        # a path from a module back to itself
        todo, seen = [(start, (start,))], set()
        while todo:
            name, path = todo.pop()
            for found in graph[name]:
                if found == start:
                    cycles.append(" -> ".join((*path, start)))
                elif found not in seen:
                    seen.add(found)
                    todo.append((found, (*path, found)))
    assert cycles == []


CONCRETE = re.compile(
    r"\b(LeaseStrategy|AdvisoryStrategy|MySQLAdvisory\w*|RowStrategy|XactStrategy|QuorumLease)\b"
)
NAME_TEST = re.compile(r"""[!=]=\s*["']lease["']|["']lease["']\s*[!=]=""")


def _asks_for_a_class(tree: ast.Module) -> Iterator[ast.AST]:
    """``isinstance(x, <a concrete strategy>)`` calls and subclasses of one."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance":
            if len(node.args) == 2 and CONCRETE.search(ast.unparse(node.args[1])):
                yield node
        elif isinstance(node, ast.ClassDef) and any(
            CONCRETE.search(ast.unparse(base)) for base in node.bases
        ):
            yield node


def test_generic_code_asks_for_capabilities_not_classes_or_names():
    found = []
    for name, path in MODULES.items():
        if name.startswith("django_dlock.strategies"):
            continue
        source = path.read_text()
        where = path.relative_to(PACKAGE.parent)
        found += [f"{where}:{node.lineno}" for node in _asks_for_a_class(ast.parse(source))]
        for number, line in enumerate(source.splitlines(), 1):
            if NAME_TEST.search(line):
                found.append(f"{where}:{number}: {line.strip()}")
    assert found == []


def test_the_class_test_sees_a_class_test():
    tree = ast.parse("class Held(LeaseStrategy): ...\nisinstance(s, LeaseStrategy)\n")
    assert len(list(_asks_for_a_class(tree))) == 2
    assert NAME_TEST.search('if strategy != "lease":')
