#!/usr/bin/env python
"""The GPU check's head-loss peak, simulated on CPU: what each arm would allocate on the GPU, by site (issue 45).

    python benchmarks/sim_gpu_peak.py                                   # DPO and KTO at L=4,096, every arm
    python benchmarks/sim_gpu_peak.py --trainers dpo --arms ours,trl114 --lengths 2048,4096 --json out.json

The shapes of ``gpu_check.py`` part (c): Qwen2.5-7B's head (V=151,936, H=3,584), bf16 weights and hidden states under
bf16 autocast (``bf16=True``), per rank one DPO pair / two KTO rows of ``L`` tokens, 50 % prompt (the loss sees
``L - 1`` positions, 2,048 loss tokens a row at L=4,096), the reference model's head beside the policy's (its
hidden states and weight in bf16, as with a bf16 ``ref_model``).  One arm per process; the inputs are made first,
then one forward and backward of the head loss (the reference pass, the policy pass, the loss on top, the backward
into the policy's hidden states and head weight) runs under ``torch.profiler`` with ``profile_memory``, and every CPU
allocation and free is replayed (``_memory.cpu_allocations``, the replay of ``BENCH_STEP_MEMORY``): the peak over the
inputs, and what is live there by site (the allocating op and the innermost frame of the package, TRL or this
script).  What the gradients' results hold (``weight.grad``, ``hidden.grad``) is counted: every arm makes them.

Arms (``ARMS``):

  ours       the package's default loss inside ``_plan.simulated_accelerator(free)``: the accelerator's plan
             (chunk rows, path, held sums) for that free memory, run on CPU; one row per ``--free`` value
  ours_1p    the same with ``one_pass=True``;  ours_2p  with ``one_pass=False`` (the two-pass path)
  trl114     TRL 1.14.0's ``_ChunkedLogProbFunction`` (``.cache/trl/1.14.0``) as its DPO/KTO trainers call it:
             boolean-masked hidden states, vocabulary tiles of ``_CHUNKED_LOGPROB_CHUNK_SIZE`` = 8,192, token tiles
             of 2,048; plain torch ops, so the CPU allocates what the GPU does
  trl116     TRL 1.16.0's ``ChunkedLogProbFunction`` (``.cache/trl/1.16.0``) as ``add_fused_lm_head``'s forward calls
             it on a Triton device (only the labelled positions, ``compact``; token tiles of 4,096, vocabulary tiles
             of ``_CHUNKED_LOGPROB_CHUNK_SIZE`` = 32,768; the outputs its DPO / KTO trainer asks for).  On CPU its
             tiles are folded by torch (``_forward_tile``, ``_backward_tile``) and ``_addmm_fp32`` multiplies fp32
             copies; on CUDA they are Triton kernels working in place and ``addmm(out_dtype=float32)``, which
             allocate nothing: the replay drops what those three frames allocate (``GPU_ONLY``), and reports both
  off        Liger-off (TRL 1.12.0's non-Liger loss): the ``(B, L - 1, V)`` logits of every position, TRL's
             ``selective_log_softmax`` with gradient, the reference's logits without, and the metrics TRL computes
             from the logits (``entropy_from_logits``, the completion logits' mean)

Not a head arm: ``ref_attn_fp32`` / ``ref_attn_bf16`` replay one attention of the step's reference model (28 heads
over 4 KV heads of 128, causal, over the ``L - 1`` positions of 2 rows; no gradient) in fp32 on SDPA's math backend --
what the H200 profile of 2026-12-04 shows the float32 reference TRL builds ran outside autocast (an fp32 softmax
kernel per reference layer, ``cunn_SoftMaxForwardReg<float, float, float>``; CUDA's flash and cuDNN kernels take
half precision only) -- and in bf16 on the flash backend (under autocast, as routed now).  Both are plain torch ops
(``scaled_dot_product_attention`` on the backend named), so the CPU allocates what the GPU does.  ``body``: the
step's 2-layer Qwen3 body (Qwen2.5-7B's layer sizes, the tied 151,936 x 3,584 embedding) in bf16 under bf16 autocast,
with gradient checkpointing (TRL's DPO and KTO configs turn it on by default, and part (c) keeps it), no head: the
policy's forward with gradient, the reference's without (the same weights), the backward from a stand-in gradient of
the policy's hidden states; the replay says what the policy's saved activations hold, the reference forward's peak
beside them and the backward's peak (``phases``), for :func:`step_peak` to put beside each arm's head loss.  CPU SDPA
runs flash attention as the GPU does in bf16 (no ``L x L`` tensor).

The losses on top are ``_arms``' sigmoid DPO and KTO (TRL's formulas; a few scalars).  ``ours`` runs the emulated
fp32-output GEMMs of ``_gemm``: what their ``_emulated_product`` frame allocates is dropped the same way.  Nothing
here is measured on a GPU: the peaks are what the CPU run allocates, less what the named frames allocate only on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_CACHE = Path(os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", ROOT / ".cache" / "trl"))
V, H = 151_936, 3_584
PROMPT = 0.5
ARMS = ("ours", "ours_1p", "ours_2p", "trl114", "trl116", "off")
PHASES = ("ref_attn_fp32", "ref_attn_bf16", "body")
BODY = dict(intermediate_size=18_944, num_hidden_layers=2, num_attention_heads=28, num_key_value_heads=4, head_dim=128)
HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128  # Qwen2.5-7B's attention
TRL_OF = {"trl114": "1.14.0", "trl116": "1.16.0"}
# free device memory at the loss call, bytes: an idle 80 GB H100, an idle 141 GB H200, a nearly full device
FREE = {"h100": 80 * 10**9, "h200": 141 * 10**9, "full": 4 << 30}
# frames whose allocations a GPU run does not make (see the module docstring)
GPU_ONLY = {
    "ours": ("_emulated_product",),
    "trl116": ("_forward_tile", "_backward_tile", "_addmm_fp32"),
}
LIBRARIES = ("liger_ddp_patch", "trl/", "sim_gpu_peak", "_arms")
GIB = 2**30


# ------------------------------------------------------------------------------------------------ one arm (child)


def inputs(rows: int, L: int, dtype, V: int = V, H: int = H):
    """Policy hidden states and head weight (with gradients), the reference's, and the targets: ``rows`` sequences
    of ``L - 1`` positions (the hidden states a trainer hands the loss), the first ``PROMPT * L - 1`` ignored."""
    import torch

    g = torch.Generator().manual_seed(0)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x = dict(h=rn(rows, L - 1, H).requires_grad_(True), w=rn(V, H, scale=0.02).requires_grad_(True),
             rh=rn(rows, L - 1, H), rw=rn(V, H, scale=0.02))  # fmt: skip
    x["t"] = torch.randint(0, V, (rows, L - 1), generator=g)
    x["t"][:, : int(PROMPT * L) - 1] = -100
    return x


def _sequence_loss(kind, pol, ref):
    from _arms import dpo_sigmoid, kto

    return dpo_sigmoid(pol, ref) if kind == "dpo" else kto(pol, ref)


def step_ours(kind, x, free, one_pass):
    """The package's loss, planned as an accelerator with ``free`` bytes free."""
    import torch

    from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _plan

    kw = {} if one_pass is None else dict(one_pass=one_pass)
    fn = ChunkedDPOLoss(beta=0.1, **kw) if kind == "dpo" else ChunkedKTOLoss(beta=0.1, use_ref_model=True, **kw)
    with _plan.simulated_accelerator(free), torch.autocast("cpu", dtype=torch.bfloat16):
        if kind == "dpo":
            loss = fn(x["w"], x["h"], x["t"], None, x["rh"], x["rw"], None)[0]
        else:
            pref = torch.arange(x["t"].shape[0]) % 2 == 0
            loss = fn(_input=x["h"], lin_weight=x["w"], target=x["t"], bias=None, preference_labels=pref,
                      ref_input=x["rh"], ref_weight=x["rw"], ref_bias=None, kl=torch.tensor(0.1))[0]  # fmt: skip
        loss.backward()
    return dict(path=fn.last_path, chunk=fn.last_chunk, sweep=fn.last_sweep, held=fn.last_held)


