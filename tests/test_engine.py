"""The engine on a synthetic library: hooks, version gate, shape check, idempotence, undo, strictness, logging."""

from __future__ import annotations

import importlib
import itertools
import logging
import sys
import textwrap

import pytest

from liger_ddp_patch.engine import Engine, Patch, PatchError
from liger_ddp_patch.engine import hooks as engine_mod
from liger_ddp_patch.environment import DISABLE, Settings

_counter = itertools.count()

BROKEN = """
class Trainer:
    def step(self, x):
        return "broken"
"""
FIXED = """
class Trainer:
    def step(self, x):
        return "fixed upstream"
"""


@pytest.fixture
def fakelib(tmp_path, monkeypatch):
    """Write a throw-away module (new name each test, so wrapt's per-name hooks never collide) and return its name."""

    def make(source: str = BROKEN) -> str:
        name = f"fakelib_{next(_counter)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    monkeypatch.syspath_prepend(str(tmp_path))
    return make


def record(module: str, *, calls: list | None = None, **overrides) -> Patch:
    def check(original):
        return None if "broken" in original(None, None) else "step() no longer returns 'broken'"

    def replace(original, engine):
        if calls is not None:
            calls.append(original)

        def step(self, x):
            return "patched"

        return step  # the engine wraps it: the installed proxy carries the original as __wrapped__

    fields = dict(
        name="fix_step",
        module=(module,),
        attribute=("Trainer.step",),
        distribution="fakelib",
        affected=">=1.9.0,<1.14.0",
        fixed_in="1.14.0",
        releases=("1.8.0", "1.9.0", "1.12.0", "1.14.0"),
        check=check,
        replace=replace,
        summary="step() fixed",
    )
    fields.update(overrides)
    return Patch(**fields)


def run(module: str, version: str | None, monkeypatch, settings=None, **overrides) -> tuple[Engine, object]:
    settings = settings or Settings()
    monkeypatch.setattr(engine_mod, "installed_version", lambda dist: version)
    engine = Engine([record(module, **overrides)], settings)
    engine.install()
    return engine, importlib.import_module(module)


def status(engine: Engine):
    (only,) = engine.report()
    return only


def test_patches_on_import_and_unpatch_restores_the_same_object(fakelib, monkeypatch):
    name = fakelib()
    engine, mod = run(name, "1.12.0", monkeypatch)
    assert mod.Trainer().step(1) == "patched"
    assert status(engine).status == "applied" and status(engine).version == "1.12.0"
    original = engine.original("fix_step")
    engine.unpatch()
    assert mod.Trainer.__dict__["step"] is original
    assert mod.Trainer().step(1) == "broken"
    assert status(engine).status == "disabled" and "unpatch()" in status(engine).reason


def test_the_replacement_is_installed_in_a_wrapt_proxy_that_leaves_the_original_untouched(fakelib, monkeypatch):
    """The proxy answers for the original (name, docstring, signature, ``__wrapped__``) and carries our mark itself."""
    import inspect

    name = fakelib(BROKEN.replace("def step(self, x):", 'def step(self, x):\n        """The docstring."""'))
    engine, mod = run(name, "1.12.0", monkeypatch)
    installed, original = mod.Trainer.__dict__["step"], engine.original("fix_step")
    assert installed.__wrapped__ is original and installed is not original
    assert (installed.__name__, installed.__qualname__, installed.__doc__) == ("step", "Trainer.step", "The docstring.")
    assert str(inspect.signature(mod.Trainer().step)) == "(x)"
    assert getattr(installed, engine_mod.MARK) == "fix_step" and not hasattr(original, engine_mod.MARK)
    assert mod.Trainer.step(mod.Trainer(), 1) == "patched"  # called through the class, instance passed by hand


