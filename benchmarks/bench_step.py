#!/usr/bin/env python
"""Benchmark: one whole DDP training step (DPO, KTO) with the package against what a user would do instead.

    python benchmarks/bench_step.py                          # the full table: ~1-2 h on 2 quiet cores
    python benchmarks/bench_step.py --lengths 512 --rounds 1 # L=512 rows only
    python benchmarks/bench_step.py --smoke                  # tiny vocabulary and length, one round (a test)

A step is what ``Trainer.train`` does between ``on_step_begin`` and ``on_step_end``: the policy and reference
forwards, the loss, the backward with DDP's all-reduce, the optimizer step.  Two ranks (``torchrun``, gloo, one
thread each on CPU), each on its own rows; a model whose LM head is real (Qwen2.5-0.5B's: vocabulary 151,936, hidden
896, tied to the embedding) over a small body (2 Qwen3 layers, intermediate 4,864, 14 heads, 2 KV heads).  Per rank:
one DPO pair (2 sequences) or two KTO rows (plus their 2 KL rows), every sequence exactly ``L`` tokens, the first
``prompt`` fraction of it prompt (0 %: an empty prompt).  fp32: fp32 weights, ``bf16=False``; bf16: bf16 weights and
``bf16=True`` (the loss then gets bf16 tensors); mixed: fp32 weights and ``bf16=True`` (TRL's default config on a
full fine-tune: Liger-off and TRL 1.14 run their GEMMs under autocast, and so does the patched path).  SGD: AdamW's
two fp32 states would add 8 bytes per parameter to every arm alike (1.3 GB per rank here).  Liger's Triton model
kernels off in every arm (``liger_kernel_config``), so that the arms differ in the loss path only.

Arms, each its own ``torchrun`` (its own processes), interleaved: for every configuration one launch per arm, the
order rotated every round.

  patched    TRL 1.12.0 with ``use_liger_kernel=True`` and this package imported first: the fix
  off        TRL 1.12.0 with ``use_liger_kernel=False``: TRL's own path, the full ``(B, L, V)`` logits
  trl114     TRL 1.14.0 (``.cache/trl/1.14.0`` first on ``PYTHONPATH``) with ``use_liger_kernel=True``: upstream's fix
  trl116     TRL 1.16.0 (``.cache/trl/1.16.0``) as a user who upgrades runs it: TRL's default DPO/KTO config with the
             job's ``use_liger_kernel=True`` kept.  Since 1.15 the flag is deprecated (a FutureWarning) and applies
             only Liger's layer kernels, off here as in every arm; the trainers always compute the per-token
             log-probs in the fused LM head that ``add_fused_lm_head`` patches into the model's forward
             (trl/trainer/utils.py:1548, dpo_trainer.py:937-962, kto_trainer.py:948-972 of 1.16.0): Triton kernels
             over the completion tokens on a GPU, torch tiles over every position (the prompt's too) on CPU.  Its
             reference model, when TRL builds it, is loaded in the policy's dtype (dpo_trainer.py:924,
             kto_trainer.py:935), where 1.12 and 1.14 load it in fp32
  unpatched  TRL 1.12.0 with ``use_liger_kernel=True``, no package: the broken run (no all-reduce), speed reference only

The upgrades (``_upgrades.UPGRADES``: trl114, trl116, the newest last) are the peers of issue 39's "never worse" rule:
``verdict`` checks the patched step's time against Liger-off and each of them.  The next release is one row there.

Per arm: the median step time after ``--warmup`` steps (a step ends when its slower rank ends it), tokens per second
(both ranks' sequence tokens: 2 x 2 x L per step), peak RSS per rank (``VmHWM``, the larger rank; a launch runs one
configuration, so the high-water mark is this run's), and every ratio ``patched / arm`` as the median of the per-round
ratios.  A launch that crashes, runs out of memory or is stopped by the memory guard is a row that says so.

Memory guard: before a launch the script estimates its two ranks' peak RSS (from a shorter length of the same
configuration already measured in this run, scaled linearly in ``L`` beyond the parameter-sized part; otherwise from
``(B, L, V)`` logits counts) and does not launch one over ``--mem-limit-gib`` (default 10): that row reads
"not run here: memory" with the estimate.  A launch whose processes pass ``--mem-kill-gib`` anyway is killed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _upgrades

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TRL_DIRS = Path(os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", ROOT / ".cache" / "trl"))
# the upgrades a user could take instead of the package (trl114, trl116: _upgrades.UPGRADES), each an arm
UPGRADES = {arm: upgrade.release for arm, upgrade in _upgrades.UPGRADES.items()}
ARMS = ("patched", "off", *UPGRADES, "unpatched")
# beyond the default arms: the package with the loss's Triton sweep (LIGER_DDP_PATCH_LOSS=sweep=triton; a GPU's)
# and the package without the routed autocast (LIGER_DDP_PATCH_LOSS=autocast=0: TRL 1.9-1.13's precision) or without
# the chunked KTO KL log-probs (LIGER_DDP_PATCH_DISABLE=kto_kl_logps: TRL 1.9-1.13's whole-vocabulary KL logits)
# and the package with one pass for every pair (LIGER_DDP_PATCH_LOSS=one_pass=1: the default before issue 39, which
# holds long pairs' (V, H) sums whatever the budget)
EXTRA_ARMS = ("patched_triton", "patched_noautocast", "patched_fullkl", "patched_onepass")
TRL_OF = {"patched": "1.12.0", "patched_triton": "1.12.0", "patched_noautocast": "1.12.0", "patched_fullkl": "1.12.0",
          "patched_onepass": "1.12.0", "off": "1.12.0", **UPGRADES, "unpatched": "1.12.0"}  # fmt: skip
TRAINERS = ("dpo", "kto")
DTYPES = ("fp32", "bf16", "mixed")
PROMPTS = (0.5, 0.0)
LENGTHS = (512, 2048)
# The Qwen2.5-0.5B head over a 2-layer body.
MODEL = dict(V=151_936, H=896, layers=2, intermediate=4_864, heads=14, kv_heads=2, head_dim=64)
SMOKE_MODEL = dict(V=512, H=32, layers=2, intermediate=64, heads=2, kv_heads=1, head_dim=16)
# Liger's Triton model kernels: off in every arm (they need a GPU here, and the arms must differ in the loss only).
NO_TRITON = {k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy",
                                "layer_norm", "geglu")}  # fmt: skip
WORDS = [f"w{i}" for i in range(64)]
GIB = 2**30


# ------------------------------------------------------------------------------------------------ the worker


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rows(kind: str, L: int, prompt: float, n: int, rank: int) -> list[dict]:
    """``n`` rows whose prompt is ``prompt * L`` words and whose completion is longer than the rest (the collator
    truncates every sequence to exactly ``L`` tokens); different words per rank and row."""
    n_prompt = int(prompt * L)

    def text(start, count):
        return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(count))

    rows = []
    for i in range(n):
        seed = 7 * rank + 3 * i
        row = {"prompt": text(seed, n_prompt), "chosen": text(seed + 1, L + 8), "rejected": text(seed + 2, L + 8)}
        if kind == "kto":
            row = {"prompt": row["prompt"], "completion": row["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
        rows.append(row)
    return rows


def _start_profile(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    prof.__enter__()
    return prof


def device_us(event) -> float:
    """A profiler event's self device time in microseconds (torch renamed ``self_cuda_time_total``)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0


