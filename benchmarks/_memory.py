"""What is live at a step's memory peak, by who allocated it (CUDA): the allocator's own trace, replayed.

Issue #22's H200 step left a question open: the patched step peaked at 16.7 GiB per rank where TRL 1.14's peaked
at 11.8, more than the loss's own buffers explain.  ``torch.cuda.max_memory_allocated`` says how much, not what.
:func:`record` turns on the caching allocator's history (with Python stacks) for one step; :func:`summary` takes the
snapshot and :func:`peak_sites` replays its alloc / free events from the bytes already live when recording began
(parameters, optimizer state, gradients kept between steps: one line, "before the step"), finds the peak, and sums
what is live there by *site*: the innermost frame in a library of the step (the package, TRL, transformers, PEFT,
Accelerate), else the innermost frame at all, else "no Python frame" (autograd's backward runs in C++).

Only on CUDA (the allocator's trace; CPU has none): elsewhere :func:`record` returns None and the summary says so.
Never fatal: a failure becomes the summary's ``error``, and the step it watches is not timed anyway.
"""

from __future__ import annotations

import traceback

LIBRARIES = ("liger_ddp_patch", "trl", "transformers", "peft", "accelerate")
NO_FRAME = "no Python frame (autograd backward, C++)"
BEFORE = "live before the step (parameters, optimizer state, kept gradients)"


def site(frames) -> str:
    """``library/path.py:function`` of the innermost frame in one of :data:`LIBRARIES` (frames innermost first,
    as the allocator records them), else of the innermost frame, else :data:`NO_FRAME`."""
    frames = [f for f in frames or () if f.get("filename")]
    for f in frames:
        parts = f["filename"].replace("\\", "/").split("/")
        for lib in LIBRARIES:
            if lib in parts[:-1]:
                i = len(parts) - 1 - parts[::-1].index(lib)
                return f"{'/'.join(parts[i:])}:{f.get('name', '?')}"
    if frames:
        tail = "/".join(frames[0]["filename"].replace("\\", "/").split("/")[-2:])
        return f"{tail}:{frames[0].get('name', '?')}"
    return NO_FRAME


def peak_sites(events: list[dict], base: int, top: int = 15) -> dict:
    """Replay ``events`` (one device's trace: ``action`` alloc / free_completed, ``addr``, ``size``, ``frames``)
    from ``base`` live bytes: the peak, and what is live there by :func:`site`, largest first.

    A block freed that the trace never saw allocated was live before it: it leaves ``base``."""
    live: dict = {}
    cur = peak = base
    at = -1  # index of the event after which the peak is reached (-1: before any)
    for i, e in enumerate(events):
        if e.get("action") == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
        elif e.get("action") == "free_completed":
            cur -= live.pop(e["addr"], e["size"])
        else:
            continue
        if cur > peak:
            peak, at = cur, i
    sizes: dict[str, list[int]] = {BEFORE: [base, 0]}
    live_at: dict = {}
    for e in events[: at + 1]:  # again, up to the peak, keeping who allocated what
        if e.get("action") == "alloc":
            live_at[e["addr"]] = (e["size"], site(e.get("frames")))
        elif e.get("action") == "free_completed":
            if e["addr"] in live_at:
                live_at.pop(e["addr"])
            else:
                sizes[BEFORE][0] -= e["size"]
    for size, where in live_at.values():
        entry = sizes.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sizes.items(), key=lambda kv: kv[1][0], reverse=True)
    rest = ranked[top:]
    sites = [dict(site=k, bytes=v[0], blocks=v[1]) for k, v in ranked[:top]]
    if rest:
        sites.append(dict(site=f"{len(rest)} other sites", bytes=sum(v[0] for _, v in rest),
                          blocks=sum(v[1] for _, v in rest)))  # fmt: skip
    frames = (events[at].get("frames") or []) if at >= 0 else []
    at_peak = [f"{f.get('filename', '?')}:{f.get('line', '?')}:{f.get('name', '?')}" for f in frames[:12]]
    return dict(peak=peak, base=base, events=len(events), sites=sites, at_peak=at_peak)


def record(cuda: bool, max_entries: int = 500_000):
    """Start the allocator's history on the current CUDA device: the bytes live now (the replay's base), or None
    (not CUDA, or the history could not start: :func:`summary` then says why)."""
    if not cuda:
        return None
    import torch

    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
        return dict(base=base, max_entries=max_entries)
    except Exception:  # noqa: BLE001  (a benchmark's extra step must not fail the run)
        return dict(error=traceback.format_exc(limit=3)[-800:])


def summary(started, cuda: bool) -> dict:
    """Stop the history started by :func:`record` and replay it (see :func:`peak_sites`)."""
    if not cuda:
        return dict(error="not recorded: the allocator's trace is CUDA only")
    if started is None or "error" in started:
        return dict(error=(started or {}).get("error", "not recorded"))
    import torch

    try:
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        device = torch.cuda.current_device()
        events = snap["device_traces"][device]
        out = peak_sites(events, started["base"])
        out.update(max_allocated=torch.cuda.max_memory_allocated(), truncated=len(events) >= started["max_entries"])
        return out
    except Exception:  # noqa: BLE001
        return dict(error=traceback.format_exc(limit=3)[-800:])


def render(mem: dict, gib: float = 2**30, top: int = 10) -> list[str]:
    """A few lines: the replayed peak against ``max_memory_allocated``, then the largest sites."""
    if "error" in mem:
        return [f"      memory: {mem['error'].strip().splitlines()[-1][:200]}"]
    cut = ", trace truncated" if mem.get("truncated") else ""
    lines = [f"      memory: replayed peak {mem['peak'] / gib:.2f} GiB (max_memory_allocated "
             f"{mem['max_allocated'] / gib:.2f}{cut}); live there, by site:"]  # fmt: skip
    lines += [f"        {s['bytes'] / gib:7.2f} GiB  x{s['blocks']:<5} {s['site']}" for s in mem["sites"][:top]]
    if mem.get("at_peak"):
        lines.append(f"        peak reached in: {' <- '.join(mem['at_peak'][:4])}")
    return lines


def cpu_allocations(prof) -> list:
    """Every allocation and free a ``torch.profiler.profile(profile_memory=True)`` saw, in time order (CPU too: the
    profiler's events, where the allocator's trace above is CUDA only). Each has ``extra_fields`` with ``alloc_size``
    (negative for a free) and ``total_allocated``."""
    from torch._C._profiler import _EventType

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    found = (e for e in walk(prof.profiler.kineto_results.experimental_event_tree()) if e.tag == _EventType.Allocation)
    return sorted(found, key=lambda e: e.start_time_ns)
