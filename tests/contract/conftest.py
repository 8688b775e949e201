from __future__ import annotations

import pytest

from ..helpers import give_back_sessions


@pytest.fixture(autouse=True)
def _nothing_left_behind():
    yield
    give_back_sessions()  # every test gives back what it took
