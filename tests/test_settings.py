import pytest

from liger_ddp_patch import settings
from liger_ddp_patch.settings import SettingsWarning

KNOWN = frozenset({"dpo_compute_loss", "kto_compute_loss", "dpo_chunked_loss", "kto_chunked_loss"})


def read(**env):
    return settings.read(KNOWN, {k: v for k, v in env.items()})


def test_defaults():
    s = read()
    assert (s.disable_all, s.disabled, s.verify_every, s.strict) == (False, frozenset(), 0, False)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "all", "yes", " on "])
def test_disable_everything(value):
    assert read(LIGER_DDP_PATCH_DISABLE=value).disable_all


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_disable_nothing(value):
    s = read(LIGER_DDP_PATCH_DISABLE=value)
    assert not s.disable_all and not s.disabled


def test_disable_by_name():
    s = read(LIGER_DDP_PATCH_DISABLE="dpo_chunked_loss, kto_compute_loss")
    assert s.disabled == {"dpo_chunked_loss", "kto_compute_loss"}
    assert s.is_disabled("dpo_chunked_loss") and not s.is_disabled("dpo_compute_loss")


def test_unknown_names_warn_and_list_the_valid_ones():
    with pytest.warns(SettingsWarning) as caught:
        s = read(LIGER_DDP_PATCH_DISABLE="dpo_chunked_loss,bogus")
    assert s.disabled == {"dpo_chunked_loss"}
    message = str(caught[0].message)
    assert "bogus" in message and "dpo_compute_loss, kto_chunked_loss, kto_compute_loss" in message


@pytest.mark.parametrize(("value", "every"), [("1", 100), ("true", 100), ("25", 25), ("0", 0), ("", 0)])
def test_verify(value, every):
    assert read(LIGER_DDP_PATCH_VERIFY=value).verify_every == every


@pytest.mark.parametrize("value", ["-3", "often", "1.5"])
def test_bad_verify_warns_and_falls_back(value):
    with pytest.warns(SettingsWarning, match="LIGER_DDP_PATCH_VERIFY"):
        assert read(LIGER_DDP_PATCH_VERIFY=value).verify_every == 0


def test_strict():
    assert read(LIGER_DDP_PATCH_STRICT="1").strict
    with pytest.warns(SettingsWarning, match="LIGER_DDP_PATCH_STRICT='maybe' is not a boolean"):
        assert not read(LIGER_DDP_PATCH_STRICT="maybe").strict


def test_warning_points_at_the_users_import_line(tmp_path):
    """A bad variable is reported at the line that imported the package, not inside the package."""
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("import os\nimport liger_ddp_patch\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "LIGER_DDP_PATCH_DISABLE": "dpo_compute_los", "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-W", "always", str(script)], capture_output=True, text=True, env=env)
    assert (
        f"{script}:2: SettingsWarning: LIGER_DDP_PATCH_DISABLE names unknown patch(es) dpo_compute_los" in proc.stderr
    )


def test_the_liger_settings_records_are_disabled_by_name():
    """The warnings about what TRL's Liger path ignores have their own opt-out (the real patch names)."""
    from liger_ddp_patch.patches import NAMES

    s = settings.read(NAMES, {"LIGER_DDP_PATCH_DISABLE": "dpo_liger_settings,kto_liger_settings"})
    assert s.disabled == {"dpo_liger_settings", "kto_liger_settings"}
    assert not s.is_disabled("kto_compute_loss")