def step_trl114(kind, x):
    """TRL 1.14.0: ``_get_per_token_logps_and_entropies`` (DPO) / its KTO twin, from ``hidden_states[mask]``."""
    import torch
    from trl.trainer import dpo_trainer
    from trl.trainer.utils import _ChunkedLogProbFunction

    chunk = dpo_trainer._CHUNKED_LOGPROB_CHUNK_SIZE
    mask = x["t"] != -100

    def seq_logps(hid, w):
        logps, _entropies = _ChunkedLogProbFunction.apply(hid[mask], w, None, x["t"][mask], 1.0, chunk, None, 1.0)
        return logps.new_zeros(mask.shape).masked_scatter(mask, logps).sum(1)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            ref = seq_logps(x["rh"], x["rw"])
        loss = _sequence_loss(kind, seq_logps(x["h"], x["w"]), ref)
    loss.backward()
    return dict(vocab_tile=chunk)


def step_trl116(kind, x):
    """TRL 1.16.0: the chunked log-probs ``add_fused_lm_head``'s forward computes on a Triton device (``compact``:
    the labelled positions only), with the outputs its trainer asks for (reference: log-probs only)."""
    import torch
    from trl.trainer import utils

    outputs = ("log_probs", "entropy", "mean_logits", "is_top1") if kind == "dpo" else ("log_probs", "entropy",
                                                                                           "mean_logits")  # fmt: skip
    mask = x["t"] != -100

    def seq_logps(hid, w, outs):
        per_token = utils._ChunkedLogProbFunction.apply(hid[mask], w, None, x["t"][mask], 1.0,
                                                        utils._CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, outs)  # fmt: skip
        per_token = [None if p is None else p.new_zeros(mask.shape).masked_scatter(mask, p) for p in per_token]
        return per_token[0].sum(1)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            ref = seq_logps(x["rh"], x["rw"], ("log_probs",))
        loss = _sequence_loss(kind, seq_logps(x["h"], x["w"], outputs), ref)
    loss.backward()
    return dict(vocab_tile=utils._CHUNKED_LOGPROB_CHUNK_SIZE, outputs=list(outputs))