def test_a_gated_record_follows_its_gate_not_disable_all(fakelib, monkeypatch):
    """A record with ``gate`` (the gradient check's): on or off by its gate, whatever ``LIGER_DDP_PATCH_DISABLE=1``
    says; naming it still turns it off. With ``affected=""`` no version gates it, an unreadable one included."""

    def gate(settings):
        return (None, f"every {settings.verify_every}") if settings.verify_every else ("off: no verify_every", "")

    applied = "step() fixed (Trainer.step, any fakelib version); every 5"
    for settings, expected in (
        (Settings(disable_all=True, verify_every=5), ("applied", applied)),
        (Settings(verify_every=0), ("disabled", "off: no verify_every")),
        (Settings(disabled=frozenset({"fix_step"}), verify_every=5), ("disabled", f"disabled by {DISABLE}")),
    ):
        engine, mod = run(fakelib(), None, monkeypatch, settings=settings, gate=gate, affected="", releases=())
        assert (status(engine).status, status(engine).reason) == expected
        assert (mod.Trainer().step(1) == "patched") == (expected[0] == "applied")
        assert bool(engine._hooked) == (expected[0] == "applied")  # an off record hooks nothing
        engine.unpatch()
        assert mod.Trainer().step(1) == "broken"


def test_the_gradient_check_record_says_which_check_runs():
    from liger_ddp_patch.patches.verifier import gate

    assert gate(Settings()) == (None, "LIGER_DDP_PATCH_VERIFY unset: for a Liger trainer under "
                                      "DistributedDataParallel, at the first optimizer step and at every checkpoint, "
                                      "a WARNING if the ranks differ")  # fmt: skip
    assert gate(Settings(strict=True))[1].endswith(
        "raising GradientDesyncError if the ranks differ (LIGER_DDP_PATCH_STRICT=1)"
    )
    assert gate(Settings(check_first=False)) == ("disabled by LIGER_DDP_PATCH_VERIFY=0", "")
    assert gate(Settings(disable_all=True))[0].startswith("disabled by LIGER_DDP_PATCH_DISABLE")
    every = (
        "LIGER_DDP_PATCH_VERIFY=100: for a model under DistributedDataParallel, at the first optimizer step and every "
        "100 after, and at every checkpoint, raising GradientDesyncError if the ranks differ"
    )
    for settings in (Settings(verify_every=100), Settings(verify_every=100, disable_all=True)):
        assert gate(settings) == (None, every)


def test_module_imported_before_install_is_patched_at_once(fakelib, monkeypatch):
    name = fakelib()
    mod = importlib.import_module(name)
    monkeypatch.setattr(engine_mod, "installed_version", lambda dist: "1.12.0")
    engine = Engine([record(name)], Settings())
    assert status(engine).status == "pending"
    engine.install()
    assert mod.Trainer().step(1) == "patched"


def test_subclass_that_does_not_override_gets_the_fix(fakelib, monkeypatch):
    name = fakelib(BROKEN + "\nclass Child(Trainer):\n    pass\n")
    _, mod = run(name, "1.12.0", monkeypatch)
    assert mod.Child().step(1) == "patched"


def test_idempotent(fakelib, monkeypatch):
    name = fakelib()
    calls: list = []
    engine, mod = run(name, "1.12.0", monkeypatch, calls=calls)
    engine.install()
    engine.apply()
    engine.apply()
    assert len(calls) == 1
    assert mod.Trainer.__dict__["step"].__wrapped__ is engine.original("fix_step")


def test_apply_after_unpatch_patches_again(fakelib, monkeypatch):
    name = fakelib()
    engine, mod = run(name, "1.12.0", monkeypatch)
    engine.unpatch()
    engine.apply()
    assert mod.Trainer().step(1) == "patched" and status(engine).status == "applied"


@pytest.mark.parametrize(
    ("version", "source", "expected", "reason"),
    [
        ("1.14.0", BROKEN, "not_needed", "fixed upstream in fakelib 1.14.0 (installed 1.14.0)"),
        ("1.8.0", BROKEN, "unsupported", "fakelib 1.8.0 is outside the affected range >=1.9.0,<1.14.0"),
        (
            "2.0.0",
            BROKEN,
            "applied",
            "fakelib 2.0.0 is not a release we have verified, applied because the shape check",
        ),
        ("2.0.0", FIXED, "not_needed", "fakelib 2.0.0 is not a release we have read, and step() no longer returns"),
        ("1.12.0", FIXED, "unsupported", "shape check failed: step() no longer returns 'broken'; left untouched"),
        ("1.13.1", FIXED, "unsupported", "shape check failed"),
        ("1.13.1", BROKEN, "applied", "not a release we have verified"),
        ("not-a-version", BROKEN, "unsupported", "cannot read a valid fakelib version (got 'not-a-version')"),
    ],
)
def test_version_gate_and_shape_check(fakelib, monkeypatch, version, source, expected, reason):
    name = fakelib(source)
    engine, mod = run(name, version, monkeypatch)
    assert status(engine).status == expected
    assert reason in status(engine).reason
    patched = mod.Trainer().step(1) == "patched"
    assert patched == (expected == "applied")


