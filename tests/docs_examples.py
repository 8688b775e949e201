"""The examples in README.md and docs/*.md run as tests (with Sybil).

``pytest`` collects README.md and every page under docs/ (see ``testpaths``
in pyproject.toml; the root ``conftest.py`` wires this module in). Each
fenced block is one test:

* ``python`` (or ``py``) blocks run in order, in one namespace per page, as a user
  would run them one after the other. There is no top-level ``await``:
  show how async code runs (``async def main(): ...`` and
  ``asyncio.run(main())``), as a user's script would.
* ``bash``, ``sh``, ``shell`` and ``console`` blocks run in bash from the
  repository root, with ``DJANGO_SETTINGS_MODULE=tests.settings`` on the
  test databases. Only ``python manage.py <command>`` / ``django-admin
  <command>`` for the commands in :data:`SAFE_COMMANDS` (and harmless shell
  words: ``echo``, ``test``, ...) may run; a block with anything else
  (``pip install``, ``apt-get``, ``runserver``) fails until it is marked
  partial (below). In ``console`` blocks only ``$ `` lines are commands.
* Other languages (``text``, ``sql``, ``ini``, ``yaml``, a bare fence) are
  not run.

Markers are HTML comments, invisible on the site:

* ``<!-- skip: next "reason" -->`` right before a fence: the example is
  deliberately partial (the test is reported as skipped with the reason).
  Say so on the page too ("a partial example: ...").
  ``<!-- skip: start "reason" -->`` ... ``<!-- skip: end -->`` marks a run.
* ``<!-- docs-test: database=sqlite -->`` anywhere on a page: its examples
  run with the ``django_dlock`` models routed to that database:
  ``postgresql`` (the default), ``sqlite`` or ``mariadb``.
* ``<!-- invisible-code-block: python ... -->`` runs setup code that the
  reader does not see (a Sybil feature); use it sparingly.

Every page's namespace starts with the stubs in :data:`STUBS`: the obvious
application functions the examples call (``charge``, ``ship``,
``sync_catalog``, ...). Each accepts any arguments, returns ``None`` and may
be awaited. Add a name to :data:`STUB_NAMES` when a new example needs one.

An example may run for :data:`EXAMPLE_TIME_LIMIT` seconds (a hang fails
with ``TimeoutError``).

Examples get transactional access to the page's test database (locks use
connections of their own, so a test transaction would hide their rows);
lock rows are deleted after each example.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent

#: page marker value -> database alias of tests/settings.py
DATABASES = {"postgresql": "default", "sqlite": "sqlite", "mariadb": "mysql", "mysql": "mysql"}
PAGE_MARKER = re.compile(r"<!--\s*docs-test:\s*database=(\w+)\s*-->")

#: manage.py commands that are quick and safe to run against the test databases
SAFE_COMMANDS = {
    "check",
    "migrate",
    "showmigrations",
    "sqlmigrate",
    "dlock_list",
    "dlock_show",
    "dlock_release",
    "dlock_cleanup",
}
#: shell words that may appear in a runnable block besides manage.py
SAFE_WORDS = {"echo", "test", "true", "false", "[", "grep", "head", "tail", "wc", "cat"}

STUB_NAMES = [
    "charge",
    "ship",
    "sync_catalog",
    "send_digest_emails",
    "rebuild_index",
    "refresh_cache",
    "do_work",
    "work",
    "process",
    "process_batch",
    "import_feed",
    "render_report",
    "write_to_storage",
    "publish",
    "recompute_totals",
    "update_inventory",
    "send_reminders",
    "send_email",
    "generate_report",
    "export_day",
    "sync_inventory",
    "call_external_api",
    "save_result",
    "list_products",
    "update_prices",
]


class Stub:
    """An application function the docs call: takes anything, does nothing."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> _Done:
        self.calls.append((args, kwargs))
        return _Done()

    def __repr__(self) -> str:
        return f"<docs stub {self.name}>"


