"""The plan of one loss call: how many tokens per GEMM, in which dtype, within which memory budget, with which sweep.

Memory: one budget (:func:`logits_budget_bytes`: 128 MiB on CPU, 1 GiB on an accelerator) bounds every
temporary: the default token chunk is ``budget / (V * bytes per logit)`` (on CPU in half precision the half block
alone, its sweep on an fp32 tile of ``_tiles.TILE_BYTES`` taken from the budget), and in half precision the two-pass
backward walks the vocabulary in blocks of at most ``V / 4`` rows whose temporaries (the fp32 accumulator of the
weight gradient, the cast weight rows, the product and its fp32 copy) fit the budget together
(:func:`vocab_block_rows`).

Precision: the GEMMs run in the *compute dtype*: the autocast dtype when ``torch.autocast`` is on for the inputs'
device (as autocast would run ``F.linear``; fp64 inputs are left alone, as autocast does), else the inputs' dtype.
Both paths run with autocast off (:func:`no_autocast`), so a recomputed softmax is the one whose log-sum-exp was
stored.  The log-sum-exp, the softmax, the per-token log-probs and their row sums, all reductions and the gradient
accumulators are fp32, and fp64 for fp64 inputs (:attr:`Plan.mdtype`: fp64 inputs are fp64 throughout).

Simulation (issue 45): inside :func:`simulated_accelerator` a call on CPU tensors is planned by the accelerator's
rules for a stated free memory -- the accelerator budget, the held budget of that free memory, no ``_tiles`` sweep,
the non-fused softmax steps and, by default, fp32-output GEMMs (emulated on CPU by ``_gemm``) -- so that it takes the
chunk rows, the path and the held sums a GPU call of the same shapes takes, and allocates what that call allocates
(``benchmarks/sim_gpu_peak.py`` replays them).  Outside it nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import warnings
from typing import NamedTuple

import torch

from . import _tiles

__all__ = [
    "ACCUMULATOR_BYTES_PER_WEIGHT",
    "LOGITS_BUDGET_BYTES",
    "MIN_ONE_PASS_ROWS",
    "Plan",
    "SWEEPS",
    "compute_dtype",
    "fp32_out",
    "fp32_output_gemm",
    "held_budget_bytes",
    "logit_bytes",
    "logits_budget_bytes",
    "device_kind",
    "math_dtype",
    "no_autocast",
    "resolve_token_chunk_size",
    "simulated",
    "simulated_accelerator",
    "sweep_of",
    "tiles_sweep",
    "vocab_block_rows",
]

# Bytes one token chunk may spend on its logits (and, in half precision, the weight-gradient tile).  CPU: 128 MiB
# (fp32: chunk * V <= 2**25).  Accelerators: 1 GiB, so that at Qwen's V = 151,936 a chunk is ~1,700 rows (an
# H100/H200 GEMM wants well over ~220 rows) while staying a small slice of an 80-141 GB device.
LOGITS_BUDGET_BYTES = {"cpu": 128 << 20, "accelerator": 1 << 30}

MAX_DEFAULT_CHUNK = 8192

# Bytes the one-pass path may hold beyond what the two-pass path holds at its peak (issue 39): its long groups'
# extra (V, H) sums, or the logits of a chunk widened to hold them whole (``_base.widened``), and where the GEMMs
# cast the weight (fp32 weights under autocast) the cast weight, all live during the forward beside the weight
# gradient that pass already made.  CPU: 384 MiB, a cast of Qwen2.5-0.5B's head to bf16 (0.25 GiB) fits and one fp32
# sum of it (0.51 GiB) does not.  Measured (bench_step, 50 % prompt, benchmarks/results/cpu-2026-12-07-blocks): with
# 768 MiB, one fp32 sum held at L=2,048 put the step's peak in the loss's forward, 93 MB above TRL 1.14's (replayed,
# DPO; VmHWM 1.02x); with the sum and the cast (mixed) one pass peaked 1.05-1.08x.  An accelerator: 1/16 of its
# free memory, and (issue 45) at most :data:`ACCUMULATOR_BYTES_PER_WEIGHT` bytes per weight element less the default
# chunk's own blocks (:func:`held_budget_bytes`).
HELD_BUDGET_BYTES = {"cpu": 384 << 20}
HELD_BUDGET_FREE_FRACTION = 16
# An accelerator's one pass holds, beside the weight gradient, at most what an fp32 copy of it holds: its extra (V, H)
# sums, a cast weight and one chunk's blocks (fp32 logits and the gradient block in the compute dtype) within 4 bytes
# per weight element.  That is what TRL 1.14's and 1.16's chunked heads accumulate the weight gradient in beside their
# half-precision result, so a one-pass forward never peaks above their backward (issue 45: simulated at Qwen2.5-7B's
# head, benchmarks/sim_gpu_peak.py; one bf16 sum beside 1,766-token chunks did, by 0.33 GiB).
ACCUMULATOR_BYTES_PER_WEIGHT = 4
# The fewest tokens a narrowed one-pass chunk may hold (:meth:`_base.ChunkedLinearLoss.narrowed`): a bf16 GEMM
# against the head reads each weight element once per chunk for 2 flops per row, so it is compute-bound above
# peak flops / bandwidth rows (H100 SXM 989 TFLOPS / 3.35 TB/s: ~295 rows; H200 / 4.8 TB/s: ~206); 512 keeps ~2x that.
MIN_ONE_PASS_ROWS = 512


class SimulatedAccelerator(NamedTuple):
    """What :func:`simulated_accelerator` plans a CPU call as: ``free_bytes`` of free device memory (the held budget's
    base, as ``torch.cuda.mem_get_info`` reports it), and whether its GEMMs write fp32 from half inputs (CUDA with
    torch >= 2.10: yes)."""

    free_bytes: int
    fp32_out: bool = True


_SIMULATED: contextvars.ContextVar[SimulatedAccelerator | None] = contextvars.ContextVar(
    "liger_ddp_patch_simulated_accelerator", default=None
)


@contextlib.contextmanager
def simulated_accelerator(free_bytes: int, fp32_out: bool = True):
    """Within this context a loss call on CPU tensors is planned, and allocates, as on an accelerator with
    ``free_bytes`` free (see the module docstring): enclose its forward *and* its backward.  A benchmark's and the
    tests' tool (no GPU needed to pin or replay a GPU plan); the results are the CPU's numbers, the memory the GPU's
    but for the emulated GEMMs' column blocks (``_gemm``)."""
    if isinstance(free_bytes, bool) or int(free_bytes) != free_bytes or free_bytes < 0:
        raise ValueError(f"free_bytes must be a non-negative integer, got {free_bytes!r}")
    token = _SIMULATED.set(SimulatedAccelerator(int(free_bytes), bool(fp32_out)))
    try:
        yield
    finally:
        _SIMULATED.reset(token)


