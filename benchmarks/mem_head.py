#!/usr/bin/env python
"""What the routed Liger path holds at its memory peak, by who allocated it: one process, CPU, no DDP (issue 39).

    python benchmarks/mem_head.py                       # DPO and KTO at L=2,048, 50 % prompt, every arm
    python benchmarks/mem_head.py --lengths 512,2048 --arms ours,trl114

``bench_step.py`` says how much a rank peaks at (``VmHWM``), not what is live there.  This runs the part of a
step the arms differ in -- the policy's and the reference's decoders, the head loss, the backward -- on
``bench_step``'s model (Qwen2.5-0.5B's tied head, V=151,936, H=896, over 2 layers; fp32 weights, "mixed": the
GEMMs under bf16 autocast as TRL's ``bf16=True`` runs them) in one process, under ``torch.profiler`` with
``profile_memory``: every CPU allocation and free with the running total, replayed to find the peak over what was
live before the step (the weights) and what is live there, by the op (and the innermost Python frame of the package
or of this script) that allocated it.  Also the bytes the loss reports holding from its forward to its backward
(``held_bytes``) and the ``(V, H)`` sums among them.

Arms (the reference model is TRL's default: its own fp32 copy, parameters requiring grad as TRL leaves them):

  ours         the routed path as the package runs it by default: decoders, reference and loss in one autocast
               region (``accelerator.autocast()``), the package's default loss
  ours_1p      the same with ``one_pass=True`` forced (``LIGER_DDP_PATCH_LOSS=one_pass=1``: always one pass)
  ours_2p      the same with ``one_pass=False`` (the two-pass loss)
  ours_cache   ``ours`` with autocast's weight cache on (``cache_enabled=True``, what the package did before)
  ours_fp32    no autocast (``LIGER_DDP_PATCH_LOSS=autocast=0``, TRL 1.9-1.13's precision)
  trl114       TRL 1.14's structure: each decoder in its own autocast region, the policy's log-probs by
               ``_ChunkedLogProbFunction`` (needs ``.cache/trl/1.14.0``; DPO only, its sigmoid loss on top)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
ARMS = ("ours", "ours_1p", "ours_2p", "ours_cache", "ours_fp32", "trl114")
MODEL = dict(vocab_size=151_936, hidden_size=896, num_hidden_layers=2, intermediate_size=4_864, num_attention_heads=14,
             num_key_value_heads=2, head_dim=64)  # fmt: skip
GIB = 2**30


def build(size: dict, max_len: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(**size, tie_word_embeddings=True, max_position_embeddings=max(4096, max_len))
    policy = Qwen3ForCausalLM(cfg).float().train()
    ref = copy.deepcopy(policy).eval()  # TRL loads its own: parameters still require grad
    return policy, ref


def batch(kind: str, L: int, prompt: float, V: int):
    import torch

    g = torch.Generator().manual_seed(1)
    B = 2 if kind == "dpo" else 2
    ids = torch.randint(3, V, (B, L), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, : max(0, int(prompt * L) - 1)] = -100
    return ids, labels


def _autocast(on: bool, cache: bool = False):
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache) if on else contextlib.nullcontext()


def step(arm: str, kind: str, policy, ref, ids, labels):
    """One forward and backward of the part of a step the arms differ in; returns the loss object (or None)."""
    import torch

    if arm == "trl114":
        return _trl114(policy, ref, ids, labels)
    from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss

    one_pass = {"ours_1p": True, "ours_2p": False}.get(arm)
    kw = {} if one_pass is None else dict(one_pass=one_pass)
    fn = ChunkedDPOLoss(beta=0.1, **kw) if kind == "dpo" else ChunkedKTOLoss(beta=0.1, use_ref_model=True, **kw)
    W, rW = policy.get_output_embeddings().weight, ref.get_output_embeddings().weight
    with _autocast(arm != "ours_fp32", cache=arm == "ours_cache"):
        h = policy.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].contiguous()
        with torch.no_grad():
            rh = ref.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1].contiguous()
        if kind == "dpo":
            loss = fn(W, h, labels, None, rh, rW, None)[0]
        else:
            pref = torch.arange(ids.shape[0]) % 2 == 0
            loss = fn(_input=h, lin_weight=W, target=labels, bias=None, preference_labels=pref, ref_input=rh,
                      ref_weight=rW, ref_bias=None, kl=torch.tensor(0.1))[0]  # fmt: skip
    loss.backward()
    return fn


def _trl114(policy, ref, ids, labels):
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / ".cache" / "trl" / "1.14.0"))
    from trl.trainer.utils import _ChunkedLogProbFunction

    mask = labels != -100

    def logps(model, grad):
        with _autocast(True, cache=True):  # accelerator.autocast(): torch's default cache
            hid = model.base_model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        hid = hid[mask]
        with _autocast(True, cache=True):
            lp, _ = _ChunkedLogProbFunction.apply(hid, model.get_output_embeddings().weight, None, labels[mask], 1.0,
                                                  8192, None, 1.0)  # fmt: skip
        return torch.zeros(ids.shape[0]).index_add(0, mask.nonzero()[:, 0], lp)

    with torch.no_grad():
        r = logps(ref, False)
    p = logps(policy, True)
    d = 0.1 * ((p[0] - r[0]) - (p[1] - r[1]))
    (-F.logsigmoid(d)).backward()
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--trainers", default="dpo,kto")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--prompt", type=float, default=0.5)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch
    from _memory import cpu_replay
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    size = dict(MODEL, **({"vocab_size": args.vocab} if args.vocab else {}))
    lengths = [int(x) for x in args.lengths.split(",")]
    policy, ref = build(size, max(lengths))
    V, H = size["vocab_size"], size["hidden_size"]
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC  torch {torch.__version__}  V={V:,} H={H}  "
          f"load {os.getloadavg()[0]:.1f}  (V x H) fp32 = {V * H * 4 / GIB:.3f} GiB, bf16 {V * H * 2 / GIB:.3f} GiB",
          flush=True)  # fmt: skip
    out = []
    for kind in args.trainers.split(","):
        for L in lengths:
            ids, labels = batch(kind, L, args.prompt, V)
            for arm in args.arms.split(","):
                if arm == "trl114" and kind != "dpo":
                    continue
                policy.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
                    fn = step(arm, kind, policy, ref, ids, labels)
                wall = time.perf_counter() - t0
                r = cpu_replay(prof, ("liger_ddp_patch", "mem_head", "trl/"))
                held = getattr(fn, "last_held", None) or {}
                row = dict(arm=arm, trainer=kind, L=L, prompt=args.prompt, peak_gib=r["peak"] / GIB, wall_s=wall,
                           path=getattr(fn, "last_path", None), held=held, sites=r["sites"], at=r["at"])  # fmt: skip
                out.append(row)
                vh = held.get("vh_sums_bytes", 0) / GIB
                print(f"{kind} L={L} {arm:10} peak over weights {row['peak_gib']:.3f} GiB  held sums {vh:.3f} GiB  "
                      f"({wall:.1f} s profiled) path={row['path']}  peak in {r['at']}", flush=True)  # fmt: skip
                for s in r["sites"][:6]:
                    print(f"      {s['bytes'] / GIB:7.3f} GiB x{s['blocks']:<4} {s['site']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
