"""Measurements of benchmarks/service.py: one workload through the service
(the async client streaming every job) or through the raw engine in process,
the statistics of a run, and the checks (every stream equals its result; the
service's tokens equal the raw engine's).

A run's record per request: its prompt and generated token counts, its token
ids, the arrival times of its token events (seconds from the run's start) with
the number of tokens each carried, and when it was submitted.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np


class CheckFailed(AssertionError):
    """A run's tokens are not what they must be (a stream differs from its
    result, or the service from the raw engine)."""


@dataclass
class Record:
    """One request of one run (times in seconds from the run's start)."""

    index: int
    submitted: float = 0.0
    prompt_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that event)
    finished: float = 0.0
    finish_reason: str = ""
    # service only: what the stream carried besides, and the worker's own timing
    stream_text: str = ""
    result_text: str = ""
    result_ids: list[int] | None = None
    restarts: int = 0
    worker_ttft: float | None = None
    worker_queue: float | None = None


# ---------------------------------------------------------------- service

async def _stream_one(client, index: int, prompt: str, job_id: str | None, gen: int, timeout: float) -> Record:
    """Submit (or, given ``job_id``, take the queued job) and read its stream;
    times are ``time.perf_counter()`` values until service_run makes them relative."""
    from kiviq.jobs.models import EventType

    rec = Record(index, submitted=time.perf_counter())
    handle = client.job(job_id) if job_id else await client.submit(prompt=prompt, max_tokens=gen, temperature=0.0)
    events = handle.events(timeout=timeout)
    try:
        async for event in events:
            now = time.perf_counter()
            if event.type == EventType.restarted:  # a requeued job starts over
                rec.restarts += 1
                rec.token_ids, rec.arrivals, rec.stream_text = [], [], ""
            elif event.type == EventType.token:
                rec.stream_text += event.text
                if event.token_ids:
                    rec.token_ids += event.token_ids
                    rec.arrivals.append((now, len(event.token_ids)))
            elif event.type == EventType.error:
                raise CheckFailed(f"request {index} (job {handle.job_id}) failed: {event.error}")
            elif event.type == EventType.done:
                result = event.result
                rec.finished = now
                rec.result_ids, rec.result_text = list(result.token_ids), result.text
                rec.prompt_tokens = result.usage.prompt_tokens
                rec.finish_reason = result.finish_reason.value
                rec.worker_ttft, rec.worker_queue = result.timing.ttft_s, result.timing.queue_s
    finally:
        await events.aclose()
    if rec.result_ids is None:
        raise CheckFailed(f"request {index} (job {handle.job_id}): the stream ended without a result")
    return rec


async def _stream_all(redis_url: str, items: list[tuple], gen: int, timeout: float, ready, go) -> list[Record]:
    """Stream every (index, prompt, job id or None) through one AsyncClient,
    once connected (``ready`` gets this process's pid) and ``go`` is set."""
    from redis.asyncio import Redis as AsyncRedis

    from kiviq.client import AsyncClient

    # The streams share the client's pub/sub connection but may all read their logs at
    # once: redis-py's async pool (100 connections by default, and it raises rather than
    # waits) is sized to that.
    connection = AsyncRedis.from_url(redis_url, max_connections=2 * len(items) + 16)
    try:
        async with AsyncClient(connection=connection) as client:
            await connection.ping()
            ready.put(os.getpid())
            await asyncio.to_thread(go.wait)
            return list(await asyncio.gather(*(_stream_one(client, *item, gen, timeout) for item in items)))
    finally:
        await connection.aclose()


def _run_loop(coro):
    try:
        import uvloop
    except ImportError:
        uvloop = None
    run = getattr(uvloop, "run", None)  # uvloop >= 0.18
    return run(coro) if run is not None else asyncio.run(coro)


def _client_process(redis_url, items, gen, timeout, ready, go, results) -> None:
    """One client process of ``service_run``: streams its share from ``go`` on
    and puts its records (or its error) on ``results``."""
    try:
        results.put(_run_loop(_stream_all(redis_url, items, gen, timeout, ready, go)))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        results.put(f"{type(e).__name__}: {e}")


