"""Where the default check acts, and what it says: one setup per launch, a plain transformers Trainer on a tiny model.

Run under ``torchrun`` (2 CPU ranks, gloo) or as one process. Each rank trains on other rows (the Trainer's sampler),
so gradients that DDP never all-reduced differ. Rank 0 writes JSON to ``--out``: the collectives the package ran
(all-gathers called from ``liger_ddp_patch``), its log lines, the error if the job stopped, the steps each check
compared, and whether the Trainer pickles and deep-copies.

Setups (``--setup``): ``ddp-liger`` (a Liger flag on the trainer, as TRL's set it), ``ddp`` (no Liger), ``desync``
(Liger, the loss computed on the unwrapped model from the first step: TRL #7245's shape), ``desync-late`` (the same
from step 1: step 0 is in sync, the checkpoint is not), ``sparse`` (an ``Embedding(sparse=True)``, SGD), ``fsdp1`` /
``fsdp2`` (the model sharded by FSDP, ``use_orig_params=True`` / ``fully_shard``: what a Trainer launched from an
accelerate config holds while its ``TrainingArguments`` say nothing; the check's events are sent by hand after one
backward, as the Trainer would). ``PROBE_PATCH=none`` leaves the package out; it is imported before transformers.

Issue 44's setups: ``hetero`` (Liger, a 4M-element embedding and head, AdamW with clipping, a checkpoint every step for
4 steps: run it with ``PROBE_THREADS=1,2`` for ranks of other thread counts, ``PROBE_ISA_RANK1`` for another CPU ISA
on rank 1), ``rounding`` (the same, rank 1's AdamW the fused kernel: replicas about an ulp apart), ``skip-once``
(the same at TRL's lr 1e-6, with rank 1's second update undone: one AdamW step apart from then on), ``ignored`` (the
embedding in ``_ddp_params_and_buffers_to_ignore``: DDP never averages it), ``unreadable`` (no gradient or weight the
check can read), ``fault-<stage>-r<rank>`` (the check fails on one rank only: ``fingerprint`` while the table is
built, ``host`` copying it to the host, ``device`` copying it into the collective's buffer; run with
``--ddp-timeout`` short so that a rank left waiting fails fast).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import os
import pickle
import sys
import tempfile
import time

if os.environ.get("PROBE_ISA_RANK1") and os.environ.get("RANK") == "1":  # read once, when torch first dispatches
    os.environ["ATEN_CPU_CAPABILITY"] = os.environ["PROBE_ISA_RANK1"]

if os.environ.get("PROBE_PATCH", "before") == "before":
    import liger_ddp_patch  # noqa: F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, HIDDEN = 64, 16


BIG_VOCAB, BIG_HIDDEN = 65536, 64  # 4.2M-element weights: one fp32 sum splits otherwise on 1 and 2 threads


class Tiny(torch.nn.Module):
    def __init__(self, sparse: bool = False, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden, sparse=sparse)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.embed(input_ids))
        return {
            "loss": torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),
            "logits": logits,
        }


def rows(n: int = 16, vocab: int = VOCAB) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, 8), generator=g)
    return [{"input_ids": r, "labels": r.roll(1)} for r in ids]


class Collected(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname}: {record.getMessage()}")


def count_collectives() -> list[int]:
    """Wrap ``dist.all_gather``: count the calls made from the package's own code."""
    calls = [0]
    original = dist.all_gather

    def all_gather(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith("liger_ddp_patch"):
            calls[0] += 1
        return original(*args, **kwargs)

    dist.all_gather = all_gather
    return calls


def checks(trainer) -> dict:
    return {
        type(c).__name__: {"steps": getattr(c, "checked_steps", None), "saves": getattr(c, "checked_saves", None)}
        for c in trainer.callback_handler.callbacks
        if hasattr(c, "checked_steps")
    }


def portable(trainer) -> dict:
    out = {}
    for name, how in (
        ("pickle", lambda: pickle.loads(pickle.dumps(trainer))),
        ("deepcopy", lambda: copy.deepcopy(trainer)),
    ):
        try:
            twin = how()
            out[name] = "ok" if checks(twin).keys() == checks(trainer).keys() else "callbacks lost"
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def probe_trainer():
    """A Trainer whose loss can bypass DDP's forward from a given step (``desync_from``), as TRL #7245's does."""
    from transformers import Trainer

    global Probe

    class Probe(Trainer):
        desync_from: int | None = None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if self.desync_from is not None and self.state.global_step >= self.desync_from:
                model = self.accelerator.unwrap_model(model)  # DDP.forward never runs: TRL #7245's shape
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def _get_grad_norm(
            self, model, grad_norm=None
        ):  # transformers 5 logs a norm torch cannot take of a sparse grad
            sparse = any(p.grad is not None and p.grad.is_sparse for p in model.parameters())
            return grad_norm if sparse else super()._get_grad_norm(model, grad_norm=grad_norm)

    Probe.__qualname__ = "Probe"
    return Probe


def sharded(setup: str, trainer, args) -> None:
    """FSDP1/FSDP2 on CPU: shard the model, one backward on this rank's rows, then the events a Trainer sends."""
    from transformers import TrainerControl, TrainerState

    model = trainer.model
    if setup == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    else:
        from torch.distributed.fsdp import fully_shard

        wrapped = fully_shard(model)
    trainer.model_wrapped = wrapped
    batch = rows()[dist.get_rank() :: 2][:4]
    ids = torch.stack([r["input_ids"] for r in batch])
    wrapped(input_ids=ids, labels=torch.stack([r["labels"] for r in batch]))["loss"].backward()
    state, control = TrainerState(), TrainerControl()
    trainer.callback_handler.on_pre_optimizer_step(args, state, control)
    trainer.callback_handler.on_save(args, state, control)


def control_check(model) -> str:
    """The control: compare this rank's gradients with no scope at all, as the check once did when the arguments
    named no FSDP (collective of its own, after the events above)."""
    from liger_ddp_patch.verify import GradientDesyncError, GradientSyncVerifier

    try:
        GradientSyncVerifier(1).check(model, 0)
    except GradientDesyncError as exc:
        return f"differ: {len(exc.params)}"
    return "same"


# What a setup changes in the Trainer's arguments (the rest: SGD at 0.1, no clipping, 3 steps, a checkpoint at 3)
ADAMW = {"optim": "adamw_torch", "max_grad_norm": 1.0, "save_steps": 1, "max_steps": 4}
ARGS = {"hetero": {**ADAMW, "learning_rate": 1e-3}, "rounding": {**ADAMW, "learning_rate": 1e-3},
        "skip-once": {**ADAMW, "learning_rate": 1e-6}}  # fmt: skip
BIG = ("hetero", "rounding", "skip-once")  # the 4M-element model


class SkipOnce:
    """Rank 1's update of optimizer step 1 undone (its weights restored after the step): one AdamW step apart."""

    def __init__(self):
        from transformers import TrainerCallback

        class Callback(TrainerCallback):
            saved: list | None = None

            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if state.global_step == 1 and dist.get_rank() == 1:
                    self.saved = [p.detach().clone() for p in model.parameters()]

            def on_optimizer_step(self, args, state, control, model=None, **kwargs):
                if self.saved is not None:
                    with torch.no_grad():
                        for p, saved in zip(model.parameters(), self.saved):
                            p.copy_(saved)
                    self.saved = None

        self.callback = Callback()


def inject(stage: str, rank: int):
    """Make the check fail on ``rank`` only, in ``stage``; returns the undo. The torch calls named here are wrapped
    to raise when the package's check makes them (the caller's module decides): ``fingerprint`` its table's
    ``torch.stack``, ``host`` a copy to the host (``.to``/``.cpu`` from the fingerprint module), ``device`` the
    copy into the collective's buffer (``.copy_``/``.to`` from the collective module)."""
    if dist.get_rank() != rank:
        return lambda: None
    where = {"fingerprint": "liger_ddp_patch.verify.fingerprint", "host": "liger_ddp_patch.verify.fingerprint",
             "device": "liger_ddp_patch.verify.collective"}[stage]  # fmt: skip
    names = {"fingerprint": ("stack",), "host": ("to", "cpu"), "device": ("copy_", "to")}[stage]
    owner = torch if stage == "fingerprint" else torch.Tensor
    originals = {name: getattr(owner, name) for name in names}

    def wrap(name, original):
        def failing(*args, **kwargs):
            if sys._getframe(1).f_globals.get("__name__") == where:
                raise RuntimeError(f"injected fault ({stage}, rank {rank})")
            return original(*args, **kwargs)

        return failing

    for name, original in originals.items():
        setattr(owner, name, wrap(name, original))
    return lambda: [setattr(owner, name, original) for name, original in originals.items()]


def legacy_digests_differ(model) -> int:
    """The control for ``hetero``: how many weights' own-precision float sums (the digest before issue 44) differ
    between the ranks now, by the probe's own all_gather."""
    sums = torch.stack([p.detach().sum() for p in model.parameters()]).to(torch.float64)
    parts = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, sums)
    return int((parts[0] != parts[1]).sum())


