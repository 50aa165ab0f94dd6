"""Our losses must never touch torch.func / torch.compile (the pieces that crash inside DDP.forward), and
``liger_ddp_patch.losses`` must import (and run) without trl or liger_kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _loss_cases import call_kto, leaf_copies, load_reference, make_inputs

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ForbiddenCall(RuntimeError):
    pass


_FORBIDDEN = [
    (torch.func, "grad_and_value"),
    (torch.func, "grad"),
    (torch.func, "vjp"),
    (torch.func, "vmap"),
    (torch, "vmap"),
    (torch, "compile"),
]


@pytest.fixture
def forbid_functorch_and_compile(monkeypatch):
    """Replace torch.func.{grad_and_value,grad,vjp,vmap}, torch.vmap and torch.compile by tripwires, and also
    watch (via sys.setprofile) for any Python frame inside torch._functorch's transform entry points or
    torch._dynamo's compile entry point, in case something reaches them by another name."""
    calls = []

    def tripwire(name):
        def _raise(*args, **kwargs):
            calls.append(name)
            raise ForbiddenCall(f"{name} was called")

        return _raise

    for mod, name in _FORBIDDEN:
        monkeypatch.setattr(mod, name, tripwire(f"{mod.__name__}.{name}"))

    watched = ("torch/_functorch/apis.py", "torch/_functorch/eager_transforms.py", "torch/_dynamo/eval_frame.py")

    def profiler(frame, event, arg):
        if event == "call":
            fname = frame.f_code.co_filename.replace(os.sep, "/")
            if fname.endswith(watched):
                calls.append(f"{fname}:{frame.f_code.co_name}")

    old = sys.getprofile()
    sys.setprofile(profiler)
    try:
        yield calls
    finally:
        sys.setprofile(old)


def _dpo_step(cls, **kw):
    x = leaf_copies(make_inputs(seed=1))
    loss, metrics = cls(**kw)(
        x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"]
    )
    loss.backward()
    return loss, x


def _kto_step(cls, **kw):
    x = leaf_copies(make_inputs(batch=4, seed=2))
    loss, metrics = call_kto(cls(**kw), x, torch.tensor([True, False, True, False]), torch.tensor(0.2))
    loss.backward()
    return loss, x


def _guard_is_live(calls):
    """The tripwires are in place: a direct torch.func call and torch.compile both raise and are recorded."""
    n = len(calls)
    with pytest.raises(ForbiddenCall):
        torch.func.grad_and_value(lambda v: (v * v).sum())(torch.ones(3))
    with pytest.raises(ForbiddenCall):
        torch.compile(lambda v: v + 1)
    assert calls[n:] == ["torch.func.grad_and_value", "torch.compile"], calls
    del calls[n:]


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("compiled", [True, False])
def test_our_losses_never_call_functorch_or_compile(forbid_functorch_and_compile, compiled, one_pass):
    calls = forbid_functorch_and_compile
    _guard_is_live(calls)  # so that an empty `calls` below means something
    kw = dict(compiled=compiled, token_chunk_size=5, one_pass=one_pass)
    loss, x = _dpo_step(ChunkedDPOLoss, compute_nll_loss=True, **kw)
    assert torch.isfinite(loss) and x["weight"].grad is not None
    loss, x = _kto_step(ChunkedKTOLoss, use_ref_model=True, **kw)
    assert torch.isfinite(loss) and x["hidden"].grad is not None
    assert calls == [], f"forbidden calls during our loss forward/backward: {calls}"


def test_guard_sees_an_aliased_functorch_call_inside_our_backward(forbid_functorch_and_compile, monkeypatch):
    """A broken copy of our own loss path: the weight-gradient GEMM of our backward goes through
    ``torch._functorch.apis.vjp`` imported under another name (not the patched ``torch.func`` attribute).  The guard
    must still see it, i.e. it reaches into the backward our losses run (on CPU, in this thread)."""
    from torch._functorch.eager_transforms import vjp as aliased  # the original, not the patched torch.func attr

    from liger_ddp_patch.losses import _gemm

    def broken(acc, a, b, fast):
        product, _ = aliased(lambda m: m @ b, a)
        acc.add_(product.to(acc.dtype))

    monkeypatch.setattr(_gemm, "add_product", broken)
    calls = forbid_functorch_and_compile
    loss, x = _dpo_step(ChunkedDPOLoss, token_chunk_size=5, one_pass=False)  # the two-pass backward
    assert x["weight"].grad is not None
    assert any("_functorch" in c for c in calls), calls


