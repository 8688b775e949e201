"""The docs example harness (tests/docs_examples.py) and the docs site's nav."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_examples import page_database, shell_commands, unsafe_parts

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "command",
    [
        "python manage.py check --database default",
        "python manage.py dlock_list --all",
        'python manage.py dlock_show invoice:42 || echo "exit status $?"',
        "DJANGO_DEBUG=1 python manage.py migrate",
    ],
)
def test_safe_commands_run(command):
    assert unsafe_parts(command) == []


@pytest.mark.parametrize(
    "command",
    [
        "pip install django-dlock",
        'pip install -e ".[dev]" && python manage.py dlock_demo',
        "python manage.py runworker",
        "python manage.py dlock_runworker",
        "python manage.py runserver",
        "echo hi; rm -rf /tmp/x",
        "apt-get install chromium",
    ],
)
def test_other_commands_must_be_marked_partial(command):
    assert unsafe_parts(command) != []


def test_console_blocks_run_only_prompt_lines():
    block = "$ python manage.py dlock_list \\\n    --all\nNAME  STATE\n# a comment\n"
    assert shell_commands(block, console=True) == ["python manage.py dlock_list --all"]
    assert shell_commands("# note\npython manage.py check\n", console=False) == [
        "python manage.py check"
    ]


def test_page_database_marker():
    assert page_database("# Page\n") == "default"
    assert page_database("<!-- docs-test: database=sqlite -->\n# Page") == "sqlite"
    assert page_database("<!-- docs-test: database=mariadb -->") == "mysql"
    with pytest.raises(ValueError, match="oracle"):
        page_database("<!-- docs-test: database=oracle -->")


def test_every_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.MULTILINE))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - listed == set(), "pages missing from mkdocs.yml's nav"
    assert listed - pages == set(), "nav entries without a page"


def _driver_extras() -> set[str]:
    """The extras of pyproject.toml that bring a PostgreSQL driver."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    return {
        name
        for name, requirements in extras.items()
        if any(re.match(r"psycopg(2|\[|>|=|$)", r.replace("-binary", "")) for r in requirements)
    }


def test_a_block_that_runs_on_postgresql_installs_a_driver():
    """getting-started's site on PostgreSQL once installed `.[demo]` only: its
    `migrate` failed with "Error loading psycopg2 or psycopg module"."""
    drivers = _driver_extras()
    assert "postgresql" in drivers
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", page.read_text(), re.S):
            if re.search(r"DATABASE_URL=postgres|createdb ", block) and "pip install" in block:
                blocks.append((page.name, block))
    assert blocks, "the example site on PostgreSQL is in getting-started.md"
    for name, block in blocks:
        installed = set()
        for extras in re.findall(r"pip install[^\n]*?\[([\w,]+)\]", block):
            installed |= set(extras.split(","))
        assert installed & drivers, f"{name}: {block!r} installs no PostgreSQL driver"