def step_off(kind, x):
    """Liger-off, TRL 1.12.0's ``_compute_loss`` from the logits on: every position's logits, its
    ``selective_log_softmax``, the reference's, the entropy and the completion logits' mean (its metrics)."""
    import torch
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    mask = x["t"] != -100
    labels = x["t"].clamp_min(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = x["h"] @ x["w"].t()  # the lm_head inside the model's forward: (B, L - 1, V), bf16
        per_token = selective_log_softmax(logits, labels)
        per_token[~mask] = 0.0
        pol = per_token.sum(1)
        with torch.no_grad():
            ref_logits = x["rh"] @ x["rw"].t()
            ref_per_token = selective_log_softmax(ref_logits, labels)
            ref_per_token[~mask] = 0.0
            ref = ref_per_token.sum(1)
            del ref_logits
        loss = _sequence_loss(kind, pol, ref)
        with torch.no_grad():  # the metrics TRL 1.12 logs from the logits
            entropy = (entropy_from_logits(logits.detach()) * mask).sum()
            if kind == "dpo":
                chosen, rejected = logits.detach().chunk(2, dim=0)
                c_mask, r_mask = mask.chunk(2, dim=0)
                means = chosen[c_mask].mean(-1).sum() + rejected[r_mask].mean(-1).sum()
            else:
                means = logits.detach()[mask].mean(-1).sum()
            float(entropy + means)
    loss.backward()
    return {}


def step_ref_attn(dtype, L: int) -> dict:
    """One attention of the reference model, no gradient: fp32 on the math backend, or bf16 on the flash one."""
    import torch
    from torch.nn.attention import SDPBackend

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, HEADS, L - 1, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(2, KV_HEADS, L - 1, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    backend = SDPBackend.MATH if dtype == torch.float32 else SDPBackend.FLASH_ATTENTION
    return dict(q=q, k=k, v=v, backend=backend)


def run_phase(arm: str, L: int) -> dict:
    import torch
    import torch.nn.functional as F
    from _memory import cpu_allocations
    from torch.nn.attention import sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    x = step_ref_attn(torch.float32 if arm.endswith("fp32") else torch.bfloat16, L)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        with torch.no_grad(), sdpa_kernel(x["backend"]):
            out = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True, enable_gqa=True)
        del out
    wall = time.perf_counter() - t0
    r = replay(cpu_allocations(prof))
    return dict(arm=arm, trainer="-", L=L, free=None, peak=r["peak"], cpu_peak=r["peak"], dropped=0,
                sites=r["sites"], at=r["at"], wall_s=round(wall, 1), backend=str(x["backend"]),
                shape=[2, HEADS, L - 1, L - 1])  # fmt: skip


def run_body(L: int, V: int = V, H: int = H) -> dict:
    """The 2-layer body's phases (see the module docstring): bytes over the start of the profile."""
    import torch
    from _memory import cpu_allocations
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, tie_word_embeddings=True, max_position_embeddings=max(4096, L),
                      **BODY)  # fmt: skip
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Qwen3ForCausalLM(cfg).train()
    finally:
        torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable()  # DPOConfig's and KTOConfig's default (TRL 1.x): gradient_checkpointing=True
    ids = torch.randint(3, V, (2, L))
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            with record_function("phase:policy_forward"):
                hp = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].contiguous()
            with record_function("phase:ref_forward"), torch.no_grad():
                hr = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].contiguous()
        with record_function("phase:grad"):
            g = torch.randn_like(hp)
        with record_function("phase:backward"):
            hp.backward(g)
        del hr, g
    wall = time.perf_counter() - t0
    events = cpu_allocations(prof)
    r = replay(events)
    return dict(arm="body", trainer="-", L=L, free=None, peak=r["peak"], cpu_peak=r["peak"], dropped=0,
                sites=r["sites"], at=r["at"], wall_s=round(wall, 1), phases=phases(prof, events),
                params=sum(p.numel() * p.element_size() for p in model.parameters()), checkpointing=True,
                hidden_bytes=hp.numel() * hp.element_size())  # fmt: skip