def test_missing_attribute_is_reported(fakelib, monkeypatch):
    name = fakelib("class Other:\n    pass\n")
    engine, _ = run(name, "1.12.0", monkeypatch)
    assert status(engine).status == "unsupported"
    assert f"{name}:Trainer.step not found in fakelib 1.12.0" in status(engine).reason


def test_first_present_candidate_attribute_wins(fakelib, monkeypatch):
    name = fakelib(BROKEN)
    engine, mod = run(name, "1.12.0", monkeypatch, attribute=("Missing.step", "Trainer.step"))
    assert mod.Trainer().step(1) == "patched"


def boom(original, engine):
    raise RuntimeError("kaboom")


def test_a_patch_that_raises_never_breaks_the_host_import(fakelib, monkeypatch):
    name = fakelib()
    engine, mod = run(name, "1.12.0", monkeypatch, replace=boom)
    assert mod.Trainer().step(1) == "broken"
    assert status(engine).status == "failed"
    assert status(engine).reason == "applying raised RuntimeError: kaboom"


def test_strict_turns_could_not_patch_into_an_exception(fakelib, monkeypatch):
    name = fakelib(FIXED)
    with pytest.raises(PatchError, match=r"LIGER_DDP_PATCH_STRICT=1 .* fix_step \(unsupported\): shape check failed"):
        run(name, "1.12.0", monkeypatch, settings=Settings(strict=True))


def test_strict_does_not_raise_for_not_needed(fakelib, monkeypatch):
    name = fakelib(FIXED)
    engine, _ = run(name, "1.14.0", monkeypatch, settings=Settings(strict=True))
    assert status(engine).status == "not_needed"


def test_disabled_by_name(fakelib, monkeypatch):
    name = fakelib()
    engine, mod = run(name, "1.12.0", monkeypatch, settings=Settings(disabled=frozenset({"fix_step"})))
    assert mod.Trainer().step(1) == "broken"
    assert (status(engine).status, status(engine).reason) == ("disabled", "disabled by LIGER_DDP_PATCH_DISABLE")


def test_summary_is_logged_on_the_main_process_only(fakelib, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="liger_ddp_patch")
    monkeypatch.setenv("RANK", "1")
    run(fakelib(), "1.12.0", monkeypatch)
    assert not caplog.records
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    name = fakelib()
    run(name, "1.12.0", monkeypatch)
    (line,) = [r for r in caplog.records if name in r.getMessage()]
    # DEBUG: a patch that went to plan is invisible by default ("invisible when it works")
    assert line.levelno == logging.DEBUG and "fix_step=applied" in line.getMessage()


def test_failures_are_logged_as_warnings(fakelib, monkeypatch, caplog):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    name = fakelib(FIXED)
    run(name, "1.12.0", monkeypatch)
    (line,) = [r for r in caplog.records if name in r.getMessage()]
    assert line.levelno == logging.WARNING and "fix_step=unsupported (shape check failed" in line.getMessage()


def test_an_import_hook_and_apply_racing_patch_once(fakelib, monkeypatch):
    """A thread's TRL import fires the hook while another thread calls apply(): one replacement, not two.

    The replace() of the first thread waits (up to 0.5 s) for a second one to join it; only the engine's lock keeps
    the other thread out (without it both threads are inside replace() together and the target is wrapped twice).
    """
    import threading

    name = fakelib()
    calls: list = []
    inside, together = threading.Event(), threading.Barrier(2)

    def replace(original, engine):
        calls.append(original)
        inside.set()
        try:
            together.wait(timeout=0.5)
        except threading.BrokenBarrierError:
            pass

        def step(self, x):
            return "patched"

        return step

    monkeypatch.setattr(engine_mod, "installed_version", lambda dist: "1.12.0")
    engine = Engine([record(name, replace=replace)], Settings())
    engine.install()
    importer = threading.Thread(target=importlib.import_module, args=(name,))
    importer.start()
    assert inside.wait(timeout=10)
    applier = threading.Thread(target=engine.apply)
    applier.start()
    importer.join()
    applier.join()
    assert len(calls) == 1
    assert sys.modules[name].Trainer().step(1) == "patched"