def weights_differ(model) -> int:
    """How many weights are not bitwise equal between the ranks now (every element gathered)."""
    differ = 0
    for p in model.parameters():
        parts = [torch.empty_like(p.detach()) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, p.detach().contiguous())
        differ += int(not torch.equal(parts[0], parts[1]))
    return differ


def run(setup: str, cli, calls: list[int], handler: Collected) -> dict:
    """One setup on a fresh model and Trainer (``+verify``: ``verify_gradient_sync(trainer, every=1)`` first)."""
    from transformers import TrainingArguments, set_seed

    base, _, extra = setup.partition("+")
    calls[0], handler.lines = 0, []
    set_seed(0)
    big = base in BIG
    vocab, hidden = (BIG_VOCAB, BIG_HIDDEN) if big else (VOCAB, HIDDEN)
    settings = {"learning_rate": 0.1, "optim": "sgd", "max_grad_norm": 0.0, "max_steps": cli.steps,
                "save_steps": cli.save_steps or 500, **ARGS.get(base, {})}  # fmt: skip
    if base == "rounding" and os.environ.get("RANK") == "1":
        settings["optim"] = "adamw_torch_fused"  # another kernel: the same update, rounded otherwise
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="verify-probe-"),
        use_cpu=True,
        per_device_train_batch_size=2,
        save_strategy="steps" if cli.save_steps else "no",
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
        ddp_timeout=cli.ddp_timeout,
        **settings,
    )
    model = Tiny(sparse=base == "sparse", vocab=vocab, hidden=hidden)
    if base == "ignored":
        model._ddp_params_and_buffers_to_ignore = ["embed.weight"]  # DDP never averages it (expert parallelism's way)
    trainer = probe_trainer()(model=model, args=args, train_dataset=rows(vocab=vocab))
    trainer.desync_from = {"desync": 0, "desync-late": 1}.get(base)
    if base != "ddp":
        trainer.use_liger_kernel = True  # what TRL's trainers set from their config
    if base == "skip-once":
        trainer.add_callback(SkipOnce().callback)
    if extra == "verify":
        import liger_ddp_patch

        liger_ddp_patch.verify_gradient_sync(trainer, every=1)
    result: dict = {"setup": setup, "world": dist.get_world_size() if dist.is_initialized() else 1}
    result["portable"] = portable(trainer)  # as Ray Tune ships it: built, not yet trained
    undo = lambda: None  # noqa: E731
    if base.startswith("fault-"):
        _, stage, rank = base.split("-")
        undo = inject(stage, int(rank.removeprefix("r")))
    elif base == "unreadable":
        fingerprint = importlib.import_module("liger_ddp_patch.verify.fingerprint")
        readable, fingerprint.readable = fingerprint.readable, lambda tensor: False
        undo = lambda: setattr(fingerprint, "readable", readable)  # noqa: E731
    started = time.monotonic()
    try:
        if base in ("fsdp1", "fsdp2"):
            sharded(base, trainer, args)
        else:
            trainer.train()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:600]
        result["trace"] = __import__("traceback").format_exc()[:3000]
    finally:
        undo()
    result["seconds"] = round(time.monotonic() - started, 1)
    result.update(collectives=calls[0], lines=list(handler.lines), checks=checks(trainer))
    if base in ("fsdp1", "fsdp2"):
        result["unscoped"] = control_check(trainer.model)
    if big and dist.is_initialized() and "error" not in result:
        result["legacy_differ"] = legacy_digests_differ(trainer.model)
        result["weights_differ"] = weights_differ(trainer.model)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", required=True, help="comma-separated setups, run one after the other")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--ddp-timeout", type=int, default=1800, help="seconds (the process group's timeout)")
    cli = parser.parse_args()
    if "RANK" in os.environ:  # the Trainer does not pass ddp_timeout on with use_cpu=True: set it up ourselves
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=cli.ddp_timeout))
    threads = os.environ.get("PROBE_THREADS")  # "1,2": rank r runs on the r-th count
    if threads and dist.is_available():
        torch.set_num_threads(int(threads.split(",")[int(os.environ.get("RANK", "0"))]))

    handler = Collected()
    logging.getLogger("liger_ddp_patch").addHandler(handler)
    calls = count_collectives()
    results = [run(setup, cli, calls, handler) for setup in cli.setup.split(",")]
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(cli.out, "w") as f:
            json.dump({"results": results}, f)


if __name__ == "__main__":
    main()
