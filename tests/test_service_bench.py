"""benchmarks/service.py: its checks catch what they must, its statistics are
right, and its whole path (own redis-server, `kiviq worker` subprocess, the
async client, the raw engine in process) runs at a tiny size with every
stream equal to its result and the service equal to the raw engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed

from benchmarks.service_measure import Record, check_streams, compare_tokens, summarize  # noqa: E402


def served(index: int, ids: list[int], arrivals: list[tuple[float, int]], **kw) -> Record:
    """A service record whose stream carried ``ids`` and whose result says the same."""
    text = "".join(f"<{t}>" for t in ids)
    fields = dict(submitted=0.0, prompt_tokens=10, token_ids=list(ids), arrivals=arrivals, finished=arrivals[-1][0],
                  finish_reason="length", stream_text=text, result_text=text, result_ids=list(ids),
                  worker_ttft=0.1, worker_queue=0.0)
    fields.update(kw)
    return Record(index, **fields)


def test_check_streams_finds_a_stream_that_differs_from_its_result():
    good = served(0, [5, 6, 7], [(1.0, 1), (1.1, 2)])
    assert check_streams([good]) == []
    lost = served(1, [5, 6], [(1.0, 1), (1.1, 1)], result_ids=[5, 6, 7])
    text = served(2, [5, 6], [(1.0, 1), (1.1, 1)], result_text="<5><9>")
    problems = check_streams([good, lost, text])
    assert len(problems) == 2
    assert problems[0].startswith("request 1:") and "first difference at 2" in problems[0]
    assert problems[1].startswith("request 2:") and "text" in problems[1]


def test_compare_tokens_finds_the_first_differing_token():
    service = [served(0, [1, 2, 3], [(1.0, 3)]), served(1, [4, 5, 6], [(1.0, 3)])]
    raw = [Record(0, prompt_tokens=10, token_ids=[1, 2, 3]), Record(1, prompt_tokens=10, token_ids=[4, 9, 6])]
    problems = compare_tokens(service, raw)
    assert problems == ["request 1: service 3 tokens, raw 3, first difference at token 1"]
    assert compare_tokens(service, [raw[0], Record(1, prompt_tokens=10, token_ids=[4, 5, 6])]) == []
    assert "prompt" in compare_tokens(service, [raw[0], Record(1, prompt_tokens=11, token_ids=[4, 5, 6])])[0]


def test_summarize_times_ttft_itl_and_the_burst():
    # request 0 decodes while request 1 still waits for its first token (at 2.0 s)
    a = served(0, [1, 2, 3, 4], [(0.5, 1), (1.0, 1), (1.5, 2)], submitted=0.1)
    b = served(1, [7, 8], [(2.0, 1), (3.0, 1)], submitted=0.2, finished=3.5)
    s = summarize([a, b], wall=4.0)
    assert s["generated_tokens"] == 6 and s["prompt_tokens"] == 20
    assert s["generated_tok_s"] == pytest.approx(1.5) and s["prompt_tok_s"] == pytest.approx(5.0)
    assert s["first_all_s"] == 2.0 and s["prefill_tok_s"] == pytest.approx(10.0)
    assert s["ttft_p50_s"] == pytest.approx((0.4 + 1.8) / 2) and s["ttft_max_s"] == pytest.approx(1.8)
    # gaps per token: a: 0.5, then 0.5 s for 2 tokens -> 0.25, 0.25; b: 1.0
    assert s["itl_p50_s"] == pytest.approx(0.375)
    assert s["itl_burst_n"] == 3 and s["itl_burst_p99_s"] == pytest.approx(0.5, abs=0.01)
    assert s["bunched_events"] == 0.0 and s["client_extra_ttft_p50_s"] == pytest.approx((0.3 + 1.7) / 2)


def test_split_cpus_gives_the_worker_the_lower_half_and_needs_four():
    from benchmarks.service_setup import split_cpus

    one_thread_per_core = str
    assert split_cpus({0, 1, 2, 3, 4, 5, 6, 7}, one_thread_per_core) == ({0, 1, 2, 3}, {4, 5, 6, 7})
    assert split_cpus({3, 9, 4, 8, 5}, one_thread_per_core) == ({3, 4}, {5, 8, 9})
    assert split_cpus({0, 1, 2}) is None


def test_split_cpus_keeps_the_threads_of_a_core_on_one_side():
    from benchmarks.service_setup import split_cpus

    def siblings_8_apart(cpu):  # 8 cores of 2 threads, the second threads numbered 8-15
        return f"{cpu % 8},{cpu % 8 + 8}"

    worker, load = split_cpus(set(range(16)), siblings_8_apart)
    assert worker == {0, 1, 2, 3, 8, 9, 10, 11} and load == {4, 5, 6, 7, 12, 13, 14, 15}
    # One thread per core, or no word from sysfs: the plain halves.
    assert split_cpus(set(range(8)), str) == ({0, 1, 2, 3}, {4, 5, 6, 7})
    assert split_cpus(set(range(16)), lambda cpu: "all") == (set(range(8)), set(range(8, 16)))


def test_pin_this_process_moves_threads_already_running():
    import threading

    from benchmarks.service_setup import pin_this_process

    before = os.sched_getaffinity(0)
    one = {min(before)}
    started, stop, seen = threading.Event(), threading.Event(), []

    def run() -> None:
        started.set()
        stop.wait()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    try:
        pin_this_process(one)
        assert os.sched_getaffinity(0) == one
    finally:
        stop.set()
        thread.join()
        pin_this_process(before)
    assert seen == [one]


def test_cpu_busy_counts_a_spinning_cpu_as_busy():
    from benchmarks.service_setup import CpuBusy, pin_this_process

    before = os.sched_getaffinity(0)
    cpu = min(before)
    pin_this_process({cpu})
    try:
        with CpuBusy({"spun": [cpu], "none": []}) as busy:
            end = time.perf_counter() + 0.3
            while time.perf_counter() < end:
                pass
    finally:
        pin_this_process(before)
    assert 0.8 <= busy.cores["spun"] <= 1.0 and "none" not in busy.cores


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="the benchmark needs a redis-server binary")
def test_the_benchmark_runs_the_whole_path_and_its_checks_hold(tmp_path):
    out = tmp_path / "service.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "benchmarks/service.py", "--jobs", "2", "--prompt-tokens", "24", "--gen", "5", "--runs", "2",
         "--log", str(tmp_path / "worker.log"), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("streams_equal_results", "service_equals_raw"):
        assert res["checks"][name] == {"ok": True, "checked": True, "exact": True, "problems": []}, name
    assert res["redis"] == "redis-server"
    assert len(res["service"]) == len(res["raw"]) == 2
    for run in res["service"] + res["raw"]:
        assert run["requests"] == 2 and 0 < run["generated_tokens"] <= 10
        assert run["prompt_tokens"] > 30 and run["generated_tok_s"] > 0 and run["ttft_p50_s"] > 0
    for s, r in zip(res["service"], res["raw"]):  # the same requests, the same greedy tokens
        assert (s["prompt_tokens"], s["generated_tokens"]) == (r["prompt_tokens"], r["generated_tokens"])
    assert "| service | 2 (warm) |" in proc.stdout and "check service_equals_raw: ok" in proc.stdout
    assert res["ratios"]["service_over_raw_generated_tok_s"] > 0
    # Engine steps per run, read from the worker's metrics and counted in the raw loop:
    # a run of 2 requests x <= 5 tokens is a few steps, each taking some time.
    for steps in res["service_steps"] + res["raw_steps"]:
        assert 2 <= steps["steps"] <= 20 and steps["step_s"] > 0
    for steps in res["service_steps"]:  # the worker's own loop, by phase (worker_loop_seconds_total)
        assert steps["publish"] > 0 and steps["cancel_check"] > 0
    assert "engine steps," in proc.stdout and "the worker's own ms per step: publish" in proc.stdout
    # What ran on which CPUs during each run, per arm (all of them below 4 CPUs).
    assert len(res["cpu_busy"]["service"]) == len(res["cpu_busy"]["raw"]) == 2
    for cores in res["cpu_busy"]["service"] + res["cpu_busy"]["raw"]:
        assert set(cores) == set(res["cpu_sets"]) and all(0 < n <= res["cpu_sets"][k] for k, n in cores.items())
    assert "service run 1: CPUs busy on average: " in proc.stdout and "raw engine run 2: CPUs busy" in proc.stdout
    # Run by run: each service run is followed by the raw engine's on the same requests.
    order = [proc.stdout.index(f"{arm} run {k}: ") for k in (1, 2) for arm in ("service", "raw engine")]
    assert order == sorted(order)


def test_the_machine_line_says_when_cpus_are_smt_threads(monkeypatch):
    import benchmarks.common as common

    monkeypatch.setattr(common.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(common, "physical_core", lambda cpu: f"{cpu % 8},{cpu % 8 + 8}")
    assert common._smt() == ", 2 threads per core"
    monkeypatch.setattr(common, "physical_core", str)
    assert common._smt() == ""