def gpu_kernels(events) -> list:
    """The GPU's own events (kernels, copies) of a profile's ``key_averages()``; empty on CPU."""
    return [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]


def _write_profile(prof, wall_s: float, prefix: str, top: int = 25) -> None:
    """One profiled step, summarised (``<prefix>.rank<r>.json``): the ops by self CPU and by self device time."""
    prof.__exit__(None, None, None)
    events = prof.key_averages()
    device, kernels = device_us, gpu_kernels(events)

    def ranked(rows, key):
        rows = sorted(rows, key=key, reverse=True)[:top]
        return [dict(op=e.key[:120], n=e.count, cpu_ms=e.self_cpu_time_total / 1e3, dev_ms=device(e) / 1e3)
                for e in rows]  # fmt: skip

    out = dict(wall_s=wall_s, cpu_ms=sum(e.self_cpu_time_total for e in events) / 1e3,
               dev_ms=sum(device(e) for e in kernels) / 1e3, by_cpu=ranked(events, lambda e: e.self_cpu_time_total),
               by_dev=ranked(kernels, device))  # fmt: skip
    Path(f"{prefix}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(out))


def worker(args) -> None:
    """One configuration under one arm, inside torchrun; rank 0 writes the JSON result to ``--out``."""
    if args.arm.startswith("patched"):
        import liger_ddp_patch  # noqa: F401  (before TRL, as a user's script would)
    import importlib
    import traceback

    import _memory
    import torch
    import torch.distributed as dist

    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result: dict = dict(arm=args.arm, trainer=args.trainer, dtype=args.dtype, prompt=args.prompt, L=args.length)
    try:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

        result["trl"] = trl.__version__
        module = importlib.import_module(f"trl.trainer.{args.trainer}_trainer")
        config_cls = getattr(module, f"{args.trainer.upper()}Config")
        trainer_cls = getattr(module, f"{args.trainer.upper()}Trainer")
        dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(args.assets)
        model = AutoModelForCausalLM.from_pretrained(args.assets, dtype=dtype)
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        batch = 1 if args.trainer == "dpo" else 2  # DPO: one pair (2 sequences); KTO: 2 rows (its KL needs > 1)
        steps = args.warmup + args.steps
        profile_to = os.environ.get("BENCH_STEP_PROFILE")  # gpu_profile.py: one more step, profiled, not timed
        memory_to = os.environ.get("BENCH_STEP_MEMORY")  # gpu_check.py --memory: its peak by site (CUDA, rank 0)
        memory_to = memory_to if memory_to and rank == 0 else None
        steps += bool(os.environ.get("BENCH_STEP_PROFILE") or os.environ.get("BENCH_STEP_MEMORY"))
        dataset = Dataset.from_list(_rows(args.trainer, args.length, args.prompt, batch * steps * world, rank))
        cfg = config_cls(
            output_dir=tempfile.mkdtemp(prefix=f"bench-step-{args.trainer}-"),
            use_liger_kernel=args.arm != "off",
            liger_kernel_config=NO_TRITON,
            per_device_train_batch_size=batch,
            max_steps=steps,
            max_length=args.length,
            bf16=args.dtype in ("bf16", "mixed"),
            optim="sgd",
            learning_rate=1e-4,
            logging_steps=1,
            use_cpu=not cuda,
            ddp_backend="gloo",
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        times: list[float] = []
        cpu: list[float] = []  # this process's CPU seconds per step: what a shared machine's load hardly moves
        state: dict = {}

        def sync():
            if cuda:
                torch.cuda.synchronize()

        class StepTimer(TrainerCallback):
            def on_train_begin(self, *_a, **_k):
                sync()
                state["base"] = torch.cuda.memory_allocated() if cuda else _rss("VmRSS")
                if cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_begin(self, *_a, **_k):
                sync()
                if len(times) == args.warmup + args.steps:  # the extra step: watched, not timed
                    state["extra"] = True
                    if memory_to:
                        state["mem"] = _memory.record(cuda)
                    if profile_to:
                        state["prof"] = _start_profile(cuda)
                state["t0"], state["c0"] = time.perf_counter(), time.process_time()

            def on_step_end(self, *_a, **_k):
                sync()
                if state.pop("extra", False):
                    if profile_to:
                        _write_profile(state.pop("prof"), time.perf_counter() - state["t0"], profile_to)
                    if memory_to:
                        mem = _memory.summary(state.pop("mem", None), cuda)
                        Path(f"{memory_to}.rank{rank}.json").write_text(json.dumps(mem))
                    return
                times.append(time.perf_counter() - state["t0"])
                cpu.append(time.process_time() - state["c0"])

        extra = {}
        if args.ref_same_dtype:  # else TRL loads the reference model itself, in fp32 (its model_init_kwargs default)
            extra["ref_model"] = AutoModelForCausalLM.from_pretrained(args.assets, dtype=dtype)
        trainer = trainer_cls(model=model, args=cfg, train_dataset=dataset, processing_class=tokenizer, **extra)
        trainer.add_callback(StepTimer())
        trainer.train()
        peak = torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")
        losses = sorted({type(v).__name__ for v in vars(trainer).values() if "Loss" in type(v).__name__})
        # the package's loss says which path its last call took and what its one-pass plan holds (issue 39)
        ours = [v for v in vars(trainer).values() if hasattr(v, "last_held") and hasattr(v, "last_path")]
        held = dict(ours[0].last_held or {}, path=ours[0].last_path) if ours else None
        # the reference model's dtype: TRL 1.12 and 1.14 build it in fp32, 1.16 in the policy's dtype
        ref = getattr(trainer, "ref_model", None)
        ref_dtype = str(next(ref.parameters()).dtype).removeprefix("torch.") if ref is not None else None
        # seqs: the sequences the policy trains on per rank (a DPO pair is two; KTO's KL rows are not counted)
        mine = dict(times=times, cpu=cpu, base=state.get("base"), peak=peak, losses=losses, world=world, seqs=2 * batch
                    if args.trainer == "dpo" else batch, held=held, ref_dtype=ref_dtype)  # fmt: skip
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        result.update(ranks=ranks)
    except BaseException as exc:  # noqa: BLE001  (an out-of-memory error is a result: report it)
        result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        result["trace"] = traceback.format_exc()[-3000:]
        print(f"[bench_step] {args.arm} failed: {result['error']}", file=sys.stderr, flush=True)
    if int(os.environ.get("RANK", "0")) == 0 and (not os.path.exists(args.out) or "error" not in result):
        Path(args.out).write_text(json.dumps(result))
    if dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001  (the other rank may be gone after a crash)
            pass


# ------------------------------------------------------------------------------------------------ the launcher


def build_assets(directory: Path, size: dict, dtype: str = "float32", device: str = "cpu") -> Path:
    """A word-level tokenizer (one token per word) and the model (tied, saved in ``dtype``) saved to ``directory``:
    the tests' tiny-model builder at this size.

    Saved, not built in each rank: TRL loads the reference model from the policy's ``name_or_path``.  ``device``:
    where the weights are drawn (a GPU draws a billion in a moment).
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # the checkout's package, as the ranks get it (a GPU machine has no install)
    from liger_ddp_patch.demo.tiny import build

    return build(directory, size["V"], tied=True, words=WORDS, dtype=dtype, device=device, hidden_size=size["H"],
                 intermediate_size=size["intermediate"], num_hidden_layers=size["layers"],
                 num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], head_dim=size["head_dim"],
                 max_position_embeddings=size.get("max_len", 4096))  # fmt: skip


def n_params(size: dict) -> int:
    H, inter = size["H"], size["intermediate"]
    attn = H * size["heads"] * size["head_dim"] * 2 + H * size["kv_heads"] * size["head_dim"] * 2
    return size["V"] * H + size["layers"] * (attn + 3 * H * inter)


def _sizes_per_rank(arm: str, dtype: str, L: int, size: dict) -> float:
    """One rank's peak RSS from the sizes alone, in bytes: 0.6 GiB of runtime, five parameter-sized tensors (policy,
    reference, gradients, DDP's buckets, the tied embedding's own gradient) and the fp32 logits of the two
    sequences per rank with gradients times 3.5 for ``off`` (logits, log-softmax and their gradients: 3.3 measured
    at L=128, fp32 DPO), times 0.5 for the chunked arms (the body's activations, the loss's chunk)."""
    pbytes = n_params(size) * (2 if dtype == "bf16" else 4)
    logits = 2 * L * size["V"] * 4
    return 0.6 * GIB + 5 * pbytes + (3.5 if arm == "off" else 0.5) * logits


def estimate_gib(arm: str, cfg: tuple, size: dict, measured: dict) -> tuple[float, str]:
    """Two ranks' peak RSS for ``arm`` at ``cfg``, in GiB, and how it was estimated.

    From shorter lengths of the same (arm, trainer, dtype, prompt) already measured (this run or ``--calibration``):
    two lengths give a line through their peaks; one gives its peak plus what :func:`_sizes_per_rank` adds from
    there to L.  Otherwise :func:`_sizes_per_rank` alone.
    """
    trainer, dtype, prompt, L = cfg
    shorter = sorted(
        (ll, r) for (a, t, d, p, ll), r in measured.items() if (a, t, d, p) == (arm, trainer, dtype, prompt) and ll < L
    )
    peak = {ll: max(x["peak"] for x in r["ranks"]) for ll, r in shorter}
    if len(shorter) >= 2:
        (l0, _), (l1, _) = shorter[-2], shorter[-1]
        slope = max(peak[l1] - peak[l0], 0) / (l1 - l0)
        return 2 * (peak[l1] + slope * (L - l1)) / GIB, f"line through the peaks at L={l0} and L={l1}"
    if shorter:
        l0 = shorter[-1][0]
        grow = _sizes_per_rank(arm, dtype, L, size) - _sizes_per_rank(arm, dtype, l0, size)
        return 2 * (peak[l0] + grow) / GIB, f"peak at L={l0} + logits-sized growth"
    return 2 * _sizes_per_rank(arm, dtype, L, size) / GIB, "from sizes (0.6 GiB + 5 x parameters + logits)"


def _available_gib(need: float = 0.0, wait_s: float = 60.0) -> float:
    """Memory available now, in GiB; waits up to ``wait_s`` for ``need`` GiB (a launch just killed by the memory guard
    takes some seconds to hand its memory back)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        free = psutil.virtual_memory().available / GIB
        if free >= need or time.monotonic() > deadline:
            return free
        time.sleep(2)


def _tree(pid: int) -> list:
    """``pid`` and every process under it (``psutil`` processes; none without psutil, as on a GPU image)."""
    try:
        import psutil
    except ImportError:  # (a GPU image without it: the memory guard is off there anyway)
        return []

    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _tree_rss(pid: int) -> int:
    total = 0
    for p in _tree(pid):
        try:
            total += p.memory_info().rss
        except Exception:  # noqa: BLE001  (psutil.Error: it ended meanwhile)
            pass
    return total


def trl_dirs(args) -> dict[str, str]:
    """Where each arm's TRL comes from: the installed 1.12.0 (or ``.cache/trl/1.12.0``), ``.cache/trl/<release>``
    for each upgrade."""
    found = {release: str(TRL_DIRS / release) for release in UPGRADES.values()}
    return {"1.12.0": str(TRL_DIRS / "1.12.0") if args.trl112_from_cache else "", **found}


def arm_env(arm: str, threads: int, paths: dict, environ=None) -> dict:
    """The environment of an arm's ranks: its TRL first on ``PYTHONPATH``; the package off unless the arm is
    patched (whatever a .pth or sitecustomize might bring); ``patched_triton``: the loss's Triton sweep."""
    env = dict(os.environ if environ is None else environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    first = [paths.get(TRL_OF[arm], ""), paths.get("common", ""), str(ROOT), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in first if p)
    if not arm.startswith("patched"):
        env["LIGER_DDP_PATCH_DISABLE"] = "1"
    if arm == "patched_triton":
        env["LIGER_DDP_PATCH_LOSS"] = "sweep=triton"
    if arm == "patched_noautocast":
        env["LIGER_DDP_PATCH_LOSS"] = "autocast=0"
    if arm == "patched_fullkl":
        env["LIGER_DDP_PATCH_DISABLE"] = "kto_kl_logps"
    if arm == "patched_onepass":
        env["LIGER_DDP_PATCH_LOSS"] = "one_pass=1"
    return env


def launch(arm: str, cfg: tuple, args, assets: Path, out_dir: Path, paths: dict | None = None) -> dict:
    """One configuration under one arm in two fresh ranks: rank 0's result, or a row saying why there is none.

    ``args.nodes`` 1: ``torchrun --standalone --nproc_per_node=2``; 2: two one-process torchrun "nodes" on loopback
    (on one GPU both ranks then see ``LOCAL_RANK`` 0, i.e. cuda:0).  ``paths``: ``{TRL version: folder ("" for the
    installed one), "common": folder or ""}`` put first on ``PYTHONPATH`` (default :func:`trl_dirs`).
    """
    import signal

    paths = paths if paths is not None else trl_dirs(args)
    trainer, dtype, prompt, L = cfg
    out = out_dir / f"{arm}-{trainer}-{dtype}-{int(prompt * 100)}-{L}-{time.monotonic_ns()}.json"
    env = arm_env(arm, args.threads, paths)
    worker_cmd = [str(Path(__file__).resolve()), "--worker", "--arm", arm, "--trainer", trainer, "--dtype", dtype,
                  "--prompt", str(prompt), "--length", str(L), "--assets", str(assets), "--out", str(out),
                  "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                  *(["--ref-same-dtype"] if getattr(args, "ref_same_dtype", False) else [])]  # fmt: skip
    run = [sys.executable, "-m", "torch.distributed.run"]
    if getattr(args, "nodes", 1) == 2:
        import socket

        with socket.socket() as sock:  # a free port on loopback for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmds = [[*run, "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                 f"--master_port={port}", *worker_cmd] for rank in (0, 1)]  # fmt: skip
    else:
        cmds = [[*run, "--standalone", f"--nproc_per_node={args.nproc}", *worker_cmd]]
    started, killed, tree_peak, procs, logs = time.monotonic(), None, 0, [], []
    for i, cmd in enumerate(cmds):  # each to a file, not a pipe: a blocked rank would hold the other
        logs.append(out.with_suffix(f".{i}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    while any(p.poll() is None for p in procs):
        time.sleep(0.25)
        rss = sum(_tree_rss(p.pid) for p in procs)
        tree_peak = max(tree_peak, rss)
        if args.device == "cpu" and rss > args.mem_kill_gib * GIB:
            killed = f"killed by the memory guard: its processes passed {args.mem_kill_gib} GiB"
        elif time.monotonic() - started > args.timeout:
            killed = f"timed out after {args.timeout:.0f} s"
        if killed:
            for p in procs:
                if p.poll() is None:
                    ranks = _tree(p.pid)  # torchrun starts its ranks in sessions of their own: kill them by name
                    os.killpg(p.pid, signal.SIGKILL)
                    for rank in ranks:
                        try:
                            rank.kill()
                        except Exception:  # noqa: BLE001  (gone already)
                            pass
                    p.wait()
            break
    text = "\n".join(path.read_text(errors="replace") for path in logs)
    result = json.loads(out.read_text()) if out.exists() else {}
    result.update(arm=arm, trainer=trainer, dtype=dtype, prompt=prompt, L=L, wall_s=time.monotonic() - started)
    result["tree_peak_gib"] = tree_peak / GIB
    if killed:
        result["error"] = killed
    elif "ranks" not in result and "error" not in result:
        codes = [p.returncode for p in procs]
        oom = any(c in (-9, 137) for c in codes) or "Killed" in text or "out of memory" in text.lower()
        why = "out of memory (killed)" if oom else f"crashed (exit {codes})"
        result["error"] = f"{why}: {text.strip().splitlines()[-1][:300] if text.strip() else ''}"
    if "error" in result:
        result["log_tail"] = text[-3000:]
    return result


def summarise(arm: str, runs: list[dict]) -> dict:
    """Median over rounds of the per-round step time (the slower rank's median step), of the CPU seconds per step
    (the larger rank's median) and of the peak RSS."""
    good = [r for r in runs if "ranks" in r]
    if not good:
        return {"error": runs[-1].get("error", "no run") if runs else "no run"}
    steps, cpus, peaks, bases = [], [], [], []
    for r in good:
        warm = r.get("warmup", 1)
        per_step = [max(rank["times"][i] for rank in r["ranks"]) for i in range(len(r["ranks"][0]["times"]))]
        steps.append(statistics.median(per_step[warm:]))
        cpus.append(max(statistics.median(rank["cpu"][warm:]) if rank.get("cpu") else 0.0 for rank in r["ranks"]))
        peaks.append(max(rank["peak"] for rank in r["ranks"]))
        bases.append(max(rank["base"] for rank in r["ranks"]))
    first = good[0]["ranks"][0]
    tokens = first["seqs"] * first["world"] * good[0]["L"]
    s = statistics.median(steps)
    # the loss's own accounting (the package's arms): the (V, H) sums its one-pass plan holds beside the weight
    # gradient (on the two-pass path: what one pass would have held), the larger rank's, and the path it took
    helds = [rank["held"] for r in good for rank in r["ranks"] if rank.get("held")]
    held = max(helds, key=lambda h: h.get("vh_sums_bytes", 0)) if helds else None
    return dict(s=s, tok_s=tokens / s, cpu_s=statistics.median(cpus), peak_gib=statistics.median(peaks) / GIB,
                base_gib=statistics.median(bases) / GIB, tokens=tokens, rounds=len(good), losses=first["losses"],
                steps=steps, held=held)  # fmt: skip


def ratios(runs: dict[str, list[dict]], a: str, b: str, key: str) -> float | None:
    """Median of the per-round ratios ``a / b`` (the two ran in the same round, minutes apart)."""
    out = []
    for ra, rb in zip(runs.get(a, []), runs.get(b, [])):
        sa, sb = summarise(a, [ra]), summarise(b, [rb])
        if "error" not in sa and "error" not in sb and sb[key] > 0:
            out.append(sa[key] / sb[key])
    return statistics.median(out) if out else None


def render(table: list[dict], arms: list[str], header: str) -> str:
    lines = [header, ""]
    cols = ["trainer", "dtype", "prompt", "L", "tokens/step"]
    for arm in arms:
        cols += [f"{arm} s", f"{arm} tok/s", f"{arm} GiB"]
    peers = [a for a in arms if a != "patched"]
    cols += [f"patched/{a} {k}" for k in ("time", "cpu", "mem") for a in peers]
    ours = [a for a in arms if a.startswith("patched")]
    cols += [f"{a} held (V,H) GiB, path" for a in ours] + ["targets"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    notes = []
    for row in table:
        cells = [row["trainer"].upper(), row["dtype"], f"{row['prompt']:.0%}", str(row["L"]), str(row["tokens"])]
        for arm in arms:
            s = row["arms"].get(arm, {})
            if "error" in s:
                mark = "not run" if s["error"].startswith("not run") else "failed"
                cells += [mark, "-", "-"]
                notes.append(f"{row['trainer'].upper()} {row['dtype']} {row['prompt']:.0%} L={row['L']} {arm}: "
                             f"{s['error']}")  # fmt: skip
            else:
                cells += [f"{s['s']:.2f}", f"{s['tok_s']:.0f}", f"{s['peak_gib']:.2f}"]
        for key in ("time", "cpu", "mem"):
            for a in peers:
                v = row["ratios"].get(f"{key}/{a}")
                cells.append("-" if v is None else f"{v:.2f}")
        for a in ours:
            cells.append(held_cell(row["arms"].get(a, {}).get("held")))
        cells.append(row["verdict"])
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Not run or failed:", *(f"* {n}" for n in notes)]
    return "\n".join(lines)


def held_cell(held: dict | None) -> str:
    """The (V, H) sums' GiB the loss held beside the weight gradient and the path it took: ``0.51 (one-pass)``,
    ``0.00 (one-pass, wider chunk: +0.02)`` where a chunk widened to the longest row replaced the sums, or
    ``0.00 (two-pass; one pass: 0.51)`` where the budget sent it to the two-pass path."""
    if not held:
        return "-"
    path, would = str(held.get("path") or "?"), held.get("vh_sums_bytes", 0) / GIB
    wider = f", wider chunk: +{held['chunk_bytes'] / GIB:.2f}" if held.get("chunk_bytes") else ""
    if path == "one-pass":
        return f"{would:.2f} (one-pass{wider})"
    return f"0.00 (two-pass; one pass: {would:.2f}{wider})" if "would hold" in path else f"0.00 ({path})"


def verdict(row: dict) -> str:
    """The issue's targets: patched no slower than off and than each upgrade (trl114, trl116); at L >= 2048 peak
    memory <= 0.5x off's."""
    out = []
    for peer in ("off", *UPGRADES):
        v = row["ratios"].get(f"time/{peer}")
        out.append(f"{'?' if v is None else ('ok' if v <= 1.0 else 'MISS')} time/{peer}")
    if row["L"] >= 2048:
        v = row["ratios"].get("mem/off")
        out.append(f"{'?' if v is None else ('ok' if v <= 0.5 else 'MISS')} mem/off")
    return ", ".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model (V=512, H=32), L=32, fp32, 50 %% prompt")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--trainers", default=None, help=",".join(TRAINERS))
    ap.add_argument("--dtypes", default=None, help=",".join(DTYPES))
    ap.add_argument("--prompts", default=None, help=",".join(map(str, PROMPTS)))
    ap.add_argument("--lengths", default=None, help=",".join(map(str, LENGTHS)))
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 151,936)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per launch (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (OMP_NUM_THREADS)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1, choices=(1, 2), help="2: two one-process nodes (one GPU)")
    ap.add_argument("--mem-limit-gib", type=float, default=10.0, help="skip a launch estimated above this (2 ranks)")
    ap.add_argument("--mem-kill-gib", type=float, default=12.0, help="kill a launch whose processes pass this")
    ap.add_argument("--budget-s", type=float, default=None, help="launch nothing after this many seconds")
    ap.add_argument("--calibration", action="append", help="an earlier --json output: seeds the memory estimates")
    ap.add_argument("--reuse", action="append", help="an interrupted run's folder: its finished launches count")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    ap.add_argument("--json", default=None, help="write every launch and the table here")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--trl112-from-cache", action="store_true", help="TRL 1.12.0 from .cache/trl, not the installed")
    # the worker's own options
    ap.add_argument("--ref-same-dtype", action="store_true",
                    help="pass a reference model in the policy's dtype (default: TRL loads it, in fp32)")  # fmt: skip
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--trainer", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--assets", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        args.dtypes, args.prompts, args.lengths = args.dtypes or "fp32", args.prompts or "0.5", args.lengths or "32"
        size = dict(SMOKE_MODEL)
    else:
        size = dict(MODEL)
    if args.vocab:
        size["V"] = args.vocab
    args.trainers = args.trainers or ",".join(TRAINERS)
    args.dtypes = args.dtypes or ",".join(DTYPES)
    args.prompts = args.prompts or ",".join(map(str, PROMPTS))
    args.lengths = args.lengths or ",".join(map(str, LENGTHS))
    arms = args.arms.split(",")
    if unknown := set(arms) - set(ARMS + EXTRA_ARMS):
        ap.error(f"unknown arm(s) {sorted(unknown)}; arms: {', '.join(ARMS + EXTRA_ARMS)}")
    # shortest length first (it seeds the memory estimates of the longer ones); trainers alternate fastest
    configs = [(t, d, float(p), int(n)) for n in args.lengths.split(",") for p in args.prompts.split(",")
               for d in args.dtypes.split(",") for t in args.trainers.split(",")]  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="bench-step-"))
    size["max_len"] = max(4096, *(c[3] for c in configs))
    assets = build_assets(work / "model", size)
    import _machine
    import torch

    started = time.monotonic()
    header = (f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC  {_machine.describe()}  {os.cpu_count()} CPUs  "
              f"torch {torch.__version__}  {args.nproc} ranks x {args.threads} thread(s), gloo  V={size['V']:,} "
              f"H={size['H']} layers={size['layers']} ({n_params(size) / 1e6:.0f} M parameters, tied)  "
              f"SGD  rounds={args.rounds} warm-up={args.warmup} measured steps={args.steps}")  # fmt: skip
    print(header, flush=True)
    runs: dict[tuple, list[dict]] = {}
    measured: dict[tuple, dict] = {}
    reuse: dict[tuple, list[dict]] = {}  # --reuse: launches an interrupted run finished, taken instead of relaunching
    for folder in args.reuse or []:
        for path in sorted(Path(folder).glob("*.json")):
            r = json.loads(path.read_text())
            if "ranks" in r:
                reuse.setdefault((r["arm"], r["trainer"], r["dtype"], float(r["prompt"]), int(r["L"])), []).append(r)
    for path in args.calibration or []:  # earlier --json outputs: what they measured seeds the memory estimates
        for r in json.loads(Path(path).read_text())["runs"]:
            if "ranks" in r:
                measured[(r["arm"], r["trainer"], r["dtype"], r["prompt"], r["L"])] = r
    for rnd in range(args.rounds):
        for i, cfg in enumerate(configs):
            k = (rnd + i) % len(arms)
            for arm in arms[k:] + arms[:k]:  # the order rotates: no arm always runs first or last
                est, how = estimate_gib(arm, cfg, size, measured)
                est *= args.nproc / 2  # the estimates are for two ranks (--nproc 1: one rank's memory alone)
                free = _available_gib(est + 2 if est <= args.mem_limit_gib else 0.0) if args.device == "cpu" else 0.0
                res = dict(arm=arm, trainer=cfg[0], dtype=cfg[1], prompt=cfg[2], L=cfg[3], estimate_gib=est)
                if args.device == "cpu" and est > args.mem_limit_gib:
                    res["error"] = (f"not run here: memory (estimated {est:.1f} GiB for {args.nproc} ranks > "
                                    f"{args.mem_limit_gib:g} GiB; {how})")  # fmt: skip
                elif args.device == "cpu" and est + 2 > free:
                    res["error"] = f"not run here: memory (estimated {est:.1f} GiB; {free:.1f} GiB available now)"
                elif reuse.get((arm, *cfg)):
                    res = dict(reuse[(arm, *cfg)].pop(0), reused=True, wall_s=0.0)
                elif args.budget_s and time.monotonic() - started > args.budget_s:
                    res["error"] = f"not run here: time (the {args.budget_s:.0f} s budget was spent)"
                else:
                    res = launch(arm, cfg, args, assets, work)
                    res["estimate_gib"] = est
                res["warmup"] = args.warmup
                res["round"] = rnd
                runs.setdefault(cfg, {}).setdefault(arm, []).append(res)
                if "ranks" in res:
                    measured[(arm, *cfg)] = res
                s = summarise(arm, [res])
                what = s["error"][:160] if "error" in s else (
                    f"{s['s']:.2f} s/step, peak {s['peak_gib']:.2f} GiB/rank, {' '.join(s['losses'])}")  # fmt: skip
                print(f"[round {rnd + 1}] {cfg[0]} {cfg[1]} {cfg[2]:.0%} L={cfg[3]} {arm:9} est {est:5.1f} GiB "
                      f"{res.get('wall_s', 0):5.0f} s wall: {what}", flush=True)  # fmt: skip
    table = []
    for cfg, by_arm in runs.items():
        row = dict(trainer=cfg[0], dtype=cfg[1], prompt=cfg[2], L=cfg[3], tokens=2 * args.nproc * cfg[3])
        row["arms"] = {arm: summarise(arm, by_arm.get(arm, [])) for arm in arms}
        row["ratios"] = {}
        for peer in arms:
            if peer != "patched":
                row["ratios"][f"time/{peer}"] = ratios(by_arm, "patched", peer, "s")
                row["ratios"][f"cpu/{peer}"] = ratios(by_arm, "patched", peer, "cpu_s")
                row["ratios"][f"mem/{peer}"] = ratios(by_arm, "patched", peer, "peak_gib")
        row["verdict"] = verdict(row)
        table.append(row)
    text = render(table, arms, f"`{header}`")
    print("\n" + text)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(header=header, size=size, table=table,
                                                   runs=[r for by in runs.values() for v in by.values() for r in v]),
                                              indent=1, default=str))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
