"""Summaries of a profiled decode step (benchmarks/step_trace.py ``--trace`` and
``--host-profile``): device busy time, kernels by name, where plain copies run, one
layer's ops in launch order, the host's CUDA API calls, and cProfile's top functions.
Events are torch.profiler's chrome-trace events (``benchmarks.common.device_trace``)."""

from __future__ import annotations

import collections
import os

from benchmarks.common import API_EVENTS, DEVICE_EVENTS, table


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def summarize(events: list[dict], steps: int, top: int) -> tuple[str, list[list]]:
    """The trace's headline and its per-kernel rows (us per step, calls per step)."""
    if not events:
        return "the trace holds no device events", []
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
    span = max(e for _, e in spans) - min(s for s, _ in spans)
    busy = busy_time(spans)
    head = (f"{len(events) / steps:.0f} device ops per step; device busy {busy / steps / 1e3:.2f} ms of a "
            f"{span / steps / 1e3:.2f} ms traced span per step ({100 * busy / span:.0f}%)")
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        name = e["name"] if len(e["name"]) <= 80 else e["name"][:77] + "..."
        dur[name] += e["dur"]
        calls[name] += 1
    rows = [[name, f"{d / steps:.1f}", f"{calls[name] / steps:.1f}"] for name, d in dur.most_common(top)]
    return head, rows


def copy_sites(events: list[dict], steps: int, top: int) -> list[list]:
    """Where the plain copies run: per (copy kernel, grid x block, the kernels
    before and after it), us and calls per step. A copy's grid gives its size,
    its neighbours the op that needed it."""
    ordered = sorted(events, key=lambda e: e["ts"])
    dur, calls = collections.Counter(), collections.Counter()

    def short(e):
        return e["name"].split("(")[0].split("<")[0][-40:]

    for i, e in enumerate(ordered):
        if "copy" not in e["name"].lower():
            continue
        a = e.get("args", {})
        grid, block = a.get("grid", "?"), a.get("block", "?")
        before = short(ordered[i - 1]) if i else "-"
        after = short(ordered[i + 1]) if i + 1 < len(ordered) else "-"
        key = (e["name"][:60], f"{grid} x {block}", before, after)
        dur[key] += e["dur"]
        calls[key] += 1
    return [[*k, f"{d / steps:.1f}", f"{calls[k] / steps:.1f}"] for k, d in dur.most_common(top)]


def host_api(events: list[dict], steps: int, top: int) -> tuple[str, list[list]]:
    """The host's CUDA runtime/driver calls (MLX adding graph nodes, capturing cuBLAS,
    updating and launching graphs): total host us per step and the calls by name."""
    dur, calls = collections.Counter(), collections.Counter()
    for e in events:
        dur[e["name"]] += e["dur"]
        calls[e["name"]] += 1
    head = (f"host CUDA API calls: {sum(calls.values()) / steps:.0f} per step, "
            f"{sum(dur.values()) / steps / 1e3:.2f} ms of host time per step")
    return head, [[n, f"{d / steps:.1f}", f"{calls[n] / steps:.1f}", f"{d / calls[n]:.2f}"]
                  for n, d in dur.most_common(top)]


def one_layer(events: list[dict], marker: str = "attend_split") -> list[list]:
    """The device ops of one decoder layer in launch order: those between the second
    and third attention kernels of the trace (name, grid, us)."""
    ordered = sorted(events, key=lambda e: e["ts"])
    at = [i for i, e in enumerate(ordered) if marker in e["name"]]
    if len(at) < 3:
        return []
    return [[e["name"].split("(")[0][:70], e.get("args", {}).get("grid", "?"), f"{e['dur']:.1f}"]
            for e in ordered[at[1]:at[2]]]


def print_host_profile(host, steps: int, top: int) -> None:
    """The timed steps' host functions by own time (us per step), then by
    cumulative time: where the Python side of a step goes."""
    import pstats

    st = pstats.Stats(host)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        where = fn if file == "~" else f"{os.path.basename(file)}:{line} {fn}"
        rows.append((tt, ct, nc, where[:90]))
    for label, key in (("own", 0), ("cumulative", 1)):
        best = sorted(rows, key=lambda r: -r[key])[:top]
        print(f"\nhost functions by {label} time\n")
        print(table(["function", "own us / step", "cum us / step", "calls / step"],
                    [[w, f"{tt / steps * 1e6:.0f}", f"{ct / steps * 1e6:.0f}", f"{nc / steps:.1f}"]
                     for tt, ct, nc, w in best]))


def print_trace(events: list[dict], steps: int, top: int) -> None:
    """Everything ``--trace`` prints, from device and API events of ``steps`` steps."""
    api = [e for e in events if e.get("cat") in API_EVENTS]
    events = [e for e in events if e.get("cat") in DEVICE_EVENTS]
    head, rows = summarize(events, steps, top)
    sites = copy_sites(events, steps, top)
    print(f"\n{head}\n")
    print(table(["device op", "us / step", "calls / step"], rows))
    layer = one_layer(events)
    if layer:
        print(f"\none layer's device ops in launch order ({len(layer)})\n")
        print(table(["op", "grid", "us"], layer))
    if api:
        head, rows = host_api(api, steps, top)
        print(f"\n{head}\n")
        print(table(["CUDA call", "host us / step", "calls / step", "us / call"], rows))
    if sites:
        print("\nplain copies: where they run\n")
        print(table(["copy", "grid x block", "after", "before", "us / step", "calls / step"], sites))
