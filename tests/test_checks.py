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


def test_w001_a_misspelt_setting_is_named_with_a_did_you_mean():
    from django_dlock.checks import check_unknown_settings

    with override_settings(DLOCK_DEFAUL_TTL=5, DLOCK_ZZZ=1):
        found = {str(m.msg): m for m in check_unknown_settings()}
    assert set(found) == {
        "DLOCK_DEFAUL_TTL is not a django-dlock setting: it is ignored.",
        "DLOCK_ZZZ is not a django-dlock setting: it is ignored.",
    }
    misspelt = found["DLOCK_DEFAUL_TTL is not a django-dlock setting: it is ignored."]
    assert misspelt.id == "dlock.W001"
    assert misspelt.hint == "Did you mean DLOCK_DEFAULT_TTL?"


def test_w001_every_documented_setting_is_known():
    import re
    from pathlib import Path

    from django_dlock.checks import check_unknown_settings
    from django_dlock.conf import KNOWN_SETTINGS

    page = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(DLOCK_[A-Z_]+)`", page, re.MULTILINE))
    assert documented == KNOWN_SETTINGS
    with override_settings(**dict.fromkeys(documented)):
        assert check_unknown_settings() == []


# Django 6 runs the model checks on every database (the MySQL backend asks
# its server's version)
@pytest.mark.django_db(databases=["default", "sqlite", "mysql"])
def test_e000_without_the_app_in_installed_apps_check_and_lock_say_add_it(settings):
    """Without "django_dlock" in INSTALLED_APPS `check` passed and locks ran on
    a migrated database; on a new one NotMigrated said "run migrate
    django_dlock", which fails ("No installed app with label")."""
    from django.core import checks
    from django.core.exceptions import ImproperlyConfigured

    import django_dlock as dlock

    dlock.lock("declared")  # a project that uses django-dlock
    others = [app for app in settings.INSTALLED_APPS if app != "django_dlock"]
    with override_settings(INSTALLED_APPS=others):
        found = [m for m in checks.run_checks() if m.id and m.id.startswith("dlock.")]
        assert [m.id for m in found] == ["dlock.E000"]
        assert "add it there" in str(found[0].msg)
        with pytest.raises(ImproperlyConfigured, match='"django_dlock" is not in INSTALLED_APPS'):
            dlock.lock("k", using="sqlite").acquire(timeout=0)
    assert [m for m in checks.run_checks() if m.id == "dlock.E000"] == []
