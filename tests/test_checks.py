from __future__ import annotations

import pytest
from django.test import override_settings

from django_dlock.checks import check_settings


def ids(**settings):
    with override_settings(**settings):
        return [e.id for e in check_settings()]


def test_defaults_pass():
    assert ids() == []


@pytest.mark.parametrize(
    ("setting", "value", "check_id"),
    [
        ("DLOCK_DEFAULT_STRATEGY", "zookeeper", "dlock.E001"),
        ("DLOCK_DEFAULT_TTL", 0, "dlock.E002"),
        ("DLOCK_DEFAULT_TTL", "30", "dlock.E002"),
        ("DLOCK_DEFAULT_TIMEOUT", -1, "dlock.E003"),
        ("DLOCK_RETRY_INTERVAL", float("inf"), "dlock.E004"),
        ("DLOCK_RETRY_INTERVAL", "fast", "dlock.E004"),
        ("DLOCK_LEASE_SYNCHRONOUS_COMMIT", "off", "dlock.E005"),
    ],
)
def test_each_bad_setting_has_its_check(setting, value, check_id):
    assert ids(**{setting: value}) == [check_id]


def test_good_values_pass():
    assert (
        ids(
            DLOCK_DEFAULT_TTL=5,
            DLOCK_DEFAULT_TIMEOUT=None,
            DLOCK_RETRY_INTERVAL=lambda attempt: 0.01 * 2**attempt,
        )
        == []
    )