def phases(prof, events) -> dict:
    """Per ``record_function("phase:...")`` region (by time): the live bytes when it ends and the most live in it."""

    def walk(evs):
        for e in evs:
            yield e
            yield from walk(e.children)

    def name(e):
        try:
            return e.name
        except UnicodeDecodeError:  # a frame name the profiler stored cut mid-character
            return "?"

    tree = prof.profiler.kineto_results.experimental_event_tree()
    spans = sorted((e.start_time_ns, e.end_time_ns, name(e)[6:]) for e in walk(tree) if name(e).startswith("phase:"))
    out = {phase: dict(peak=0, end=0) for _, _, phase in spans}
    cur = 0
    live: dict = {}
    for e in events:
        f = e.extra_fields
        if f.alloc_size > 0:
            live[f.ptr] = f.alloc_size
            cur += f.alloc_size
        else:
            cur -= live.pop(f.ptr, 0)
        for start, end, phase in spans:
            if start <= e.start_time_ns <= end:
                out[phase]["peak"] = max(out[phase]["peak"], cur)
                out[phase]["end"] = cur
    return out


def run_arm(arm: str, kind: str, L: int, free: int | None, V: int = V, H: int = H) -> dict:
    import torch
    from _memory import cpu_allocations
    from torch.profiler import ProfilerActivity, profile

    if arm in TRL_OF or arm == "off":  # imported before the profile starts: an import is not the step
        import trl.trainer.dpo_trainer  # noqa: F401
        import trl.trainer.utils  # noqa: F401
    torch.manual_seed(0)
    x = inputs(2, L, torch.bfloat16, V, H)
    input_bytes = sum(t.numel() * t.element_size() for t in x.values())
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        if arm.startswith("ours"):
            info = step_ours(kind, x, free, {"ours": None, "ours_1p": True, "ours_2p": False}[arm])
        else:
            info = dict(trl114=step_trl114, trl116=step_trl116, off=step_off)[arm](kind, x)
    wall = time.perf_counter() - t0
    events = cpu_allocations(prof)
    drop = GPU_ONLY.get(arm.split("_")[0], ())
    gpu = replay(events, drop)
    cpu = replay(events, ()) if drop else gpu
    return dict(arm=arm, trainer=kind, L=L, free=free, V=V, H=H, prompt=PROMPT, input_bytes=input_bytes,
                tokens=int((x["t"] != -100).sum()), wall_s=round(wall, 1), torch=torch.__version__,
                peak=gpu["peak"], cpu_peak=cpu["peak"], dropped=gpu["dropped"], sites=gpu["sites"], at=gpu["at"],
                results=dict(w_grad=_nbytes(x["w"].grad), h_grad=_nbytes(x["h"].grad)), **info)  # fmt: skip


