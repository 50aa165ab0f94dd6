import pytest

from liger_ddp_patch import environment
from liger_ddp_patch.environment import SettingsWarning

KNOWN = frozenset({"dpo_compute_loss", "kto_compute_loss", "dpo_chunked_loss", "kto_chunked_loss"})


def read(**env):
    return environment.read(KNOWN, {k: v for k, v in env.items()})


def test_defaults():
    s = read()
    assert (s.disable_all, s.disabled, s.verify_every, s.check_first, s.strict) == (False, frozenset(), 0, True, False)


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


@pytest.mark.parametrize(
    ("value", "every", "first"), [("1", 100, True), ("true", 100, True), ("25", 25, True), ("0", 0, False),
                                  ("off", 0, False), ("", 0, True)]
)  # fmt: skip
def test_verify(value, every, first):
    """Unset: the one check at the first step (warns); N: every N steps (raises); 0: no check at all."""
    s = read(LIGER_DDP_PATCH_VERIFY=value)
    assert (s.verify_every, s.check_first) == (every, first)


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

    s = environment.read(NAMES, {"LIGER_DDP_PATCH_DISABLE": "dpo_liger_settings,kto_liger_settings"})
    assert s.disabled == {"dpo_liger_settings", "kto_liger_settings"}
    assert not s.is_disabled("kto_compute_loss")


# ------------------------------------------------------------------------------------ LIGER_DDP_PATCH_LOSS


@pytest.fixture
def fresh_loss_parse():
    environment.parse_loss.cache_clear()  # each distinct value warns once per process: these tests need it again
    yield
    environment.parse_loss.cache_clear()


@pytest.mark.parametrize(
    ("value", "options"),
    [
        ("", {}),
        ("one_pass=0", {"one_pass": False}),
        ("one_pass=1", {"one_pass": True}),
        (" ONE_PASS = false , token_chunk_size = 64 ", {"one_pass": False, "token_chunk_size": 64}),
        ("token_chunk_size=1,", {"token_chunk_size": 1}),
    ],
)
def test_loss_options(fresh_loss_parse, value, options):
    assert read(LIGER_DDP_PATCH_LOSS=value).loss.overrides() == options


@pytest.mark.parametrize(
    ("value", "bad", "kept"),
    [
        ("token_chunk_size=0", "token_chunk_size='0' is not valid", {}),
        ("token_chunk_size=1.5,one_pass=0", "token_chunk_size='1.5' is not valid", {"one_pass": False}),
        ("one_pass=maybe", "one_pass='maybe' is not valid", {}),
        ("chunk=512", "'chunk=512' is not a known key=value", {}),
        ("one_pass", "'one_pass' is not a known key=value", {}),
        ("sweep=fused,one_pass=1", "sweep='fused' is not valid", {"one_pass": True}),
    ],
)
def test_bad_loss_options_warn_and_keep_the_defaults(fresh_loss_parse, value, bad, kept):
    with pytest.warns(SettingsWarning) as caught:
        options = read(LIGER_DDP_PATCH_LOSS=value).loss
    assert options.overrides() == kept
    message = str(caught[0].message)
    assert message.startswith(f"LIGER_DDP_PATCH_LOSS={value!r}: {bad}"), message
    assert "one_pass=0|1" in message and "token_chunk_size=<positive integer>" in message  # what to write instead
    assert "sweep=eager|triton" in message and "autocast=0|1" in message


def test_loss_options_describe_the_defaults():
    defaults = "one_pass=auto (default), token_chunk_size=auto (default), sweep=eager (default), autocast=1 (default)"
    assert environment.LossOptions().describe() == defaults
    set_all = "one_pass=0, token_chunk_size=512, sweep=triton, autocast=0"
    assert environment.LossOptions(False, 512, "triton", False).describe() == set_all


def test_autocast_option_is_read_and_never_reaches_the_losses():
    """``autocast=0`` is for the routed path (patches/compute_loss.py), not a keyword of our losses: the swap passes
    only the keys our loss accepts (tests below)."""
    assert environment.parse_loss("autocast=0").autocast is False
    assert environment.parse_loss("autocast=1,one_pass=0").overrides() == {"autocast": True, "one_pass": False}


@pytest.mark.parametrize(
    ("kind", "value"), [("dpo", "one_pass=0,token_chunk_size=7"), ("kto", "token_chunk_size=3,sweep=triton")]
)
def test_the_swap_builds_our_loss_with_the_options(fresh_loss_parse, monkeypatch, kind, value):
    """A real swap (the one the compute_loss patch makes under DDP) of Liger's fused loss, settings kept, with the
    variable's options on top; without the variable the defaults; a key our loss lacks is never passed."""
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    from liger_ddp_patch.patches import chunked_loss
    from liger_ddp_patch.patches.trainers import SPECS

    (spec,) = [s for s in SPECS if s.name == kind]
    fused = getattr(liger, f"LigerFusedLinear{kind.upper()}Loss")

    class Trainer:
        pass

    def swapped(env):
        monkeypatch.setenv("LIGER_DDP_PATCH_LOSS", env)
        trainer = Trainer()
        trainer.liger_loss = fused(beta=0.25)
        said = chunked_loss.swap(trainer, fused, spec)
        return trainer.liger_loss, said

    loss, said = swapped(value)
    options = environment.parse_loss(value).overrides()
    assert type(loss).__name__ == f"Chunked{kind.upper()}Loss" and loss.beta == 0.25
    assert (loss.one_pass, loss.token_chunk_size) == (options.get("one_pass"), options["token_chunk_size"])
    assert loss.sweep == options.get("sweep", "eager")
    assert said.endswith(f"(LIGER_DDP_PATCH_LOSS: {value.replace(',', ', ')})"), said
    loss, said = swapped("")
    assert (loss.one_pass, loss.token_chunk_size, loss.sweep) == (None, None, "eager")  # None: the held budget
    assert "LIGER_DDP_PATCH_LOSS" not in said


def test_status_shows_the_loss_options(fresh_loss_parse, monkeypatch):
    import liger_ddp_patch

    monkeypatch.setenv("LIGER_DDP_PATCH_LOSS", "one_pass=0")
    rows = {row.name: row for row in liger_ddp_patch.report()}
    for name in ("dpo_chunked_loss", "kto_chunked_loss"):
        if rows[name].status in ("applied", "pending"):
            expected = (
                "(LIGER_DDP_PATCH_LOSS): one_pass=0, token_chunk_size=auto (default), sweep=eager (default), "
                "autocast=1 (default)"
            )
            assert rows[name].reason.endswith(expected)
    assert "LIGER_DDP_PATCH_LOSS" not in rows["dpo_compute_loss"].reason
