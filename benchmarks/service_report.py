"""The report of benchmarks/service.py: its tables and per-run lines from the
results dict ``benchmark`` returns (also written by ``--json``)."""

from __future__ import annotations

from benchmarks.common import table


def _f(x, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def report(out: dict) -> str:
    header = ["arm", "run", "jobs", "prompt tok", "gen tok", "wall s", "gen tok/s", "prompt tok/s",
              "all first tokens s", "prefill tok/s", "TTFT p50 / p99 s", "ITL p50 / p99 ms",
              "ITL in prefill burst p50 / p99 ms"]
    rows = []
    for arm, runs in (("service", out["service"]), ("raw engine", out["raw"])):
        for k, s in enumerate(runs):
            rows.append([arm, f"{k + 1} ({'cold' if k == 0 else 'warm'})", s["requests"], f"{s['prompt_tokens']:,}",
                         f"{s['generated_tokens']:,}", _f(s["wall_s"]), _f(s["generated_tok_s"], digits=1),
                         _f(s["prompt_tok_s"], digits=0), _f(s["first_all_s"]), _f(s["prefill_tok_s"], digits=0),
                         f"{_f(s['ttft_p50_s'])} / {_f(s['ttft_p99_s'])}",
                         f"{_f(s['itl_p50_s'], 1e3, 1)} / {_f(s['itl_p99_s'], 1e3, 1)}",
                         f"{_f(s['itl_burst_p50_s'], 1e3, 1)} / {_f(s['itl_burst_p99_s'], 1e3, 1)}"])
    lines = [table(header, rows), ""]
    r = out["ratios"]
    names = {"service_over_raw_generated_tok_s": "service / raw engine, generated tok/s, last runs",
             "service_over_raw_run1_generated_tok_s": "service / raw engine, generated tok/s, first runs",
             "service_cold_over_warm_wall": "service first run / last run, wall time",
             "service_cold_over_warm_first_tokens": "service first run / last run, time to all first tokens",
             "raw_cold_over_warm_wall": "raw engine first run / last run, wall time"}
    lines += [f"- {names[k]}: {v:.3f}" for k, v in r.items()]
    for s_k, s in enumerate(out["service"]):
        if "worker_ttft_p50_s" in s:
            lines.append(f"- service run {s_k + 1}: worker-side TTFT (admitted -> first token) p50 "
                         f"{s['worker_ttft_p50_s']:.3f} s, p99 {s['worker_ttft_p99_s']:.3f} s; queue time p50 "
                         f"{s['worker_queue_p50_s']:.3f} s; client TTFT - worker's p50 "
                         f"{s['client_extra_ttft_p50_s'] * 1e3:.1f} ms; token events < 1 ms after the previous one "
                         f"{s['bunched_events']:.0%}; restarts {s['restarts']}; finish reasons {s['finish_reasons']}")
    for arm, key in (("service", "service_steps"), ("raw engine", "raw_steps")):
        for k, st in enumerate(out.get(key, [])):
            wall = out["service" if arm == "service" else "raw"][k]["wall_s"]
            n = int(st["steps"])
            if n:
                own = {phase: s for phase, s in st.items() if phase not in ("steps", "step_s", "outbox_publish")}
                lines.append(f"- {arm} run {k + 1}: {n} engine steps, {st['step_s'] / n * 1e3:.2f} ms "
                             f"each in the step (engine.step{' and its events' if arm == 'service' else ''}), "
                             f"{wall / n * 1e3:.2f} ms apart over the run"
                             + ("; the worker's own ms per step: " + ", ".join(
                                 f"{phase} {s / n * 1e3:.2f}" for phase, s in own.items()) if own else "")
                             + (f"; its outbox thread publishing {st['outbox_publish'] / n * 1e3:.2f} (off the "
                                "engine's thread)" if "outbox_publish" in st else ""))
    for arm, runs in out.get("cpu_busy", {}).items():
        for k, cores in enumerate(runs):
            if cores:
                lines.append(f"- {'raw engine' if arm == 'raw' else arm} run {k + 1}: CPUs busy on average: "
                             + ", ".join(f"{name} {n:.2f} of {out['cpu_sets'][name]}" for name, n in cores.items()))
    for name, c in out["checks"].items():
        verdict = "not checked" if not c["checked"] else "ok" if c["ok"] else \
            f"FAILED ({len(c['problems'])})" if c["exact"] else \
            (f"{len(c['problems'])} requests differ; reported only: with --submit live or more jobs than "
             "--max-active the worker groups prompts into prefill forwards otherwise than the raw engine, "
             "and the engine's greedy tokens depend on that grouping")
        lines.append(f"- check {name}: {verdict}")
        if c["checked"] and not c["ok"] and not c["exact"]:
            lines += [f"  - {p}" for p in c["problems"][:10]]
    return "\n".join(lines)


def cpu_ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
