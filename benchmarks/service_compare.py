"""Builds compared on the service benchmark: the spread of each, and whether they differ.

Reads the ``--json`` files of ``benchmarks/service.py`` processes, grouped by
build, and prints one row per build over the warm runs (run 1 of a process is
its first after the warm-up and is reported apart): generated tokens/s through
the service and the raw engine, the service/raw ratio of each run, the worker's
time between steps, its ``engine.step`` against the raw engine's, the worker's
own time on the engine's thread, the first run against the process's warm
runs, the decode phase (after every job had its first token) of both, and how
many of the load's CPUs (clients, Redis) were busy during each arm's runs. With two builds it adds permutation tests of the ratio: the share of
relabellings whose difference of means is at least the observed one, with the
runs as samples and with each process's mean as one. On the H200 host the same
build's runs spread 0.7-1.2 in ratio with the host's speed (docs/performance.md,
"The host's speed"), and the runs of one process share its host's moods, so the
process-level test is the honest one; it needs many processes of each build,
interleaved in one lease.

    python3 benchmarks/service_compare.py new=out/new-1.json,out/new-2.json old=out/old-1.json,out/old-2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import spread, table  # noqa: E402


def run_rows(result: dict) -> list[dict]:
    """Per run of one process: its figures (times in ms per engine step)."""
    service, raw = result["service"], result["raw"]
    steps, raw_steps = result["service_steps"], result["raw_steps"]
    busy = result.get("cpu_busy", {})
    load = [[cores.get("load") for cores in busy.get(arm, [])] for arm in ("service", "raw")]
    rows = []
    for i, (s, r, st, rst) in enumerate(zip(service, raw, steps, raw_steps)):
        n = st["steps"]
        own = sum(st.get(phase, 0.0) for phase in ("publish", "cancel_check", "admit_housekeeping"))
        rows.append({
            "first": i == 0,
            "service_tok_s": s["generated_tok_s"],
            "raw_tok_s": r["generated_tok_s"],
            "ratio": s["generated_tok_s"] / r["generated_tok_s"],
            "between_ms": (s["wall_s"] - st["step_s"]) / n * 1e3,
            "step_vs_raw_ms": (st["step_s"] / n - rst["step_s"] / rst["steps"]) * 1e3,
            "own_ms": own / n * 1e3,
            "ttft_p50_s": s["ttft_p50_s"],
            "wall_s": s["wall_s"],
            "first_all_s": s["first_all_s"],
            # after every job had its first token: where the service's slower steps show
            "decode_s": s["wall_s"] - s["first_all_s"],
            "raw_decode_s": r["wall_s"] - r["first_all_s"],
            "load_busy": tuple(arm[i] if i < len(arm) else None for arm in load),
        })
    return rows


def load_cell(warm: list[dict]) -> str:
    """Median busy load CPUs (clients, Redis) during the service's and the raw engine's
    runs; '-' for files from before service.py measured them."""
    pairs = [r["load_busy"] for r in warm]
    if any(None in pair for pair in pairs):
        return "-"
    return " / ".join(f"{statistics.median(pair[k] for pair in pairs):.2f}" for k in (0, 1))


def first_run_ratios(rows: list[dict]) -> tuple[float, float] | None:
    """(whole run, time to all first tokens) of the first run over the median warm run."""
    warm = [r for r in rows if not r["first"]]
    first = [r for r in rows if r["first"]]
    if not warm or not first:
        return None
    return (first[0]["wall_s"] / statistics.median(r["wall_s"] for r in warm),
            first[0]["first_all_s"] / statistics.median(r["first_all_s"] for r in warm))


def permutation_p(a: list[float], b: list[float], rounds: int = 20000, seed: int = 0) -> float:
    """Two-sided: the share of relabellings whose |mean difference| >= the observed one
    (all of them where there are at most ``rounds``, else ``rounds`` random ones)."""
    observed = abs(statistics.fmean(a) - statistics.fmean(b)) - 1e-12
    pooled = a + b
    if math.comb(len(pooled), len(a)) <= rounds:
        splits = [[pooled[i] for i in chosen] for chosen in itertools.combinations(range(len(pooled)), len(a))]
        total = sum(pooled)
        hits = sum(abs(statistics.fmean(x) - (total - sum(x)) / len(b)) >= observed for x in splits)
        return hits / len(splits)
    rng, hits = random.Random(seed), 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if abs(statistics.fmean(pooled[:len(a)]) - statistics.fmean(pooled[len(a):])) >= observed:
            hits += 1
    return hits / rounds


def parse_builds(specs: list[str]) -> dict[str, list[Path]]:
    builds: dict[str, list[Path]] = {}
    for spec in specs:
        label, sep, files = spec.partition("=")
        if not sep or not label or not files:
            raise SystemExit(f"service_compare: {spec!r}: give LABEL=FILE[,FILE...]")
        paths = [Path(f) for f in files.split(",") if f]
        for path in paths:
            if not path.is_file():
                raise SystemExit(f"service_compare: {path}: no such file (a --json of benchmarks/service.py)")
        builds.setdefault(label, []).extend(paths)
    return builds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("builds", nargs="+", help="LABEL=FILE[,FILE...]: a build's service.py --json files")
    args = p.parse_args(argv)
    builds = parse_builds(args.builds)
    header = ["build", "processes", "warm runs", "service tok/s min / median / max", "raw tok/s min / median / max",
              "service / raw min / median / max", "between steps ms", "step vs raw ms", "worker's own ms",
              "TTFT p50 s", "first run / warm: whole, to all first tokens",
              "decode phase s, median: service / raw", "load CPUs busy, median: service / raw"]
    rows, ratios, process_ratios = [], {}, {}
    for label, paths in builds.items():
        per_process = [run_rows(json.loads(path.read_text())) for path in paths]
        warm = [r for runs in per_process for r in runs if not r["first"]]
        if not warm:
            raise SystemExit(f"service_compare: {label}: no warm runs (service.py --runs 2 or more)")
        firsts = [f for f in map(first_run_ratios, per_process) if f is not None]
        ratios[label] = [r["ratio"] for r in warm]
        process_ratios[label] = [statistics.fmean(r["ratio"] for r in runs if not r["first"])
                                 for runs in per_process if any(not r["first"] for r in runs)]
        rows.append([label, len(paths), len(warm), spread([r["service_tok_s"] for r in warm], ",.0f"),
                     spread([r["raw_tok_s"] for r in warm], ",.0f"), spread(ratios[label], ".3f"),
                     spread([r["between_ms"] for r in warm], ".2f"), spread([r["step_vs_raw_ms"] for r in warm], "+.2f"),
                     spread([r["own_ms"] for r in warm], ".2f"),
                     f"{min(r['ttft_p50_s'] for r in warm):.2f}-{max(r['ttft_p50_s'] for r in warm):.2f}",
                     ", ".join(f"{w:.2f}x / {a:.2f}x" for w, a in firsts) or "-",
                     f"{statistics.median(r['decode_s'] for r in warm):.2f} / "
                     f"{statistics.median(r['raw_decode_s'] for r in warm):.2f}", load_cell(warm)])
    print(table(header, rows))
    if len(ratios) == 2:
        (la, a), (lb, b) = ratios.items()
        pa, pb = process_ratios.values()
        print(f"\nservice/raw, mean of warm runs: {la} {statistics.fmean(a):.3f}, {lb} {statistics.fmean(b):.3f}; "
              f"permutation p (two-sided): runs as independent {permutation_p(a, b):.3f}, "
              f"processes' means as the samples {permutation_p(pa, pb):.3f} (at least "
              f"{2 / math.comb(len(pa) + len(pb), len(pa)):.3f} with {len(pa)} and {len(pb)} processes)")


if __name__ == "__main__":
    main()
