"""``kiviq top``: a live terminal view of queues, workers and throughput.

Where the numbers come from:

* queues: ``rq.Queue.count`` (jobs waiting) and the sizes of rq's started,
  finished and failed registries of each queue (``jobs.keys.queue_names()``).
  Registry sizes are what rq still holds: finished and failed entries expire
  with the jobs' result/failure TTL, so they are not lifetime totals; the
  frame labels them "IN RQ REGISTRIES" so they are not read as the workers'
  counts below.
* workers: ``rq.Worker.all`` (name, state) joined with the JSON snapshot each
  worker writes every second to ``jobs.keys.worker_stats_key(name)`` (TTL'd;
  see ``worker.stats.StatsPublisher``): sequences running/waiting in its
  engine, KV bytes used/budget, decode/prefill tokens/s and mean step time
  over the worker's last 10 s. A snapshot without an rq registration (a worker
  that just died) is shown with state ``-`` until it expires.
* jobs ("ENDED BY WORKERS"): counted by the workers themselves (``WorkerMetrics.job_finished``).
  "last 60s" is the number of jobs each worker ended in the 60 s before its
  latest snapshot, summed over workers: that is the jobs/min rate. "total" is
  the sum of the workers' cumulative counters since each started (a restarted
  worker starts again from 0; an expired one drops out).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from redis import Redis
from rq import Queue, Worker

from kiviq.jobs.keys import queue_names, worker_stats_key, worker_stats_pattern
from kiviq.jobs.settings import redact_url, redis_url_from_env

OUTCOMES = ("finished", "failed", "cancelled", "timeout")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def read_worker_stats(conn: Redis) -> dict[str, dict]:
    """Every live worker snapshot, by worker name."""
    keys = sorted(set(conn.scan_iter(match=worker_stats_pattern(), count=200)))
    out: dict[str, dict] = {}
    if not keys:
        return out
    prefix = worker_stats_key("")
    for key, raw in zip(keys, conn.mget(keys)):
        if raw is None:  # expired between SCAN and MGET
            continue
        try:
            snap = json.loads(raw)
        except ValueError:
            continue
        name = snap.get("worker") or _text(key)[len(prefix):]
        out[name] = snap
    return out


def collect(conn: Redis, now: float | None = None) -> dict:
    """The numbers of one frame, as a JSON-able dict."""
    now = time.time() if now is None else now
    queues = []
    for name in queue_names():
        q = Queue(name, connection=conn)
        queues.append({
            "name": name,
            "queued": q.count,
            "started": q.started_job_registry.get_job_count(cleanup=False),
            "finished": q.finished_job_registry.get_job_count(cleanup=False),
            "failed": q.failed_job_registry.get_job_count(cleanup=False),
        })

    stats = read_worker_stats(conn)
    rq_workers = {w.name: w.get_state() for w in Worker.all(connection=conn)}
    workers = []
    for name in sorted(set(rq_workers) | set(stats)):
        snap = stats.get(name)
        workers.append({
            "name": name,
            "state": str(getattr(rq_workers.get(name), "value", rq_workers.get(name) or "-")),
            "registered": name in rq_workers,
            "stats": snap,
            "age_s": (now - snap["time"]) if snap and "time" in snap else None,
        })

    recent = {o: 0 for o in OUTCOMES}
    total = {o: 0 for o in OUTCOMES}
    per_min = {o: 0.0 for o in OUTCOMES}
    decode = prefill = 0.0
    running = waiting = 0
    for snap in stats.values():
        window = float(snap.get("jobs_window_s") or 60.0)
        for o in OUTCOMES:
            n = int((snap.get("jobs_recent") or {}).get(o, 0))
            recent[o] += n
            per_min[o] += n * 60.0 / window
            total[o] += int((snap.get("jobs") or {}).get(o, 0))
        decode += float(snap.get("decode_tokens_per_s") or 0.0)
        prefill += float(snap.get("prefill_tokens_per_s") or 0.0)
        running += int(snap.get("running") or 0)
        waiting += int(snap.get("waiting") or 0)
    return {
        "time": now,
        "queues": queues,
        "workers": workers,
        "jobs": {"window_s": 60.0, "recent": recent, "per_min": per_min, "total": total},
        "totals": {"queued": sum(q["queued"] for q in queues), "running": running, "waiting": waiting,
                   "decode_tokens_per_s": decode, "prefill_tokens_per_s": prefill},
    }


# ---- rendering ------------------------------------------------------------------

def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _num(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def render_frame(data: dict, url: str = "") -> str:
    """One frame of plain text (no escape codes)."""
    stamp = time.strftime("%H:%M:%S", time.localtime(data["time"]))
    lines = [f"kiviq top   {redact_url(url)}   {stamp}".rstrip(), ""]

    lines.append(" " * 24 + f"{' IN RQ REGISTRIES ':-^27}")
    lines.append(f"{'QUEUE':<16}{'QUEUED':>8}{'STARTED':>9}{'FINISHED':>10}{'FAILED':>8}")
    for q in data["queues"]:
        lines.append(f"{q['name']:<16}{q['queued']:>8}{q['started']:>9}{q['finished']:>10}{q['failed']:>8}")
    lines.append("(rq registries keep finished/failed jobs only for their result/failure TTL: not totals)")
    lines.append("")

    jobs = data["jobs"]
    lines.append(f"{'ENDED BY WORKERS':<18}{'PER MIN (last 60s)':>20}{'SINCE WORKER START':>20}")
    for o in OUTCOMES:
        lines.append(f"{o:<18}{jobs['per_min'][o]:>20.0f}{jobs['total'][o]:>20}")
    lines.append("(counted by the live workers themselves, each since it started)")
    lines.append("")

    t = data["totals"]
    lines.append(f"WORKERS ({len(data['workers'])})   running {t['running']}  waiting {t['waiting']}   "
                 f"decode {t['decode_tokens_per_s']:.1f} tok/s   prefill {t['prefill_tokens_per_s']:.1f} tok/s")
    header = (f"{'NAME':<24}{'STATE':<8}{'RUN':>5}{'WAIT':>6}  {'KV USED / BUDGET':<26}"
              f"{'DECODE/s':>10}{'PREFILL/s':>11}{'STEP ms':>9}{'TTFT s':>8}{'AGE s':>7}")
    lines.append(header)
    if not data["workers"]:
        lines.append("(no workers)")
    for w in data["workers"]:
        s = w["stats"] or {}
        name = w["name"] if len(w["name"]) <= 23 else w["name"][:22] + "~"
        if s:
            used, budget = s.get("kv_used_bytes", 0), s.get("kv_budget_bytes", 0)
            kv = f"{human_bytes(used)} / {human_bytes(budget)}"
            if budget:
                kv += f" {100.0 * used / budget:.0f}%"
            step = s.get("step_time_s")
            lines.append(
                f"{name:<24}{w['state']:<8}{s.get('running', 0):>5}{s.get('waiting', 0):>6}  {kv:<26}"
                f"{s.get('decode_tokens_per_s', 0.0):>10.1f}{s.get('prefill_tokens_per_s', 0.0):>11.1f}"
                f"{_num(step * 1000 if step is not None else None):>9}{_num(s.get('ttft_avg_s'), '{:.2f}'):>8}"
                f"{_num(w['age_s']):>7}")
        else:
            lines.append(f"{name:<24}{w['state']:<8}{'(no stats published)':>40}")
    return "\n".join(lines) + "\n"


# ---- the command ----------------------------------------------------------------

def run_top(redis_url: str | None = None, *, interval: float = 1.0, once: bool = False, as_json: bool = False,
            out: TextIO | None = None) -> int:
    """``kiviq top``: redraw every ``interval`` s until Ctrl-C; ``once``
    prints one frame (or, with ``as_json``, the numbers) and returns."""

    out = out or sys.stdout
    url = redis_url_from_env(redis_url)
    conn = Redis.from_url(url)
    if once:
        data = collect(conn)
        out.write(json.dumps(data, indent=2) + "\n" if as_json else render_frame(data, url))
        out.flush()
        return 0
    out.write("\x1b[?25l\x1b[2J")  # hide the cursor, clear the screen
    try:
        while True:
            try:
                frame = render_frame(collect(conn), url)
            except Exception as e:  # noqa: BLE001 - Redis down: say so, keep trying
                frame = f"kiviq top   {redact_url(url)}   {time.strftime('%H:%M:%S')}\n\nerror: {type(e).__name__}: {e}\n"
            # home, then each line clearing its old tail, then clear below
            out.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in frame.splitlines()) + "\x1b[J")
            out.flush()
            time.sleep(max(0.1, interval))
    except KeyboardInterrupt:
        return 0
    finally:
        out.write("\x1b[?25h")
        out.flush()