def test_missing_target_of_an_absent_optional_dependency_is_not_needed(fakelib, monkeypatch):
    name = fakelib("class Other:\n    pass\n")
    monkeypatch.setattr(engine_mod, "installed_version", lambda dist: "1.12.0")
    monkeypatch.setitem(sys.modules, "optional_dep", None)  # blocks the import, as if not installed
    engine = Engine([record(name, requires=("optional_dep",))], Settings(strict=True))
    engine.install()
    importlib.import_module(name)  # strict mode, yet no PatchError: there is nothing to patch
    assert status(engine).status == "not_needed"
    assert status(engine).reason.endswith("optional_dep is not installed, so it never is")


def test_a_second_engine_takes_over_from_the_first_and_restores_the_true_original(fakelib, monkeypatch):
    """What ``importlib.reload(liger_ddp_patch)`` does: a new engine meets the old one's replacement."""
    name = fakelib()
    calls: list = []
    first, mod = run(name, "1.12.0", monkeypatch)
    true_original = first.original("fix_step")
    second = Engine([record(name, calls=calls)], Settings())
    second.install()
    assert calls == [true_original]  # replaced afresh from the true original: never wrapped twice
    assert mod.Trainer.__dict__["step"].__wrapped__ is true_original
    assert status(second).status == "applied" and "took over from an earlier load" in status(second).reason
    second.unpatch()
    assert mod.Trainer.__dict__["step"] is true_original


def test_a_record_without_replacement_is_armed_not_installed(fakelib, monkeypatch):
    name = fakelib()
    engine, mod = run(name, "1.12.0", monkeypatch, replace=None)
    original = mod.Trainer.__dict__["step"]
    assert status(engine).status == "applied" and engine.original("fix_step") is original
    assert mod.Trainer().step(1) == "broken"  # nothing installed
    engine.unpatch()
    assert engine.original("fix_step") is None and mod.Trainer.__dict__["step"] is original


def test_run_time_notes_are_kept_once_each_in_order(fakelib, monkeypatch):
    engine, _ = run(fakelib(), "1.12.0", monkeypatch)
    for decision in ("routed", "left alone", "routed"):
        engine.note("fix_step", "Trainer", decision)
    assert status(engine).runtime == {"Trainer": ["routed", "left alone"]}
    assert status(engine).as_dict()["runtime"] == {"Trainer": ["routed", "left alone"]}


def test_a_dunder_init_is_hooked_and_unpatch_restores_it(fakelib, monkeypatch):
    """The *_liger_settings records wrap ``Trainer.__init__``: instances built after import run the replacement,
    a subclass calling ``super().__init__`` too, and unpatch() puts the very same function back."""
    name = fakelib(
        "class Trainer:\n    def __init__(self, x):\n        self.x = x\n\n"
        "class Child(Trainer):\n    def __init__(self, x):\n        super().__init__(x)\n"
    )

    def replace(original, engine):
        def __init__(self, x):
            engine.note("init", type(self).__name__, f"saw {x}")
            original(self, x)

        return __init__

    engine, mod = run(
        name, "1.12.0", monkeypatch, name="init", attribute=("Trainer.__init__",), check=lambda o: None,
        replace=replace,
    )  # fmt: skip
    original = engine.original("init")
    assert mod.Trainer(1).x == 1 and mod.Child(2).x == 2
    assert status(engine).runtime == {"Trainer": ["saw 1"], "Child": ["saw 2"]}
    engine.unpatch()
    assert mod.Trainer.__dict__["__init__"] is original
    mod.Trainer(3)
    assert status(engine).runtime == {"Trainer": ["saw 1"], "Child": ["saw 2"]}


# -- a module that cannot be imported, a dependency below the host's minimum (`liger-ddp-patch status`'s words) -----


def resolved(module: str, version: str | None, monkeypatch, settings=None, **overrides) -> Engine:
    """An engine on ``module`` that is never imported by hand: resolve_pending() imports it, as `status` does."""
    monkeypatch.setattr(engine_mod, "installed_version", lambda dist: version)
    engine = Engine([record(module, **overrides)], settings or Settings())
    engine.install()
    engine.resolve_pending()
    return engine


