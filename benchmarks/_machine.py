"""What a benchmark ran on, in one line: the CPU model, torch's vector ISA, and whether bf16 GEMMs are native.

Why: a bf16 row means different things on different CPUs.  With AMX or AVX-512 BF16 a bf16 GEMM is native and
faster than fp32, so the GEMM floor is low and the elementwise sweeps around it show.  With AVX2 only, torch
emulates it (an AMD EPYC with AVX2, 2026-12-03: a (699, 896) x (896, 32000) product 2.5 s in bf16 against 0.47 s in
fp32), and the floor hides every sweep: such a bf16 row's ratio to the floor says nothing about the loss.
"""

from __future__ import annotations

import platform


def _cpuinfo() -> tuple[str, set[str]]:
    """``(model name, flags)`` of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not model:
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model, flags


def bf16_gemm(flags: set[str]) -> str:
    """``"AMX"``, ``"AVX-512 BF16"`` (native bf16 GEMMs) or ``"emulated"``."""
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return "emulated"


def describe() -> str:
    """One line for a benchmark's header, e.g. ``AMD EPYC 7B13 (torch AVX2, bf16 GEMM emulated)``."""
    import torch

    model, flags = _cpuinfo()
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # torch < 2.1
        isa = "?"
    native = bf16_gemm(flags)
    gemm = "bf16 GEMM emulated: bf16 rows are GEMM-bound here" if native == "emulated" else f"bf16 GEMM {native}"
    return f"{model or platform.processor() or platform.machine()} (torch {isa}, {gemm})"
