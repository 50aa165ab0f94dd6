"""What is live at a step's memory peak, by who allocated it: the CUDA allocator's own trace, or on CPU the profiler's
allocation events, replayed.

Issue #22's H200 step left a question open: the patched step peaked at 16.7 GiB per rank where TRL 1.14's peaked
at 11.8, more than the loss's own buffers explain.  ``torch.cuda.max_memory_allocated`` says how much, not what.
:func:`record` turns on the caching allocator's history (with Python stacks) for one step; :func:`summary` takes the
snapshot and :func:`peak_sites` replays its alloc / free events from the bytes already live when recording began
(parameters, optimizer state, gradients kept between steps: one line, "before the step"), finds the peak, and sums
what is live there by *site*: the innermost frame in a library of the step (the package, TRL, transformers, PEFT,
Accelerate), else the innermost frame at all, else "no Python frame" (autograd's backward runs in C++).

On CPU (issue 39: which phase of a DDP step sets its peak RSS) :func:`record` starts ``torch.profiler`` with
``profile_memory`` instead, and :func:`cpu_replay` replays its events: the peak over what was live when it started,
and what is live there by allocating op and innermost frame of a library (slow: the watched step runs 2-3x longer).
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


def ranked_sites(live, top: int, rest: bool = True, sizes: dict | None = None) -> list[dict]:
    """``live`` ``(bytes, site)`` pairs summed by site (onto ``sizes``' ``{site: [bytes, blocks]}``), largest first:
    the ``top`` sites as ``site``, ``bytes``, ``blocks``, then (``rest``) one row for all the others."""
    sizes = {} if sizes is None else sizes
    for size, where in live:
        entry = sizes.setdefault(where, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sizes.items(), key=lambda kv: kv[1][0], reverse=True)
    out = [dict(site=k, bytes=v[0], blocks=v[1]) for k, v in ranked[:top]]
    others = ranked[top:]
    if rest and others:
        out.append(dict(site=f"{len(others)} other sites", bytes=sum(v[0] for _, v in others),
                        blocks=sum(v[1] for _, v in others)))  # fmt: skip
    return out


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
    sites = ranked_sites(live_at.values(), top, sizes=sizes)
    frames = (events[at].get("frames") or []) if at >= 0 else []
    at_peak = [f"{f.get('filename', '?')}:{f.get('line', '?')}:{f.get('name', '?')}" for f in frames[:12]]
    return dict(peak=peak, base=base, events=len(events), sites=sites, at_peak=at_peak)


def record(cuda: bool, max_entries: int = 500_000):
    """Start the allocator's history on the current CUDA device (on CPU: the profiler, see :func:`cpu_replay`): the
    bytes live now (the replay's base), or an ``error`` (:func:`summary` then says why)."""
    import torch

    try:
        if not cuda:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True)
            prof.__enter__()
            return dict(prof=prof)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
        return dict(base=base, max_entries=max_entries)
    except Exception:  # noqa: BLE001  (a benchmark's extra step must not fail the run)
        return dict(error=traceback.format_exc(limit=3)[-800:])


def summary(started, cuda: bool) -> dict:
    """Stop the history started by :func:`record` and replay it (see :func:`peak_sites`, :func:`cpu_replay`)."""
    if started is None or "error" in started:
        return dict(error=(started or {}).get("error", "not recorded"))
    import torch

    try:
        if not cuda:
            started["prof"].__exit__(None, None, None)
            return cpu_replay(started["prof"], LIBRARIES)
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
    allocated = f"max_memory_allocated {mem['max_allocated'] / gib:.2f}" if "max_allocated" in mem else "CPU"
    lines = [f"      memory: replayed peak {mem['peak'] / gib:.2f} GiB ({allocated}{cut}); live there, by site:"]
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


def _cpu_site(event, libraries) -> str:
    """The allocating op and the innermost frame above it in one of ``libraries`` (path fragments)."""
    op, frame = None, None
    p = event.parent
    while p is not None:
        try:
            name = p.name
        except UnicodeDecodeError:  # a frame name the profiler stored cut mid-character
            name = "?"
        if op is None and name.startswith("aten::"):
            op = name
        if ".py(" in name and any(lib in name for lib in libraries):
            frame = name.split("/")[-1]
            break
        p = p.parent
    return f"{op or '?'} @ {frame or '-'}"


def cpu_replay(prof, libraries=LIBRARIES, top: int = 8) -> dict:
    """A finished ``profile_memory`` profile's peak over the bytes live when it started (``peak``, what
    :func:`render` prints; ``base``: those bytes, as the profiler counts them), the site at the peak (``at``) and
    the ``top`` sites live there (``sites``: ``site``, ``bytes``, ``blocks``)."""
    events = cpu_allocations(prof)
    if not events:
        return dict(peak=0, base=0, at="-", sites=[])
    f0 = events[0].extra_fields
    base = f0.total_allocated - f0.alloc_size
    peak, at = base, -1
    for i, e in enumerate(events):
        if e.extra_fields.total_allocated > peak:
            peak, at = e.extra_fields.total_allocated, i
    live: dict = {}
    for e in events[: at + 1]:
        f = e.extra_fields
        if f.alloc_size > 0:
            live[f.ptr] = (f.alloc_size, _cpu_site(e, libraries))
        else:
            live.pop(f.ptr, None)
    where = _cpu_site(events[at], libraries) if at >= 0 else "-"
    return dict(
        peak=peak - base, base=base, at=where, at_peak=[where], sites=ranked_sites(live.values(), top, rest=False)
    )
