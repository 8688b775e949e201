"""The public API as ``mypy --strict`` sees it from a user's code.

Sample modules are written to a temporary folder and checked together, in
one run of ``mypy.api.run`` with the project's mypy configuration (the
django-stubs plugin and its settings module come from pyproject.toml). The
clean sample must pass without a single error; every other sample holds one
mistake, marked on its line with ``# E: <error code>`` (codes, when mypy
reports more than one there), and must fail with exactly those errors there
and nothing else. The reveal sample checks what
mypy says a decorated function returns.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

HEADER = """\
from __future__ import annotations

import django_dlock as dlock
from django.http import HttpRequest, HttpResponse
from django_dlock.decorators import with_lock
"""

CLEAN = """\
from typing_extensions import Unpack, assert_type

from django_dlock.locks import LockOptions, OnFail


def lost(error: dlock.LockLost) -> None: ...


# every option of lock() and Lock(), by keyword
every = dlock.lock(
    "invoice:42",
    strategy="lease",
    ttl=30,
    timeout=5,
    using="default",
    renew=True,
    max_hold=600,
    reentrant=False,
    retry_interval=0.1,
    on_lost=lost,
    on_fail="raise",
    shared=False,
)
assert_type(every, dlock.Lock[Literal["raise"]])
same = dlock.Lock(
    "invoice:42",
    strategy="lease",
    ttl=30,
    timeout=None,
    using=["a", "b", "c"],
    renew=True,
    max_hold=None,
    reentrant=True,
    retry_interval=lambda attempt: 0.1 * attempt,
    on_lost=None,
    on_fail="skip",
    shared=True,
)
assert_type(same, dlock.Lock[Literal["skip"]])
assert_type(dlock.lock(("order", 42)), dlock.Lock[Literal["raise"]])
assert_type(dlock.lock(timeout=0, on_fail="skip"), dlock.Lock[Literal["skip"]])


def either(lk: dlock.Lock) -> OnFail:  # a plain Lock: a lock of either kind
    return "skip"


either(every)
either(same)
with dlock.lock("invoice:42", timeout=5, ttl=30) as held:
    assert_type(held.fence, int | None)


@dlock.lock
def bare(x: int) -> int:
    return x


@dlock.lock("report", timeout=0)
def raising(x: int) -> int:
    return x


@dlock.lock(timeout=0, on_fail="skip")
def skipped(x: int) -> int:
    return x


@dlock.lock(on_fail="skip")
async def askipped(x: int) -> str:
    return str(x)


@dlock.TaskLock("send-digest", min_hold=300, max_hold=3600, using="default")
def digest(day: str) -> int:
    return 0


class Reports:
    @dlock.lock(timeout=0, on_fail="skip")
    def build(self, day: str) -> bytes:
        return b""


async def main() -> None:
    assert_type(bare(1), int)
    assert_type(raising(1), int)
    assert_type(skipped(1), int | None)
    assert_type(await askipped(1), str | None)
    assert_type(digest("monday"), int | None)
    assert_type(Reports().build("monday"), bytes | None)
    task = dlock.TaskLock("daily-export", min_hold=3600)
    assert_type(task.run(raising, 1), int | None)
    assert_type(await task.arun(askipped, 1), str | None)
    with task as acquired:
        assert_type(acquired, bool)


@with_lock("invoice:{invoice_id}", timeout=5, ttl=30, on_contention="wait", retry_after=2)
def pay_invoice(request: HttpRequest, invoice_id: int) -> HttpResponse:
    return HttpResponse()


election = dlock.LeaderElection("scheduler", lease=15, renew_deadline=10, retry=2)

# every option that lock_and_atomic passes on to the lock
with dlock.lock_and_atomic(
    ("invoice", 42),
    using="default",
    savepoint=False,
    durable=False,
    strategy="advisory_xact",
    ttl=30,
    timeout=10,
    renew=False,
    max_hold=None,
    reentrant=True,
    retry_interval=0.1,
    on_lost=lost,
    shared=False,
) as in_transaction:
    assert_type(in_transaction, dlock.Lock[Literal["raise"]])