def service_run(redis_url: str, prompts: list[str], gen: int, timeout: float = 3600.0, processes: int = 1,
                paused=None) -> tuple[list[Record], float]:
    """Run every prompt (greedy, ``gen`` new tokens) through the service and
    stream each job with ``kiviq.AsyncClient``; returns the records (times from
    the run's start) and the wall time until the last job's final event arrived.

    The jobs are split over ``processes`` client processes (each an asyncio
    loop, uvloop where installed), started before the clock: one Python loop
    reading 64 streams of a fast GPU falls behind and stamps events late.

    ``paused`` (the WorkerProcess; the default of benchmarks/service.py):
    "queued" submission. The worker is stopped (SIGSTOP) while ``kiviq.Client``
    submits every job in order; the clock starts when it resumes, so it admits
    them all before its first step, in that order, exactly as the raw engine
    gets them. None: "live" submission, each client process submits its jobs
    from the start of the clock while the worker already runs (TTFT counts
    from each job's submission).
    """
    items = [(i, p, None) for i, p in enumerate(prompts)]
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []
    try:
        if paused is not None:
            from kiviq.client import Client

            paused.pause()
            client = Client(redis_url)
            items = [(i, p, client.submit(prompt=p, max_tokens=gen, temperature=0.0).job_id) for i, p, _ in items]
            client.redis.close()
        shares = [items[k::processes] for k in range(max(1, min(processes, len(items))))]
        procs = [ctx.Process(target=_client_process, args=(redis_url, share, gen, timeout, ready, go, results),
                             daemon=True) for share in shares]
        for proc in procs:
            proc.start()
        for _ in procs:
            ready.get(timeout=300)
        t0 = time.perf_counter()
        if paused is not None:
            paused.resume()
        go.set()
        records = []
        for _ in procs:
            got = results.get(timeout=timeout + 60)
            if isinstance(got, str):
                raise CheckFailed(f"a client process failed: {got}")
            records += got
    finally:
        if paused is not None:
            paused.resume()
        for proc in procs:
            if proc.pid is not None:  # started
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    for r in records:
        r.submitted = 0.0 if paused is not None else r.submitted - t0
        r.finished -= t0
        r.arrivals = [(t - t0, n) for t, n in r.arrivals]
    records.sort(key=lambda r: r.index)
    return records, max(r.finished for r in records)


# ---------------------------------------------------------------- raw engine

def raw_run(engine, requests, steps: dict | None = None) -> tuple[list[Record], float]:
    """Add every request at once to an idle engine and step until all have
    ended, the way prefill.py times it; arrival time = when the step that
    returned an event returned. ``steps`` gets the run's step count and seconds
    in ``engine.step`` (to set beside the worker's, `worker_steps`)."""
    import mlx.core as mx

    records = {r.request_id: Record(i, prompt_tokens=len(r.prompt_tokens)) for i, r in enumerate(requests)}
    mx.synchronize()
    t0 = time.perf_counter()
    for r in requests:
        engine.add(r)
    n, in_steps = 0, 0.0
    while engine.has_work():
        began = time.perf_counter()
        events = engine.step()
        now = time.perf_counter() - t0
        n, in_steps = n + 1, in_steps + (time.perf_counter() - began)
        for ev in events:
            rec = records[ev.request_id]
            if ev.finish_reason == "error":
                raise CheckFailed(f"raw engine: request {rec.index} failed: {ev.error}")
            if ev.token_ids:
                rec.token_ids += ev.token_ids
                rec.arrivals.append((now, len(ev.token_ids)))
            if ev.finish_reason:
                rec.finished, rec.finish_reason = now, ev.finish_reason
    if steps is not None:
        steps.update(steps=n, step_s=in_steps)
    return list(records.values()), time.perf_counter() - t0