def _nbytes(t):
    return None if t is None else t.numel() * t.element_size()


def _frames(event):
    """The names of ``event``'s ancestors (ops and Python frames), innermost first."""
    out, p = [], event.parent
    while p is not None:
        try:
            out.append(p.name)
        except UnicodeDecodeError:
            out.append("?")
        p = p.parent
    return out


def site(frames) -> str:
    """The allocating op and the innermost frame of one of :data:`LIBRARIES`: ``aten::op @ file.py(line): fn``."""
    op = next((n for n in frames if n.startswith("aten::")), "?")
    frame = next((n.split("/")[-1] for n in frames if ".py(" in n and any(lib in n for lib in LIBRARIES)), "-")
    return f"{op} @ {frame}"


def replay(events, drop=(), top: int = 12) -> dict:
    """The peak of the live bytes over the profile's start, replayed from its allocations and frees, leaving out
    every allocation made beneath a frame named in ``drop`` (and its free): what is live there by :func:`site`."""
    from _memory import ranked_sites

    def dropped_here(frames) -> bool:
        return bool(drop) and any(any(f"): {d}" in n or n.endswith(d) for d in drop) for n in frames if ".py(" in n)

    live: dict = {}
    dropped_ptrs: set = set()
    dropped = 0
    cur = peak = 0
    at_i = -1
    for i, e in enumerate(events):
        f = e.extra_fields
        frames = _frames(e)
        if f.alloc_size > 0:
            if dropped_here(frames):
                dropped_ptrs.add(f.ptr)
                dropped += f.alloc_size
                continue
            live[f.ptr] = (f.alloc_size, site(frames))
            cur += f.alloc_size
        else:
            if f.ptr in dropped_ptrs:
                dropped_ptrs.discard(f.ptr)
                continue
            cur -= live.pop(f.ptr, (0, None))[0]
        if cur > peak:
            peak, at_i = cur, i
    # what is live at the peak, by site
    live_at: dict = {}
    dropped_ptrs = set()
    for e in events[: at_i + 1]:
        f = e.extra_fields
        frames = _frames(e)
        if f.alloc_size > 0:
            if dropped_here(frames):
                dropped_ptrs.add(f.ptr)
                continue
            live_at[f.ptr] = (f.alloc_size, site(frames))
        elif f.ptr in dropped_ptrs:
            dropped_ptrs.discard(f.ptr)
        else:
            live_at.pop(f.ptr, None)
    at = site(_frames(events[at_i])) if at_i >= 0 else "-"
    return dict(peak=peak, at=at, sites=ranked_sites(live_at.values(), top), dropped=dropped)


# ------------------------------------------------------------------------------------------------ a step, composed

