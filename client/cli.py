"""The ``kiviq`` command: worker, generate, demo."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from kiviq.client.client import Client
from kiviq.client.local_redis import ensure_redis
from kiviq.jobs.settings import redis_url_from_env

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain in one sentence what a GPU is.",
]

def cmd_generate(args: argparse.Namespace) -> int:
    client = Client(args.redis_url)
    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.logprobs is not None:
        fields.update(logprobs=True, top_logprobs=args.logprobs)
    if args.raw:
        handle = client.submit(prompt=args.prompt, **fields)
    else:
        handle = client.submit(messages=[{"role": "user", "content": args.prompt}], **fields)
    for delta in handle.stream(timeout=args.timeout):
        print(delta, end="", flush=True)
    print()
    if args.logprobs is not None:
        for t in handle.result(timeout=args.timeout).logprobs or []:
            alternatives = "  ".join(f"{a.token!r} {a.logprob:.3f}" for a in t.top_logprobs)
            print(f"{t.token!r:>16} {t.logprob:8.3f}" + (f"   | {alternatives}" if alternatives else ""))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    if Client(args.redis_url).cancel(args.job_id):
        print(f"cancelled {args.job_id}")
        return 0
    print(f"{args.job_id}: no such job, or it already ended", file=sys.stderr)
    return 1


def cmd_top(args: argparse.Namespace) -> int:
    from kiviq.client.top import run_top

    return run_top(args.redis_url, interval=args.interval, once=args.once, as_json=args.json)


def cmd_bulk(args: argparse.Namespace) -> int:
    import json

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from kiviq.client.bulk import run_bulk
    from kiviq.jobs.validation import InvalidRequest

    defaults = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                    stop=args.stop, priority=args.priority, timeout_s=args.job_timeout)
    try:
        summary = run_bulk(Client(args.redis_url), args.input, args.output, max_in_flight=args.max_in_flight,
                           defaults=defaults, progress=args.progress, retry_failed=args.retry_failed)
    except (InvalidRequest, FileNotFoundError, ValueError) as e:
        print(f"kiviq: error: bulk: {e}", file=sys.stderr)
        return 2
    except (RedisConnectionError, RedisTimeoutError) as e:
        print(f"kiviq: error: bulk: cannot reach Redis ({e}); start it or pass --redis-url "
              "(nothing was written)", file=sys.stderr)
        return 1
    print(json.dumps(summary.as_dict()), flush=True)
    return 0 if summary.failed == 0 else 1


def cmd_demo(args: argparse.Namespace) -> int:
    url, stop_redis, kind = ensure_redis(redis_url_from_env(args.redis_url))
    print(f"[kiviq] Redis: {kind}", flush=True)
    worker_cmd = [sys.executable, "-m", "kiviq.worker", "--redis-url", url, "--log-level", "WARNING"]
    if args.model:
        worker_cmd += ["--model", args.model]
    worker = subprocess.Popen(worker_cmd)
    try:
        client = Client(url)
        print(f"[kiviq] worker starting (model: {args.model or 'SmolLM2-135M-Instruct'}); enqueueing "
              f"{len(DEMO_PROMPTS)} prompts", flush=True)
        handles = [client.submit(messages=[{"role": "user", "content": p}], max_tokens=args.max_tokens)
                   for p in DEMO_PROMPTS]
        for prompt, handle in zip(DEMO_PROMPTS, handles):
            print(f"\n>>> {prompt}\n", flush=True)
            for delta in handle.stream(timeout=args.timeout):
                print(delta, end="", flush=True)
            r = handle.result(timeout=args.timeout)
            print(f"\n[{r.finish_reason.value}] {r.usage.prompt_tokens} prompt + {r.usage.completion_tokens} "
                  f"completion tokens, first token {r.timing.ttft_s:.2f} s, "
                  f"{r.timing.decode_tokens_per_s:.1f} tokens/s", flush=True)
        return 0
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
        stop_redis()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiviq", description="Batch LLM generation over Redis, on MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    # Listed for --help only: main() hands `kiviq worker ...` to `python -m kiviq.worker`.
    sub.add_parser("worker", help="serve jobs from Redis with a model (kiviq worker --help)", add_help=False)

    g = sub.add_parser("generate", help="submit one prompt and stream the answer")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--raw", action="store_true", help="send as a raw completion prompt (no chat template)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the text, print each token's logprob and its N most likely alternatives (0..20)")
    g.add_argument("--timeout", type=float, default=600.0)
    g.add_argument("--redis-url", default=None)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("cancel", help="cancel a queued or running job")
    c.add_argument("job_id")
    c.add_argument("--redis-url", default=None)
    c.set_defaults(func=cmd_cancel)

    t = sub.add_parser("top", help="live view of queues, workers and throughput")
    t.add_argument("--redis-url", default=None)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    t.add_argument("--once", action="store_true", help="print one frame (no ANSI codes) and exit")
    t.add_argument("--json", action="store_true", help="with --once: print the numbers as JSON")
    t.set_defaults(func=cmd_top)

    b = sub.add_parser("bulk", help="run a JSONL file of requests (OpenAI Batch API or plain lines); resumable",
                       description="Each result line (OpenAI batch output format, with its custom_id) is "
                                   "appended to OUT as its job finishes; a rerun skips custom_ids already in "
                                   "OUT (results and errors) and re-attaches to jobs a killed run left queued. "
                                   "The summary counts every line of OUT, earlier runs' too. Exit status 1 if "
                                   "any line of OUT is an error (or Redis cannot be reached; OUT is then not "
                                   "touched), 2 on a usage error.")
    b.add_argument("input", metavar="IN.jsonl")
    b.add_argument("output", metavar="OUT.jsonl")
    b.add_argument("--max-in-flight", type=int, default=64, help="most jobs queued or running at once")
    b.add_argument("--redis-url", default=None)
    b.add_argument("--max-tokens", type=int, default=None, help="default for lines that do not set it")
    b.add_argument("--temperature", type=float, default=None)
    b.add_argument("--top-p", type=float, default=None)
    b.add_argument("--seed", type=int, default=None)
    b.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    b.add_argument("--priority", choices=("high", "default", "low"), default=None)
    b.add_argument("--job-timeout", type=float, default=None, help="timeout_s of each job")
    b.add_argument("--retry-failed", action="store_true",
                   help="rerun the input lines whose line in OUT is an error, replacing it (OUT keeps one "
                        "line per custom_id)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    b.set_defaults(func=cmd_bulk)

    d = sub.add_parser("demo", help="start Redis (if needed) and a worker, run a few prompts")
    d.add_argument("--model", default=None)
    d.add_argument("--redis-url", default=None)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--timeout", type=float, default=600.0)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:  # the client never imports the worker: it runs in its place
        os.execv(sys.executable, [sys.executable, "-m", "kiviq.worker", *argv[1:]])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