@dlock.lock_and_atomic("recompute-totals", strategy="advisory_xact", timeout=10)
def recompute(day: str) -> int:
    return 0


assert_type(recompute("monday"), int)


def my_lock(key: str, **options: Unpack[LockOptions]) -> dlock.Lock[Literal["raise"]]:
    return dlock.lock(f"mine:{key}", **options)


my_lock("invoice", ttl=30, timeout=5)
"""

#: one mistake each, marked ``# E: <code>`` where mypy must report it
MISTAKES = {
    "typo_lock": """\
dlock.lock("x", tll=3)  # E: call-overload
""",
    "typo_lock_class": """\
dlock.Lock("x", timout=3)  # E: call-overload
""",
    "typo_on_fail": """\
dlock.lock("x", on_fail="skp")  # E: call-overload
""",
    "typo_decorator": """\
@dlock.lock(tll=3)  # E: call-overload untyped-decorator
def job() -> None: ...
""",
    "typo_tasklock": """\
dlock.TaskLock("digest", min_hld=300)  # E: call-arg
""",
    "typo_with_lock": """\
with_lock("invoice:{invoice_id}", tiemout=5)  # E: call-arg
""",
    "typo_lock_and_atomic": """\
dlock.lock_and_atomic("x", tll=3)  # E: call-arg
""",
    "lock_and_atomic_cannot_skip": """\
dlock.lock_and_atomic("x", on_fail="skip")  # E: call-arg
""",
    "typo_leader": """\
dlock.LeaderElection("scheduler", leese=15)  # E: call-arg
""",
    "skip_returns_none": """\
@dlock.lock(timeout=0, on_fail="skip")
def job() -> int:
    return 1


total: int = job()  # E: assignment
""",
    "skip_async_returns_none": """\
@dlock.lock(timeout=0, on_fail="skip")
async def job() -> int:
    return 1


async def main() -> int:
    return await job()  # E: return-value
""",
    "tasklock_returns_none": """\
@dlock.TaskLock("digest", min_hold=300)
def job() -> int:
    return 1


job() + 1  # E: operator
""",
    "tasklock_run_arguments": """\
def job(day: str) -> int:
    return 1


dlock.TaskLock("digest").run(job, 1)  # E: arg-type
""",
}

REVEAL = """\
@dlock.lock(timeout=0, on_fail="skip")
def skipped(x: int) -> int:
    return x


@dlock.TaskLock("digest")
def task(x: int) -> int:
    return x


@dlock.lock("report")
def raising(x: int) -> int:
    return x


reveal_type(skipped)
reveal_type(task)
reveal_type(raising)
"""

MESSAGE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<kind>error|note): (?P<text>.*)$")
CODE = re.compile(r"  \[(?P<code>[a-z-]+)\]$")


def source(body: str) -> str:
    """A sample module: the imports, then ``body``."""
    return HEADER + ("from typing import Literal\n\n" if "Literal" in body else "\n") + body


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """mypy's messages per sample: {name: [(line, kind, text, code)]}, and the samples."""
    from mypy import api

    folder = tmp_path_factory.mktemp("typing")
    samples = {"sample_clean": source(CLEAN), "sample_reveal": source(REVEAL)}
    samples.update({f"sample_{name}": source(body) for name, body in MISTAKES.items()})
    for name, text in samples.items():
        (folder / f"{name}.py").write_text(text)
    store = getattr(request.config, "cache", None)  # none with -p no:cacheprovider
    cache = store.mkdir("mypy-typing") if store is not None else folder / ".mypy_cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # mypy finds django_dlock and tests.settings from here
        mp.setenv("DJANGO_SETTINGS_MODULE", "tests.settings")
        stdout, stderr, status = api.run(
            [
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--strict",
                "--cache-dir",
                str(cache),
                "--follow-imports",
                "silent",  # this project's own modules are checked by `mypy django_dlock`
                "--no-error-summary",
                "--no-pretty",
                "--no-color-output",
                "--show-error-codes",
                *(str(folder / f"{name}.py") for name in samples),
            ]
        )
    assert status in (0, 1), f"mypy could not run:\n{stdout}\n{stderr}"
    found: dict[str, list[tuple[int, str, str, str | None]]] = {name: [] for name in samples}
    for line in stdout.splitlines():
        match = MESSAGE.match(line)
        assert match, f"unexpected mypy output: {line!r}"
        name = Path(match["path"]).stem
        assert name in found, f"mypy reported outside the samples: {line}"
        code = CODE.search(match["text"])
        text = CODE.sub("", match["text"])
        found[name].append(
            (int(match["line"]), match["kind"], text, code["code"] if code else None)
        )
    return found, samples


