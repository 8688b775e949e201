"""How ``dlock_selfcheck`` reads PostgreSQL's duration settings: pure parsing, no database."""

from __future__ import annotations

import pytest

from django_dlock.selfcheck import _seconds


@pytest.mark.parametrize(
    ("shown", "seconds"),
    [("10s", 10.0), ("500ms", 0.5), ("1min", 60.0), ("2h", 7200.0), ("1d", 86400.0), ("0", 0.0)],
)
def test_a_duration_setting_is_read_in_its_unit(shown, seconds):
    assert _seconds(shown) == seconds


def test_an_unreadable_setting_counts_as_the_default_reply_interval():
    assert _seconds("soon") == 10.0