@pytest.mark.parametrize("compiled", [False, True])
def test_guard_trips_on_liger_fused_loss(forbid_functorch_and_compile, compiled):
    """The very loss we replace trips the guard (torch.func.grad_and_value, and torch.compile when compiled)."""
    cls = load_reference("dpo", "liger")
    if cls is None:
        pytest.skip("liger-kernel not installed")
    with pytest.raises(ForbiddenCall):
        _dpo_step(cls, compiled=compiled)
    expected = "torch.compile" if compiled else "torch.func.grad_and_value"
    assert expected in forbid_functorch_and_compile, forbid_functorch_and_compile


def _run_py(code, env_extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


def test_import_does_not_pull_trl_or_liger():
    r = _run_py(
        """
        import sys
        import liger_ddp_patch.losses as L
        assert L.ChunkedDPOLoss and L.ChunkedKTOLoss
        bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trl', 'liger_kernel'))
        print('BAD', bad)
        sys.exit(1 if bad else 0)
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_usable_without_trl_and_liger_installed():
    """Block both packages at import time, then run a forward/backward of each loss."""
    r = _run_py(
        """
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('trl', 'liger_kernel'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        import torch
        from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss
        h = torch.randn(4, 6, 8, requires_grad=True); w = torch.randn(11, 8, requires_grad=True)
        t = torch.randint(0, 11, (4, 6)); t[:, :2] = -100
        loss, m = ChunkedDPOLoss(use_ref_model=False)(w, h, t)
        loss.backward()
        labels = torch.tensor([1, 0, 1, 0]).bool()
        loss, m = ChunkedKTOLoss()(_input=h, lin_weight=w, target=t, preference_labels=labels)
        loss.backward()
        print('OK')
        """
    )
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------- error parity

ERROR_CASES = [
    ("dpo", dict(loss_type="not_a_loss")),
    ("dpo", dict(loss_type="ipo")),
    ("dpo", dict(loss_type="exo_pair", label_smoothing=0.0)),
    ("dpo", dict(loss_type="robust", label_smoothing=0.5)),
    ("dpo", dict(loss_type="robust", label_smoothing=-0.1)),
]


@pytest.mark.parametrize("which", ["liger", "trl113"])
@pytest.mark.parametrize("kind,kwargs", ERROR_CASES)
def test_constructor_error_parity(kind, kwargs, which):
    ref = load_reference(kind, which)
    if ref is None:
        pytest.skip(f"{which} not importable")
    with pytest.raises(Exception) as ref_exc:
        ref(**kwargs)
    with pytest.raises(type(ref_exc.value)) as our_exc:
        ChunkedDPOLoss(**kwargs)
    assert type(our_exc.value) is type(ref_exc.value)
    assert str(our_exc.value)


def test_constructor_errors_without_reference():
    for _, kwargs in ERROR_CASES:
        with pytest.raises(ValueError):
            ChunkedDPOLoss(**kwargs)
    with pytest.raises(ValueError):
        ChunkedDPOLoss(token_chunk_size=0)


def _call_dpo(cls, x, **overrides):
    args = dict(ref_input=x["ref_hidden"], ref_weight=x["ref_weight"], ref_bias=x["ref_bias"])
    args.update(overrides)
    return cls(**({"compiled": False} if cls is not ChunkedDPOLoss else {}))(
        x["weight"], x["hidden"], x["target"], x["bias"], args["ref_input"], args["ref_weight"], args["ref_bias"]
    )


def _call_kto(cls, x, **overrides):
    args = dict(
        preference_labels=torch.tensor([True, False, True, False]),
        ref_input=x["ref_hidden"],
        ref_weight=x["ref_weight"],
    )
    args.update(overrides)
    kw = {"compiled": False} if cls is not ChunkedKTOLoss else {}
    return cls(use_ref_model=True, **kw)(_input=x["hidden"], lin_weight=x["weight"], target=x["target"], **args)


FORWARD_ERROR_CASES = [
    ("dpo", dict(ref_input=None)),
    ("dpo", dict(ref_weight=None)),
    ("kto", dict(preference_labels=None)),
    ("kto", dict(ref_input=None)),
    ("kto", dict(ref_weight=None)),
]


@pytest.mark.parametrize("which", ["liger", "trl113"])
@pytest.mark.parametrize("kind,overrides", FORWARD_ERROR_CASES)
def test_forward_error_parity(kind, overrides, which):
    ref = load_reference(kind, which)
    if ref is None:
        pytest.skip(f"{which} not importable")
    x = leaf_copies(make_inputs(batch=4, seed=3))
    call = _call_dpo if kind == "dpo" else _call_kto
    ours_cls = ChunkedDPOLoss if kind == "dpo" else ChunkedKTOLoss
    with pytest.raises(Exception) as ref_exc:
        call(ref, x, **overrides)
    with pytest.raises(Exception) as our_exc:
        call(ours_cls, x, **overrides)
    assert type(our_exc.value) is type(ref_exc.value), (repr(our_exc.value), repr(ref_exc.value))