# The H200 step's bytes allocated before it (gpu_check.py part (c), 2026-12-04, base_gib 7.5437 in
# results/h200-2026-12-04/gpu_check.json): the bf16 policy, TRL's own float32 reference and DDP's gradient buckets,
# the same for every arm.
STEP_BASE = 8_099_971_072
# Which simulated head rows a step arm runs (arm, and fields the rows must have): the default as the new rule plans it
# at 80 GB free (the free memory at the loss call stays large: the step's peak is later, in the body's backward)
CAPACITY_ARMS = {"default": ("ours", dict(free_key="h100", rule="after")), "one_pass=1": ("ours_1p", {}),
                 "TRL 1.14": ("trl114", {}), "TRL 1.16": ("trl116", {}), "Liger-off": ("off", {})}  # fmt: skip


def _line(points):
    """``(a, b)`` of ``a + b L`` through the two longest of the ``(L, bytes)`` points (a linear fit: two lengths,
    nothing more)."""
    (l1, y1), (l2, y2) = sorted(points)[-2:]
    b = (y2 - y1) / (l2 - l1)
    return y1 - b * l1, b


def step_peak(rows: list[dict], trainer: str = "dpo") -> dict:
    """Per step arm, the lines (bytes over :data:`STEP_BASE` as ``a + b L``) of the step's three phases, composed
    from the simulated body (``body``) and head rows: the reference's forward beside the policy's activations; the
    head loss beside the activations and both hidden states; the body's backward beside the head's weight gradient.
    A model of a step from simulated phases, not one simulated step."""
    body = [r for r in rows if r.get("arm") == "body" and "phases" in r and r.get("checkpointing")]
    ph = {name: _line([(r["L"], r["phases"][key][kind]) for r in body])
          for name, key, kind in (("ref", "ref_forward", "peak"), ("live", "ref_forward", "end"),
                                  ("bwd", "backward", "peak"))}  # fmt: skip
    out = {}
    for name, (arm, fields) in CAPACITY_ARMS.items():
        heads = [r for r in rows if r.get("arm") == arm and r.get("trainer") == trainer and "peak" in r
                 and all(r.get(k) == v for k, v in fields.items())]  # fmt: skip
        if len({r["L"] for r in heads}) < 2:
            continue
        head = _line([(r["L"], r["peak"]) for r in heads])
        w_grad = max(r["results"]["w_grad"] or 0 for r in heads)
        loss = (ph["live"][0] + head[0], ph["live"][1] + head[1])
        out[name] = dict(ref=ph["ref"], loss=loss, bwd=(ph["bwd"][0] + w_grad, ph["bwd"][1]),
                         lengths=sorted({r["L"] for r in heads}))  # fmt: skip
    return out


def at(lines: dict, L: float) -> float:
    """The composed step's peak over its base at ``L``: the largest phase."""
    return max(a + b * L for key, (a, b) in lines.items() if key != "lengths")


def capacity(lines: dict, limit: float) -> int:
    """The longest ``L`` whose composed peak plus :data:`STEP_BASE` fits ``limit`` bytes (bisection on the lines)."""
    lo, hi = 1, 1 << 22
    if STEP_BASE + at(lines, lo) > limit:
        return 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if STEP_BASE + at(lines, mid) <= limit else (lo, mid)
    return lo


# ------------------------------------------------------------------------------------------------ the launcher


