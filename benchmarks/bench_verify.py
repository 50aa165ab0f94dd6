"""Overhead of the gradient-sync verifier, relative to a training step, on 2 CPU ranks (gloo).

    python benchmarks/bench_verify.py            # launches itself under torchrun (2 ranks); ~1-2 min on 2 cores

Model: the tiny Qwen3 from ``liger_ddp_patch.demo.tiny`` with Qwen's real vocabulary (151,936; 9.8 M parameters,
almost all in the embedding and LM head, which is where a check spends its time). A *step* is a DDP training step
(forward, LM loss, backward with DDP's all-reduce, AdamW step) on 2 rows x 64 tokens per rank: cheaper than a TRL
DPO step (which also runs the reference model), so the ratio below overstates the verifier's share. A *check* is
``GradientSyncVerifier.check``: fingerprint every gradient, one all_gather of the [25, 5] table, compare.
A *save* is what a Trainer checkpoint writes (the model with ``save_pretrained``, the optimizer's state with
``torch.save``; scheduler, RNG and trainer state are a few KB more), a *weights check* the checkpoint check the
package runs after it (each weight's bits summed as integers, one all_gather, an exact compare: issue 44's digest);
the two are timed interleaved, save then check, ``--saves`` times. Medians after warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM

    from liger_ddp_patch.verify import GradientSyncVerifier
    from liger_ddp_patch.verify.callbacks import Target

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(AutoModelForCausalLM.from_pretrained(args.assets, dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(rank)
    verifier = GradientSyncVerifier(every=args.every)

    def step():
        ids = torch.randint(3, 30, (2, 64), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()

    def timed(fn, n):
        out = []
        for _ in range(n):
            dist.barrier()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return out

    timed(step, 2)  # warm-up
    steps = timed(step, args.steps)  # gradients are left in place after the last step: the check reads them
    timed(lambda: verifier.check(model), 2)
    checks = timed(lambda: verifier.check(model), args.checks)
    folder = tempfile.mkdtemp(prefix=f"bench-verify-save-{rank}-")

    def save():
        model.module.save_pretrained(folder)
        torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))

    def weights():
        verifier.compare(Target(model.module, None), 0, weights=True)

    saves, weight_checks = [], []
    for _ in range(args.saves + 1):  # the first of each is warm-up
        saves += timed(save, 1)
        weight_checks += timed(weights, 1)
    saves, weight_checks = saves[1:], weight_checks[1:]
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        step_ms, check_ms = 1e3 * statistics.median(steps), 1e3 * statistics.median(checks)
        amortised = check_ms / args.every
        print(
            f"model: {n_params / 1e6:.1f} M parameters in {len(list(model.parameters()))} tensors, "
            f"world {dist.get_world_size()}, gloo, 1 thread per rank"
        )
        print(f"{'median step':>16} {'median check':>14} {'check/step':>11} {f'amortised N={args.every}':>16}")
        print(f"{step_ms:>13.1f} ms {check_ms:>11.2f} ms {check_ms / step_ms:>10.1%} "
              f"{amortised:>9.3f} ms/step = {amortised / step_ms:.3%} of a step")  # fmt: skip
        save_ms, weights_ms = 1e3 * statistics.median(saves), 1e3 * statistics.median(weight_checks)
        print(f"{'median save':>16} {'weights check':>14} {'check/save':>11}   (checkpoint check, {args.saves} saves)")
        print(f"{save_ms:>13.1f} ms {weights_ms:>11.2f} ms {weights_ms / save_ms:>10.2%}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", default=None, help="a folder from demo.tiny.build (default: build one)")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 151,936")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--checks", type=int, default=20)
    parser.add_argument("--saves", type=int, default=10)
    args = parser.parse_args()
    if "LOCAL_RANK" in os.environ:
        return worker(args)
    if args.assets is None:
        from liger_ddp_patch.demo.tiny import REAL_VOCAB, build

        args.assets = str(build(tempfile.mkdtemp(prefix="bench-verify-"), vocab_size=args.vocab_size or REAL_VOCAB))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
           "--assets", args.assets, "--every", str(args.every), "--steps", str(args.steps),
           "--checks", str(args.checks), "--saves", str(args.saves)]  # fmt: skip
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