def simulated(device=None) -> SimulatedAccelerator | None:
    """The accelerator a CPU ``device`` (None = CPU) is planned as inside :func:`simulated_accelerator`, else None."""
    if device is not None and torch.device(device).type != "cpu":
        return None
    return _SIMULATED.get()


def device_kind(device=None) -> str:
    """``"cpu"`` or ``"accelerator"``: whose rules plan a call on ``device`` (a CPU inside
    :func:`simulated_accelerator` is an accelerator)."""
    kind = "cpu" if device is None else torch.device(device).type
    return "accelerator" if kind != "cpu" or simulated(device) is not None else "cpu"


def logits_budget_bytes(device=None) -> int:
    """The default per-chunk memory budget for ``device`` (a ``torch.device``, a type string, or None = CPU)."""
    return LOGITS_BUDGET_BYTES[device_kind(device)]


def held_budget_bytes(device=None, weight_numel: int | None = None, chunk_bytes: int = 0) -> int:
    """What the default one-pass path may hold beyond the two-pass path (see :data:`HELD_BUDGET_BYTES`).

    On an accelerator: 1/16 of its free memory (a simulated one's stated free memory) and, given the head's
    ``weight_numel``, at most ``ACCUMULATOR_BYTES_PER_WEIGHT * weight_numel - chunk_bytes`` (``chunk_bytes``: what
    the default plan's largest chunk holds, :meth:`Plan.chunk_bytes`), or 0 where that chunk alone holds more (a plan
    that holds nothing beyond the two-pass path is never refused)."""
    if device_kind(device) == "cpu":
        return HELD_BUDGET_BYTES["cpu"]
    sim = simulated(device)
    if sim is not None:
        budget = sim.free_bytes // HELD_BUDGET_FREE_FRACTION
    else:
        kind = torch.device(device).type
        try:
            free, _total = torch.cuda.mem_get_info(device) if kind == "cuda" else (None, None)
        except (RuntimeError, AssertionError, ValueError):
            free = None
        budget = LOGITS_BUDGET_BYTES["accelerator"] if free is None else int(free) // HELD_BUDGET_FREE_FRACTION
    if weight_numel is not None:
        budget = min(budget, max(0, ACCUMULATOR_BYTES_PER_WEIGHT * int(weight_numel) - int(chunk_bytes)))
    return budget