def expected_errors(text: str) -> set[tuple[int, str]]:
    """The ``# E: <code> [<code>...]`` marks of a sample: {(line, code)}."""
    return {
        (number, code)
        for number, line in enumerate(text.splitlines(), start=1)
        if (mark := re.search(r"# E: ([a-z -]+)$", line))
        for code in mark.group(1).split()
    }


def test_the_clean_sample_passes_strict(checked):
    found, _ = checked
    assert found["sample_clean"] == []


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_mistake_fails_with_its_error_code(checked, mistake):
    found, samples = checked
    name = f"sample_{mistake}"
    # (an unknown keyword of an overloaded function is reported twice on its line)
    errors = {(line, code) for line, kind, _, code in found[name] if kind == "error"}
    expected = expected_errors(samples[name])
    assert len({line for line, _ in expected}) == 1  # one mistake
    assert errors == expected, found[name]


@pytest.mark.parametrize(
    ("mistake", "wording"),
    [
        ("typo_lock", 'Unexpected keyword argument "tll" for overloaded function "lock"'),
        ("typo_lock_class", 'Unexpected keyword argument "timout" for overloaded function "Lock"'),
        ("typo_decorator", 'Unexpected keyword argument "tll" for overloaded function "lock"'),
        ("typo_tasklock", 'Unexpected keyword argument "min_hld" for "TaskLock"'),
        ("typo_with_lock", 'Unexpected keyword argument "tiemout" for "with_lock"'),
        ("typo_leader", 'Unexpected keyword argument "leese" for "LeaderElection"'),
        ("typo_lock_and_atomic", 'Unexpected keyword argument "tll" for "lock_and_atomic"'),
        ("lock_and_atomic_cannot_skip", 'Unexpected keyword argument "on_fail"'),
        ("typo_on_fail", 'No overload variant of "lock" matches argument types "str", "str"'),
        ("skip_returns_none", 'expression has type "int | None", variable has type "int"'),
        ("skip_async_returns_none", 'got "int | None", expected "int"'),
        ("tasklock_returns_none", 'Unsupported operand types for + ("None" and "int")'),
        ("tasklock_run_arguments", 'has incompatible type "int"; expected "str"'),
    ],
)
def test_a_mistake_is_reported_for_its_reason(checked, mistake, wording):
    found, _ = checked
    texts = [text for _, kind, text, _ in found[f"sample_{mistake}"] if kind == "error"]
    assert any(wording in text for text in texts), texts


def test_reveal_type_of_decorated_functions(checked):
    found, _ = checked
    notes = [text for _, kind, text, _ in found["sample_reveal"] if kind == "note"]
    assert notes == [
        'Revealed type is "def (x: int) -> int | None"',  # on_fail="skip"
        'Revealed type is "def (x: int) -> int | None"',  # TaskLock
        'Revealed type is "def (x: int) -> int"',  # raises when the key stays held
    ]