def launch(arm: str, kind: str, L: int, free_key: str | None, timeout: float, size=(V, H)) -> dict:
    """One arm in its own interpreter: TRL's release first on the path for the TRL arms, the checkout for ours."""
    env = dict(os.environ)
    first = [str(TRL_CACHE / TRL_OF[arm])] if arm in TRL_OF else []
    env["PYTHONPATH"] = os.pathsep.join(first + [str(ROOT), str(HERE)] + [env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    free = FREE[free_key] if free_key else None
    spec = json.dumps(dict(arm=arm, kind=kind, L=L, free=free, V=size[0], H=size[1]))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return dict(arm=arm, trainer=kind, L=L, free=free, error=f"timed out after {timeout:.0f} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return dict(arm=arm, trainer=kind, L=L, free=free, error=(proc.stderr or proc.stdout)[-1500:])
    row = json.loads(lines[-1])
    row.update(free_key=free_key, launch_s=round(time.perf_counter() - t0, 1))
    return row


def render(rows: list[dict], top: int = 6) -> str:
    out = []
    for r in rows:
        name = r["arm"] + (f"[{r['free_key']}]" if r.get("free_key") else "")
        if "error" in r:
            out.append(f"{r['trainer']} L={r['L']} {name:12} failed: {r['error'].strip().splitlines()[-1][:160]}")
            continue
        extra = ""
        if r["arm"].startswith("ours"):
            held = r.get("held") or {}
            extra = (f" path={r['path'].split(':')[0]} chunk={r['chunk']} sums={held.get('vh_sums', '-')} "
                     f"held={held.get('extra_bytes', 0) / 2**20:.0f} MiB")  # fmt: skip
        cpu = f" (CPU replay {r['cpu_peak'] / GIB:.3f}, CPU-only frames dropped {r['dropped'] / GIB:.2f} GiB)"
        out.append(f"{r['trainer']} L={r['L']} {name:12} peak {r['peak'] / GIB:.3f} GiB over the inputs"
                   f"{cpu if r['cpu_peak'] != r['peak'] else ''}{extra}  [{r['wall_s']} s]")  # fmt: skip
        out.append(f"      peak in {r['at']}")
        for s in r["sites"][:top]:
            out.append(f"      {s['bytes'] / GIB:7.3f} GiB x{s['blocks']:<4} {s['site']}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"of {', '.join(ARMS + PHASES)}")
    ap.add_argument("--trainers", default="dpo,kto")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--free", default="h100,h200,full", help=f"free memories for the ours arms: {', '.join(FREE)}")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--size", default=f"{V}x{H}", help="VxH of the head (a smaller one for a smoke run)")
    ap.add_argument("--json", default=None, help="append the rows to this JSON file (a list)")
    ap.add_argument("--capacity", metavar="JSON", help="compose the step from a run's rows and print its capacity")
    ap.add_argument("--limit-gb", type=float, default=80.0, help="per-rank memory for --capacity, in 10**9 bytes")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        sys.path.insert(0, str(HERE))
        spec = json.loads(args.child)
        if spec["arm"] == "body":
            row = run_body(spec["L"], spec["V"], spec["H"])
        elif spec["arm"] in PHASES:
            row = run_phase(spec["arm"], spec["L"])
        else:
            row = run_arm(spec["arm"], spec["kind"], spec["L"], spec["free"], spec["V"], spec["H"])
        print(json.dumps(row), flush=True)
        return 0
    if args.capacity:
        data = json.loads(Path(args.capacity).read_text())
        rows = data["rows"] if isinstance(data, dict) else data  # a results file, or what --json appended
        for trainer in args.trainers.split(","):
            for name, lines in step_peak(rows, trainer).items():
                cap = capacity(lines, args.limit_gb * 1e9)
                at4096 = (STEP_BASE + at(lines, 4096)) / GIB
                there = ", ".join(f"{k} {(STEP_BASE + a + b * cap) / GIB:.1f}" for k, (a, b) in lines.items()
                                  if k != "lengths")  # fmt: skip
                print(f"{trainer} {name:11} step at L=4,096 {at4096:6.2f} GiB; longest L within {args.limit_gb:g} GB: "
                      f"{cap:,} (lines from L={lines['lengths']}; there, GiB: {there})")  # fmt: skip
        return 0
    size = tuple(int(v) for v in args.size.split("x"))
    rows = []
    path = Path(args.json) if args.json else None
    for kind in args.trainers.split(","):
        for L in (int(v) for v in args.lengths.split(",")):
            for arm in args.arms.split(","):
                if arm in PHASES and kind != args.trainers.split(",")[0]:
                    continue  # no trainer in a phase: once
                for free_key in args.free.split(",") if arm.startswith("ours") else [None]:
                    row = launch(arm, kind, L, free_key, args.timeout, size)
                    rows.append(row)
                    print(render([row]), flush=True)
                    if path:
                        old = json.loads(path.read_text()) if path.exists() else []
                        path.write_text(json.dumps(old + [row], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