class _Done:
    """A stub's result: ``None``-like, and awaitable for async examples."""

    def __await__(self) -> Iterator[None]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "None"


def STUBS() -> dict[str, Stub]:  # noqa: N802 (a table, built fresh per page)
    return {name: Stub(name) for name in STUB_NAMES}


def page_database(text: str) -> str:
    """The alias a page's examples run on (its ``docs-test`` marker)."""
    found = PAGE_MARKER.search(text)
    if found is None:
        return "default"
    name = found.group(1).lower()
    if name not in DATABASES:
        raise ValueError(
            f"docs-test marker names database {name!r}; use one of {', '.join(DATABASES)}"
        )
    return DATABASES[name]


# -- python ---------------------------------------------------------------------


def evaluate_python(example: Example) -> None:
    """Run a Python block as a module runs it (no top-level ``await``)."""
    __tracebackhide__ = True
    source = "\n" * (example.line + example.parsed.line_offset) + str(example.parsed)
    try:
        code = compile(source, example.path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        if "outside" in str(exc) and ("await" in str(exc) or "async" in str(exc)):
            raise SyntaxError(
                f"{exc}: show how async code runs, e.g. `async def main(): ...` "
                "then `asyncio.run(main())`, or mark the block partial"
            ) from None
        raise
    with time_limit(EXAMPLE_TIME_LIMIT, f"{example.path}:{example.line}"):
        exec(code, example.namespace)
    example.namespace.pop("__builtins__", None)


#: seconds an example may run: a docs example is quick, a hang is a bug
EXAMPLE_TIME_LIMIT = 60


@contextlib.contextmanager
def time_limit(seconds: int, where: str) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{where}: the example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- shell ----------------------------------------------------------------------


def shell_commands(block: str, console: bool) -> list[str]:
    """The commands of a shell block (``console``: only ``$`` lines)."""
    lines: list[str] = []
    pending = ""
    for raw in block.splitlines():
        line = raw.rstrip()
        if console:
            if pending:
                pass
            elif line.startswith("$ "):
                line = line[2:]
            else:
                continue  # output
        if pending:
            line = pending.rstrip() + " " + line.lstrip()
            pending = ""
        if line.endswith("\\"):
            pending = line[:-1]
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            lines.append(line)
    return lines


def unsafe_parts(command: str) -> list[str]:
    """The parts of ``command`` that the docs tests refuse to run."""
    refused = []
    for part in re.split(r"&&|\|\||;|\|", command):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:
            refused.append(part.strip())
            continue
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            words = words[1:]  # VAR=value prefix
        if not words:
            continue
        if words[0] in SAFE_WORDS:
            continue
        if words[0] == "python" and words[1:2] == ["manage.py"] and words[2:3]:
            if words[2] in SAFE_COMMANDS:
                continue
        elif words[0] == "django-admin" and words[1:2] and words[1] in SAFE_COMMANDS:
            continue
        refused.append(part.strip())
    return refused


def evaluate_shell(example: Example) -> None:
    __tracebackhide__ = True
    language = example.region.lexemes["arguments"]
    commands = shell_commands(str(example.parsed), console=language == "console")
    refused = [part for command in commands for part in unsafe_parts(command)]
    if refused:
        raise AssertionError(
            f"{example.path}:{example.line}: the docs tests do not run {refused!r}. Run only "
            "`python manage.py <command>` for quick, safe commands "
            f"({', '.join(sorted(SAFE_COMMANDS))}), or mark the block as partial with "
            '<!-- skip: next "why it does not run here" --> right before it '
            "(and say on the page that it is partial)."
        )
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DLOCK_TEST_CHILD="1",  # the test databases, see tests/settings.py
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    script = "set -euo pipefail\n" + "\n".join(commands) + "\n"
    done = subprocess.run(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIME_LIMIT,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{example.path}:{example.line}: exit status {done.returncode}\n"
            f"$ {shlex.join(['bash', '-c', script])}\n{done.stdout}{done.stderr}"
        )


# -- wiring ---------------------------------------------------------------------


def _setup(namespace: dict[str, Any]) -> None:
    namespace.update(STUBS())


def _teardown(namespace: dict[str, Any]) -> None:
    # Signal receivers that a page connected are weakly referenced: they go
    # with the page's namespace, and cannot fire in later tests.
    namespace.clear()
    gc.collect()


SHELLS = ("bash", "sh", "shell", "console")


class PythonBlocks(PythonCodeBlockParser):
    """``python`` blocks through :func:`evaluate_python`; ``>>>`` blocks as doctests."""

    def __init__(self, language: str = "python") -> None:
        super().__init__()
        self.codeblock_parser = CodeBlockParser(language, evaluate_python)


sybil = Sybil(
    parsers=[
        PythonBlocks("python"),
        PythonBlocks("py"),
        *(CodeBlockParser(language, evaluate_shell) for language in SHELLS),
        SkipParser(),
    ],
    path=str(ROOT),
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    setup=_setup,
    teardown=_teardown,
    fixtures=["docs_example_db"],
    name="docs",
)

pytest_collect_file = sybil.pytest()


def is_docs_item(item: pytest.Item) -> bool:
    example = getattr(item, "example", None)
    return example is not None and hasattr(example, "document")


def mark_docs_items(items: list[pytest.Item]) -> None:
    """Give each docs example transactional access to its page's database."""
    for item in items:
        if is_docs_item(item):
            alias = page_database(item.example.document.text)  # type: ignore[attr-defined]
            databases = sorted({"default", alias})
            item.add_marker(pytest.mark.django_db(transaction=True, databases=databases))


def partial_examples(items: list[pytest.Item]) -> tuple[set[pytest.Item], dict[str, str]]:
    """The code examples that a ``skip`` marker declares partial, and misplaced markers.

    A ``skip: next`` marker must stand right before the fence it marks: a
    marker before a block that does not run (``sql``, ``text``) would
    otherwise silently skip the next runnable example of the page.
    """
    partial: set[pytest.Item] = set()
    misplaced: dict[str, str] = {}
    marker: pytest.Item | None = None
    once = False
    for item in items:
        if not is_docs_item(item):
            continue
        example = item.example  # type: ignore[attr-defined]
        if marker is not None and marker.example.document is not example.document:  # type: ignore[attr-defined]
            if once:
                misplaced[marker.nodeid] = "it is followed by no runnable example"
            marker, once = None, False
        if isinstance(example.region.parsed, tuple):  # a skip marker: (action, reason)
            action = example.region.parsed[0]
            marker, once = (
                (item, action == "next") if action in ("start", "next") else (None, False)
            )
            continue
        if marker is not None:
            if once:
                between = example.document.text[marker.example.region.end : example.region.start]  # type: ignore[attr-defined]
                if between.replace("-->", "").strip():
                    misplaced[marker.nodeid] = (
                        f"the next runnable example is at line {example.line}, not right "
                        "after the marker (blocks in sql, text, ... are not run: no marker)"
                    )
                marker, once = None, False
            partial.add(item)
    if marker is not None and once:
        misplaced[marker.nodeid] = "it is followed by no runnable example"
    return partial, misplaced


def is_code_example(item: pytest.Item) -> bool:
    return is_docs_item(item) and not isinstance(item.example.region.parsed, tuple)  # type: ignore[attr-defined]


class _RouteTo:
    """Routes every model to one database (a page's ``docs-test`` database)."""

    alias = "default"

    def db_for_read(self, model: type, **hints: Any) -> str:
        return self.alias

    def db_for_write(self, model: type, **hints: Any) -> str:
        return self.alias

    def allow_relation(self, obj1: object, obj2: object, **hints: Any) -> bool:
        return True


class RouteSqlite(_RouteTo):
    alias = "sqlite"


class RouteMysql(_RouteTo):
    alias = "mysql"