def worker_steps(metrics_url: str) -> dict[str, float]:
    """What the worker's Prometheus endpoint says so far: its engine steps
    (``steps``) and the seconds they took (``step_s``: ``engine.step`` plus turning
    the step's events into messages), and the seconds of its own loop around them
    by phase (``worker_loop_seconds_total``: publish, cancel_check, ...), and the
    outbox thread's publishing (``outbox_publish``, off the engine's thread)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    out: dict[str, float] = {"steps": 0, "step_s": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("step_duration_seconds_count"):
                out["steps"] += sample.value
            elif sample.name.endswith("step_duration_seconds_sum"):
                out["step_s"] += sample.value
            elif sample.name.endswith("outbox_publish_seconds_sum"):
                out["outbox_publish"] = out.get("outbox_publish", 0.0) + sample.value
            elif sample.name.endswith("worker_loop_seconds_total"):
                phase = sample.labels["phase"]
                out[phase] = out.get(phase, 0.0) + sample.value
    return out


# ---------------------------------------------------------------- statistics

def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(records: list[Record], wall: float, live: bool = True) -> dict:
    """Throughput and latency of one run. TTFT: from a request's submission to
    its first token's arrival. Inter-token latency: the gap between two token
    events of a request, divided by the tokens the later one carried (one
    sample per token); ``itl_burst`` takes only the gaps that ended before every
    request had its first token (sequences decoding while prompts prefill).
    For the service, ``bunched_events`` is the share of token events that
    arrived < 1 ms after the previous one of their job: near 0 while the client
    keeps up with the worker's steps (each step publishes one event per job);
    ``client_extra_ttft`` is the client's TTFT less the worker's own (and, for
    ``live`` submission, less its queue time): publishing, Redis and the client."""
    prompt = sum(r.prompt_tokens for r in records)
    generated = sum(len(r.token_ids) for r in records)
    firsts = [r.arrivals[0][0] for r in records if r.arrivals]
    first_all = max(firsts) if len(firsts) == len(records) else None
    ttft = [r.arrivals[0][0] - r.submitted for r in records if r.arrivals]
    itl, itl_burst = [], []
    for r in records:
        for (t_prev, _), (t, n) in zip(r.arrivals, r.arrivals[1:]):
            samples = [(t - t_prev) / n] * n
            itl += samples
            if first_all is not None and t < first_all:
                itl_burst += samples
    out = dict(requests=len(records), prompt_tokens=prompt, generated_tokens=generated, wall_s=wall,
               generated_tok_s=generated / wall, prompt_tok_s=prompt / wall, first_all_s=first_all,
               prefill_tok_s=prompt / first_all if first_all else None,
               ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99), ttft_max_s=max(ttft) if ttft else None,
               itl_p50_s=_pct(itl, 50), itl_p99_s=_pct(itl, 99),
               itl_burst_p50_s=_pct(itl_burst, 50), itl_burst_p99_s=_pct(itl_burst, 99), itl_burst_n=len(itl_burst),
               finish_reasons={k: sum(r.finish_reason == k for r in records)
                               for k in sorted({r.finish_reason for r in records})})
    served = [r for r in records if r.worker_ttft is not None and r.arrivals]
    if served:  # the service: what the worker measured itself, and what the client adds to it
        gaps = [b[0] - a[0] for r in records for a, b in zip(r.arrivals, r.arrivals[1:])]
        out.update(worker_ttft_p50_s=_pct([r.worker_ttft for r in served], 50),
                   worker_ttft_p99_s=_pct([r.worker_ttft for r in served], 99),
                   worker_queue_p50_s=_pct([r.worker_queue for r in served], 50),
                   client_extra_ttft_p50_s=_pct([r.arrivals[0][0] - r.submitted - r.worker_ttft
                                                 - (r.worker_queue if live else 0.0) for r in served], 50),
                   bunched_events=sum(g < 1e-3 for g in gaps) / len(gaps) if gaps else 0.0,
                   restarts=sum(r.restarts for r in records))
    return out


# ---------------------------------------------------------------- checks

def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first token where a and b differ (len of the shorter if one
    is a prefix of the other; len(a) if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_streams(records: list[Record]) -> list[str]:
    """Problems where a stream's tokens or text differ from its final result."""
    problems = []
    for r in records:
        if r.token_ids != r.result_ids:
            problems.append(f"request {r.index}: streamed {len(r.token_ids)} token ids, result has "
                            f"{len(r.result_ids or [])}, first difference at {first_divergence(r.token_ids, r.result_ids or [])}")
        elif r.stream_text != r.result_text:
            problems.append(f"request {r.index}: streamed text ({len(r.stream_text)} chars) differs from the "
                            f"result's ({len(r.result_text)} chars)")
    return problems


def compare_tokens(service: list[Record], raw: list[Record]) -> list[str]:
    """Problems where the service's result tokens differ from the raw engine's
    on the same request (greedy: they must be equal)."""
    by_index = {r.index: r for r in raw}
    problems = []
    for s in service:
        r = by_index.get(s.index)
        if r is None:
            problems.append(f"request {s.index}: no raw engine run")
        elif s.result_ids != r.token_ids:
            problems.append(f"request {s.index}: service {len(s.result_ids or [])} tokens, raw {len(r.token_ids)}, "
                            f"first difference at token {first_divergence(s.result_ids or [], r.token_ids)}")
        elif s.prompt_tokens != r.prompt_tokens:
            problems.append(f"request {s.index}: prompt of {s.prompt_tokens} tokens in the service, "
                            f"{r.prompt_tokens} in the raw engine")
    return problems