@functools.cache
def fp32_output_gemm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32_acc, a, b, out_dtype=torch.float32, out=fp32_acc)`` works for half ``a, b`` here.

    Probed once per (device type, dtype) on 2x2 tensors, result checked: CUDA with torch >= 2.10 says yes,
    CPU (no kernel) and older torch say no, and then the callers fall back to a product in the compute dtype.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        logits = torch.mm(a, a, out_dtype=torch.float32)
        return bool((acc == 3).all()) and logits.dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError, ValueError, AssertionError):
        return False


def fp32_out(device, dtype) -> bool:
    """Whether the GEMMs of ``dtype`` on ``device`` write fp32 themselves (never on CPU; a simulated accelerator's
    say, for half dtypes: ``_gemm`` emulates them)."""
    sim = simulated(device)
    if sim is not None:
        return sim.fp32_out and dtype in (torch.float16, torch.bfloat16)
    kind = "cpu" if device is None else torch.device(device).type
    return kind != "cpu" and fp32_output_gemm(kind, dtype)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError, ValueError):  # torch < 2.4, or a device type autocast does not know
        pass
    return None


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMM dtype: autocast's when it is on for this device (fp64 excepted, as autocast does), else the inputs'."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    auto = _autocast_dtype(hidden.device.type)
    return auto if auto is not None and dtype != torch.float64 else dtype


