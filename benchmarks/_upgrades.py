"""The upgrades: the TRL releases a user who hits the DDP bug can upgrade to instead of using the package (issue 45).

Every comparison the benchmarks make against "the upgrade" (``bench_losses.py``'s head-path arms, ``bench_step.py``'s
whole-step arms and its targets, ``gpu_check.py`` parts (a) and (c), issue 39's "never worse" rule) iterates this
table, oldest first, newest last. The next release is one more row.

Each row: the arm's name, the release (unpacked into ``.cache/trl/<release>`` by ``.ci/trl_matrix.sh``, carried to
a GPU as a wheel by ``gpu_wheels.sh``), and how its DPO/KTO head computes the per-token log-probabilities, which
``_arms.py`` calls for the head-only benchmarks:

  chunked_logprob  TRL 1.14: the trainer masks the hidden states to the completion tokens and calls
                   ``trl.trainer.utils._ChunkedLogProbFunction`` with a vocabulary chunk of 8,192
                   (``_CHUNKED_LOGPROB_CHUNK_SIZE`` in trl/trainer/dpo_trainer.py:81 and kto_trainer.py:87 of 1.14.0;
                   dpo_trainer.py:1246, kto_trainer.py:1301)
  fused_lm_head    TRL 1.15+: the trainer patches the model's forward with ``trl.trainer.utils.add_fused_lm_head``
                   (1.16.0: trainer/utils.py:1548; dpo_trainer.py:960, kto_trainer.py:967) and reads
                   ``model(..., labels=..., fused_lm_head=True).log_probs``; the tiles are
                   ``trl/kernels/chunked_logprob.py``'s ``ChunkedLogProbFunction`` (4,096 tokens x 32,768 vocabulary
                   entries), Triton kernels on CUDA/XPU, torch ops elsewhere
"""

from __future__ import annotations

from typing import NamedTuple


class Upgrade(NamedTuple):
    release: str  # the TRL release, as in .cache/trl/<release> and the wheel's version
    head: str  # how its trainers compute the head's log-probabilities: "chunked_logprob" or "fused_lm_head"

    @property
    def label(self) -> str:
        """``TRL 1.16``: how tables and reports name it."""
        return "TRL " + ".".join(self.release.split(".")[:2])


UPGRADES: dict[str, Upgrade] = {
    "trl114": Upgrade("1.14.0", "chunked_logprob"),
    "trl116": Upgrade("1.16.0", "fused_lm_head"),
}
NEWEST = next(reversed(UPGRADES))  # the release a user who upgrades today gets


def release_of(arm: str) -> str | None:
    """The TRL release of an upgrade arm (``trl116`` or ``trl116+bf16ref``), None for any other arm."""
    found = UPGRADES.get(arm.split("+")[0])
    return found.release if found else None
