"""The built distributions: what a user installs has the license, the type
marker, the migrations, the admin templates and the metadata that describes
the project.

The wheel is built with ``pip wheel --no-deps`` (``python -m build`` when it
is installed), the sdist with ``python -m build`` or, without it, with the
setuptools that pyproject.toml asks for, installed into a temporary folder.
Both build from a copy of the files a release ships, so the checkout gets no
``build/`` or ``*.egg-info`` folders.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

SHIPPED = ["pyproject.toml", "README.md", "LICENSE", "django_dlock"]


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Build a wheel and an sdist from a clean copy of the project."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    src.mkdir()
    for name in SHIPPED:
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    out = tmp / "dist"
    if importlib.util.find_spec("build") is not None:
        run(sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", out, src, cwd=tmp)
    else:
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src, cwd=tmp)
        # The sdist with the build backend pyproject.toml names.
        pyproject = (src / "pyproject.toml").read_text()
        build_system = re.search(r"^requires = \[(.*?)\]", pyproject, re.MULTILINE | re.DOTALL)
        assert build_system is not None
        requires = re.findall(r'"([^"]+)"', build_system.group(1))
        backend = tmp / "backend"
        run(sys.executable, "-m", "pip", "install", "-q", "--target", backend, *requires, cwd=tmp)
        run(
            sys.executable,
            "-c",
            f"import setuptools.build_meta as b; b.build_sdist({str(out)!r})",
            cwd=src,
            env={"PYTHONPATH": str(backend)},
        )
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def metadata(wheel: Path) -> tuple[list[str], dict[str, list[str]]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        msg = Parser().parsestr(zf.read(meta).decode())
    return names, {key: msg.get_all(key) or [] for key in set(msg.keys())}


def test_the_wheel_has_the_license_types_migrations_and_templates(dists):
    names, _ = metadata(dists["wheel"])
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "django_dlock/py.typed" in names
    migrations = {n for n in names if n.startswith("django_dlock/migrations/")}
    assert "django_dlock/migrations/__init__.py" in migrations
    assert "django_dlock/migrations/0001_initial.py" in migrations
    shipped = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "django_dlock/migrations").glob("*.py")
    }
    assert shipped <= migrations
    templates = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "django_dlock/templates").rglob("*.html")
    }
    assert templates and templates <= set(names)
    assert "django_dlock/management/commands/dlock_show.py" in names
    assert not [n for n in names if n.startswith(("tests/", "testproject/"))]


def test_the_wheel_metadata(dists):
    _, meta = metadata(dists["wheel"])
    classifiers = set(meta["Classifier"])
    assert "Development Status :: 3 - Alpha" in classifiers
    assert "Framework :: Django" in classifiers
    assert {"Framework :: Django :: 4.2", "Framework :: Django :: 5.2"} <= classifiers
    assert "Typing :: Typed" in classifiers
    # One classifier per Python version from requires-python's lowest on.
    assert meta["Requires-Python"] == [">=3.10"]
    versions = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert {"3.10", "3.11", "3.12", "3.13"} <= versions
    assert all(tuple(map(int, v.split("."))) >= (3, 10) for v in versions)
    assert meta["License-Expression"] == ["MIT"]
    assert meta["License-File"] == ["LICENSE"]
    urls = {u.split(",", 1)[0].strip().lower() for u in meta["Project-URL"]}
    assert {"documentation", "source", "changelog"} <= urls
    extras = set(meta["Provides-Extra"])
    assert {"celery", "prometheus", "demo"} <= extras


def test_the_sdist_has_the_license_and_the_package_data(dists):
    with tarfile.open(dists["sdist"]) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "django_dlock/py.typed"} <= names
    assert "django_dlock/migrations/0001_initial.py" in names
    assert "django_dlock/templates/admin/django_dlock/lock/change_list.html" in names


def _install_commands() -> list[str]:
    """The commands of getting-started's first install block, as written."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", page, re.DOTALL)
    assert block is not None
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_the_first_install_block_offers_an_editable_mode_mypy_follows():
    commands = _install_commands()
    assert "pip install ." in commands
    assert "pip install -e . --config-settings editable_mode=strict" in commands
    assert "pip install -e ." not in commands  # setuptools' import hook: mypy sees Any


@pytest.mark.parametrize(
    "command", [*_install_commands(), "pip install -e ."], ids=lambda c: c.replace(" ", "_")
)
def test_mypy_strict_sees_the_types_after_the_documented_install(command, tmp_path):
    """``pip install -e .`` (setuptools' editable finder) left mypy --strict
    with "Cannot find implementation" and ``django_dlock`` as ``Any``."""
    import sysconfig

    project = tmp_path / "checkout"
    project.mkdir()
    for name in SHIPPED:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, project / name)
    venv = tmp_path / "venv"
    run(sys._base_executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    (site,) = (venv / "lib").glob("python3*/site-packages")
    # Django, mypy and its stubs from this environment; not its django_dlock
    # (a .pth line adds a folder to the path without reading its .pth files)
    (site / "tests-base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    words = command.split()
    assert words[:2] == ["pip", "install"]
    # a user's environment: django_dlock only where the install put it
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    result = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", *words[2:]],
        cwd=project,
        env=clean,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (tmp_path / "use.py").write_text("import django_dlock as dlock\n\nreveal_type(dlock.lock)\n")
    result = subprocess.run(
        [python, "-m", "mypy", "--strict", "--no-incremental", "use.py"],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if command == "pip install -e .":  # the mode the page warns about: still so?
        assert 'Revealed type is "Any"' in result.stdout, result.stdout
        return
    assert result.returncode == 0, result.stdout + result.stderr
    assert "django_dlock.locks.Lock[Literal['raise']]" in result.stdout