def no_autocast(device: torch.device):
    """Our GEMMs cast explicitly to the compute dtype: autocast must not re-cast them (nor the fp32 math)."""
    if _autocast_dtype(device.type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def math_dtype(cdtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the reductions and the accumulators: fp64 for fp64, else fp32."""
    return torch.float64 if cdtype == torch.float64 else torch.float32


def tiles_sweep(device, cdtype: torch.dtype, bias=None) -> bool:
    """Whether a chunk's sweep runs on row tiles of its half-precision block (``_tiles``): on CPU (the GEMM writes
    the half dtype; not a simulated accelerator), in half precision, without a bias (whose gradient is summed from
    the fp32 block)."""
    return device_kind(device) == "cpu" and cdtype in (torch.float16, torch.bfloat16) and bias is None


def resolve_token_chunk_size(
    token_chunk_size: int | None,
    vocab_size: int,
    device=None,
    compute_dtype: torch.dtype = torch.float32,
    budget_bytes: int | None = None,
    tiles: bool | None = None,
) -> int:
    """Number of (non-ignored) tokens projected at once.

    ``None`` fits one chunk's logits into :func:`logits_budget_bytes` of ``device``: ``budget // (V * b)``
    tokens, clipped to ``[1, 8192]``, with ``b`` = 4 bytes per fp32 logit, plus the half-precision GEMM output
    when the GEMM cannot write fp32 itself; with ``tiles`` (default: :func:`tiles_sweep` without a bias) ``b`` is
    the half logit alone and the fp32 tile comes off the budget.  At ``V = 32000`` on CPU: 1048 tokens in fp32,
    1966 in bf16; an accelerator in bf16 at ``V = 151,936``: 1766 tokens (1177 without an fp32-output GEMM).
    """
    if token_chunk_size is None:
        budget = logits_budget_bytes(device) if budget_bytes is None else int(budget_bytes)
        tiles = tiles if tiles is not None else tiles_sweep(device, compute_dtype)
        per_logit = logit_bytes(compute_dtype, tiles, fp32_out(device, compute_dtype))
        budget = max(0, budget - _tiles.TILE_BYTES) if tiles else budget
        return max(1, min(MAX_DEFAULT_CHUNK, budget // (per_logit * max(1, int(vocab_size)))))
    if isinstance(token_chunk_size, bool) or int(token_chunk_size) != token_chunk_size or token_chunk_size < 1:
        raise ValueError(f"token_chunk_size must be a positive integer or None (auto), got {token_chunk_size!r}")
    return int(token_chunk_size)


def logit_bytes(compute_dtype: torch.dtype, tiles: bool, fast: bool) -> int:
    """Bytes a chunk holds per logit: the half block alone with ``tiles``; else the fp32 block, plus the GEMM's half
    output where it cannot write fp32 (``fast``)."""
    if tiles:
        return compute_dtype.itemsize
    full = math_dtype(compute_dtype).itemsize
    return full + (compute_dtype.itemsize if compute_dtype.itemsize < full and not fast else 0)


def vocab_block_rows(vocab_size: int, row_bytes: int, budget_bytes: int) -> int:
    """Rows of the vocabulary per backward block: <= V/4, and what one block holds (``row_bytes`` a row) <= budget."""
    return max(1, min(-(-vocab_size // 4), budget_bytes // max(1, row_bytes)))


SWEEPS = ("eager", "triton")


def sweep_of(sweep: str, device: torch.device, cdtype: torch.dtype, bias) -> str:
    """The sweep over each ``(chunk, V)`` block a call runs: ``"triton"`` (``_triton.py``), else ``"tiles"``
    (``_tiles.py``, :func:`tiles_sweep`) or ``"eager"``, with the reason when ``"triton"`` was asked for and cannot
    run here (warned once per reason)."""
    default = "tiles" if tiles_sweep(device, cdtype, bias) else "eager"
    if sweep == "eager":
        return default
    why = _triton_unavailable(device.type)
    if why is None and cdtype == torch.float64:
        why = "fp64 inputs"
    if why is None and bias is not None:
        why = "an LM head with a bias"
    if why is None:
        return "triton"
    _warn_once(f"sweep='triton' asked for, but {why}: the {default} sweep runs instead")
    return f"{default} (triton: {why})"


@functools.cache
def _triton_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"a {device_type} tensor (Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1)"
    return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


class Plan(NamedTuple):
    """How one call runs: ``chunk`` tokens per GEMM, the GEMM dtype ``cdtype``, the accumulation dtype ``mdtype``,
    the per-chunk memory ``budget`` (bytes), ``fast`` (the GEMM writes fp32 from half inputs) and ``sweep``
    (:func:`sweep_of`: ``"triton"`` or ``"tiles"`` when the block's softmax and gradient run as the row sweeps of
    ``_triton.py`` or ``_tiles.py``)."""

    chunk: int
    cdtype: torch.dtype
    mdtype: torch.dtype
    budget: int
    fast: bool
    sweep: str = "eager"

    @classmethod
    def of(cls, hidden, weight, token_chunk_size: int | None, sweep: str = "eager", bias=None) -> Plan:
        cdtype = compute_dtype(hidden, weight)
        budget = logits_budget_bytes(hidden.device)
        how = sweep_of(sweep, hidden.device, cdtype, bias)
        tiles = how.startswith("tiles")
        chunk = resolve_token_chunk_size(token_chunk_size, weight.shape[0], hidden.device, cdtype, budget, tiles)
        return cls(chunk, cdtype, math_dtype(cdtype), budget, fp32_out(hidden.device, cdtype), how)

    @property
    def rows(self):
        """The module whose ``row_lse`` / ``grad_`` sweep each half block (``_triton``, ``_tiles``), or None: the
        block is converted to fp32 and swept with :func:`softmax_` (imported on first use: Triton only if asked)."""
        if self.sweep == "triton":
            from . import _triton

            return _triton
        return _tiles if self.tiles else None

    @property
    def tiles(self) -> bool:
        """The ``_tiles`` sweep: a forward pass keeps the GEMM's half block as its only ``(chunk, V)`` block."""
        return self.sweep.startswith("tiles")

    def chunk_bytes(self, vocab_size: int) -> int:
        """What one chunk of a one-pass forward holds at once (the share that scales with the chunk): its logits
        and, where the GEMM writes them in fp32 from half inputs, the gradient block in the compute dtype made from
        them (elsewhere it takes the half buffer, or is the block itself)."""
        per_logit = logit_bytes(self.cdtype, self.tiles, self.fast)
        if self.fast and self.cdtype.itemsize < self.mdtype.itemsize:
            per_logit += self.cdtype.itemsize
        return self.chunk * vocab_size * per_logit

    def block_rows(self, weight: torch.Tensor) -> int:
        """Vocabulary rows per block where the weight gradient needs an fp32 tile (half precision, or a weight of
        another dtype than the GEMMs'); the whole vocabulary otherwise.  A block's temporaries together fit the
        budget: its fp32 tile, its weight rows cast to the compute dtype (fp32 weights under autocast) and, where the
        GEMM cannot write fp32, the product in the compute dtype and the fp32 copy ``tile.add_(product)`` makes of it
        on CPU (issue 39: a tile sized alone to the budget held 2.5x the budget and put the mixed-precision step's peak
        1.01x TRL 1.14's)."""
        V, H = weight.shape
        if self.cdtype.itemsize == self.mdtype.itemsize and weight.dtype == self.cdtype:
            return V
        half, full = self.cdtype.itemsize, self.mdtype.itemsize
        row = full + (half if weight.dtype != self.cdtype else 0) + (0 if self.fast else half + full)
        return vocab_block_rows(V, row * H, self.budget)