def test_a_module_that_raises_on_import_is_unavailable_with_its_error_and_where(fakelib, monkeypatch):
    """Installed, but what it imports is missing (TRL 1.10's GOLD without ``requests``): ``unavailable``, with the
    exception, the frame it came from, and the command that shows the whole traceback; strict mode does not raise
    (nothing could be patched, and the host's own import fails the same way)."""
    name = fakelib("import os\nimport liger_ddp_no_such_dependency  # line 2\n" + BROKEN)
    engine = resolved(name, "1.12.0", monkeypatch, settings=Settings(strict=True))
    got = status(engine)
    assert (got.status, got.version) == ("unavailable", "1.12.0"), got
    assert got.reason == (
        f"{name} is in fakelib 1.12.0 but cannot be imported here: ModuleNotFoundError: No module named "
        f"'liger_ddp_no_such_dependency' (raised at {name}.py:2); nothing to patch until it imports "
        f"(the whole traceback: python -c 'import {name}')"
    )


def test_a_wrapped_import_error_shows_its_root_cause_not_the_wrapper(fakelib, monkeypatch):
    """TRL's lazy modules re-raise an import failure as ``RuntimeError(... (look up to see its traceback) ...)``:
    the reason gives the root cause (where a terminal line would show the traceback, `status` shows none)."""
    inner = fakelib("def boom():\n    raise ValueError('the real cause,\\n on two lines')\n")
    name = fakelib(
        f"import {inner}\ntry:\n    {inner}.boom()\nexcept ValueError as e:\n"
        "    raise RuntimeError('Failed to import (look up to see its traceback)') from e\n"
    )
    got = status(resolved(name, "1.12.0", monkeypatch))
    assert got.status == "unavailable", got
    assert "ValueError: the real cause, on two lines" in got.reason, got.reason
    assert f"(raised at {inner}.py:2 <- {name}.py:3)" in got.reason, got.reason
    assert "look up" not in got.reason and "RuntimeError" not in got.reason, got.reason


def test_a_module_that_raises_on_a_release_fixed_upstream_is_not_needed(fakelib, monkeypatch):
    """TRL 1.10's Distillation without ``requests``: fixed upstream in that release, whatever its import does."""
    name = fakelib("import liger_ddp_no_such_dependency\n")
    got = status(resolved(name, "1.14.0", monkeypatch))
    assert (got.status, got.reason) == ("not_needed", "fixed upstream in fakelib 1.14.0 (installed 1.14.0)"), got


def test_a_module_absent_from_the_release_is_not_needed(monkeypatch):
    """No such module (IW-OPD before TRL 1.9, or no TRL at all): nothing to patch, and the reason says it is absent."""
    name = f"fakelib_absent_{next(_counter)}"
    got = status(resolved(f"{name}.trainer", "1.12.0", monkeypatch))
    assert got.status == "not_needed", got
    assert got.reason == (
        f"{name}.trainer cannot be imported (No module named '{name}'): no such module installed; nothing to patch"
    )


def test_a_target_missing_because_a_dependency_is_below_the_hosts_minimum_is_unavailable(
    fakelib, tmp_path, monkeypatch
):
    """TRL imports its Liger losses only when ``is_liger_kernel_available()`` (liger-kernel at or above TRL's
    ``LIGER_KERNEL_MIN_VERSION``): the record names where the host keeps that minimum; the engine reads it (0.8.0
    here) and compares the installed version. The control: at the minimum, the same missing target is unsupported."""
    dep, config = f"fakedep_{next(_counter)}", f"fakecfg_{next(_counter)}"
    (tmp_path / f"{dep}.py").write_text("")
    (tmp_path / f"{config}.py").write_text("DEP_MIN_VERSION = '0.8.0'\n")
    name = fakelib(f"import {config}\nclass Other:\n    pass\n")
    for installed, expected in (("0.7.9", "unavailable"), ("0.8.0", "unsupported")):
        versions = {"fakelib": "1.12.0", dep: installed}
        monkeypatch.setattr(engine_mod, "installed_version", versions.get)
        engine = Engine(
            [record(name, requires=(dep,), requires_min=((dep, f"{config}:DEP_MIN_VERSION"),))], Settings(strict=False)
        )
        engine.install()
        importlib.import_module(name)
        got = status(engine)
        assert got.status == expected, got
        shown = dep.replace("_", "-")  # the distribution's normalised name
        below = f"{shown} {installed} is below fakelib 1.12.0's minimum 0.8.0, so fakelib does not import it"
        assert (below in got.reason) == (expected == "unavailable"), got.reason
        engine.unpatch()
