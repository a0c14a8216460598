"""The ``kiviq`` command: worker, serve, generate, cancel, top, bulk, demo.

Errors print one line, ``kiviq: error: ...``, and exit 2 for a usage error
(a bad flag value, a malformed URL), 1 for a runtime failure (Redis down, a
job that failed); ``--debug`` or ``KIVIQ_DEBUG=1`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from urllib.parse import urlsplit

from redis.exceptions import AuthenticationError, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kiviq.client.client import Client
from kiviq.client.errors import QueueFull
from kiviq.client.local_redis import ensure_redis, start_redis
from kiviq.client.streaming import JobFailed
from kiviq.jobs.cli_help import HelpFormatter
from kiviq.jobs.keys import queue_name
from kiviq.jobs.models import GenerateRequest
from kiviq.jobs.settings import DEFAULT_REDIS_URL, redact_url, redis_url_from_env
from kiviq.jobs.validation import InvalidRequest

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "Explain in one sentence what a GPU is.",
]
REDIS_URL_SCHEMES = ("redis", "rediss", "unix")
# request fields that `generate` sets from a flag of another name
FIELD_FLAGS = {"top_logprobs": "--logprobs", "logprobs": "--logprobs", "prompt": "PROMPT", "messages": "PROMPT"}


class UsageError(Exception):
    """A bad command line: exit status 2."""


def _redis_url(args: argparse.Namespace) -> str:
    """The Redis URL the command uses; a malformed one is a usage error."""
    url = redis_url_from_env(args.redis_url)
    if urlsplit(url).scheme not in REDIS_URL_SCHEMES:
        source = "--redis-url" if args.redis_url else "$REDIS_URL"
        raise UsageError(f"{source} {url!r}: the URL must start with redis://, rediss:// or unix:// "
                         f"(e.g. redis://{url if '://' not in url else 'localhost:6379'}/0)")
    return url


def _request_error(e: InvalidRequest) -> str:
    """InvalidRequest's message with each field named by its flag."""
    message = str(e).removeprefix("invalid generation request: ")
    parts = []
    for part in message.split("; "):
        field, sep, problem = part.partition(": ")
        root = field.split(".")[0]
        if sep and root in GenerateRequest.model_fields:
            field = FIELD_FLAGS.get(root, "--" + root.replace("_", "-"))
        parts.append(f"{field}{sep}{problem}")
    return "invalid request: " + "; ".join(parts)


def cmd_generate(args: argparse.Namespace) -> int:
    client = Client(args.redis_url)
    fields = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, stop=args.stop or [], priority=args.priority)
    if args.logprobs is not None:
        fields.update(logprobs=True, top_logprobs=args.logprobs)
    if args.raw:
        fields["prompt"] = args.prompt
    else:
        fields["messages"] = [{"role": "user", "content": args.prompt}]
    try:
        handle = client.submit(**fields)
    except InvalidRequest as e:
        raise UsageError(_request_error(e)) from e
    try:  # from here on Ctrl-C cancels the job
        queue = queue_name(args.priority)
        print(f"kiviq: job {handle.job_id} queued on {queue}", file=sys.stderr, flush=True)
        if not _serving_workers(client, queue):
            print(f"kiviq: warning: no worker serves {queue} yet; the job waits until one starts "
                  f"(kiviq worker), up to --timeout {args.timeout:g} s", file=sys.stderr, flush=True)
        for delta in handle.stream(timeout=args.timeout):
            print(delta, end="", flush=True)
        print()
        if args.logprobs is not None:
            for t in handle.result(timeout=args.timeout).logprobs or []:
                alternatives = "  ".join(f"{a.token!r} {a.logprob:.3f}" for a in t.top_logprobs)
                print(f"{t.token!r:>16} {t.logprob:8.3f}" + (f"   | {alternatives}" if alternatives else ""))
    except KeyboardInterrupt:
        print(file=sys.stdout, flush=True)
        if args.detach:
            print(f"kiviq: job {handle.job_id} left to run (--detach); kiviq cancel {handle.job_id} stops it",
                  file=sys.stderr, flush=True)
        elif client.cancel(handle.job_id):
            print(f"kiviq: cancelled job {handle.job_id} (--detach leaves it running)", file=sys.stderr, flush=True)
        else:
            print(f"kiviq: job {handle.job_id} had already ended", file=sys.stderr, flush=True)
        return 130
    except TimeoutError as e:
        raise RuntimeError(f"no result within --timeout {args.timeout:g} s; job {handle.job_id} is "
                           f"{handle.status()} (kiviq cancel {handle.job_id} stops it)") from e
    return 0


def _serving_workers(client: Client, queue: str) -> list:
    """The rq workers registered for ``queue``."""
    from rq import Worker

    return [w for w in Worker.all(connection=client.redis) if queue in w.queue_names()]


def cmd_cancel(args: argparse.Namespace) -> int:
    if Client(args.redis_url).cancel(args.job_id):
        print(f"cancelled {args.job_id}")
        return 0
    print(f"kiviq: error: {args.job_id}: no such job, or it already ended", file=sys.stderr)
    return 1


def cmd_top(args: argparse.Namespace) -> int:
    from kiviq.client.top import run_top

    if args.json and not args.once:
        raise UsageError("--json needs --once (the live view is not JSON): kiviq top --once --json")
    return run_top(args.redis_url, interval=args.interval, once=args.once, as_json=args.json)


def cmd_bulk(args: argparse.Namespace) -> int:
    import json

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
    print(json.dumps(summary.as_dict()), flush=True)
    return 0 if summary.failed == 0 else 1


def cmd_demo(args: argparse.Namespace) -> int:
    # A Redis the user names (--redis-url, $REDIS_URL); else one of the demo's own: a
    # server that merely answers on the default port may hold someone's data.
    if args.redis_url_named:
        url, stop_redis, kind = ensure_redis(args.redis_url)
    else:
        url, stop_redis, kind = start_redis()
    print(f"[kiviq] Redis: {kind}", flush=True)
    worker_cmd = [sys.executable, "-m", "kiviq.worker", "--redis-url", url, "--log-level", "WARNING"]
    if args.model:
        worker_cmd += ["--model", args.model]
    worker = subprocess.Popen(worker_cmd)
    try:
        client = Client(url)
        print(f"[kiviq] worker starting (model: {args.model or 'SmolLM2-135M-Instruct'})", flush=True)
        _wait_for_worker(client, worker, args.timeout)
        print(f"[kiviq] enqueueing {len(DEMO_PROMPTS)} prompts", flush=True)
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


def _wait_for_worker(client: Client, worker: subprocess.Popen, timeout: float) -> None:
    """Until the demo's worker registers (its model is loaded); a worker that
    exits first (its error is on stderr, above) ends the demo."""
    import time

    from rq import Worker

    deadline = time.monotonic() + timeout
    while not Worker.all(connection=client.redis):
        if worker.poll() is not None:
            raise RuntimeError(f"the demo's worker exited with status {worker.returncode} (its error is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the demo's worker did not start within --timeout {timeout:g} s")
        time.sleep(0.2)


REDIS_URL_HELP = "Redis to use (default: $REDIS_URL or " + DEFAULT_REDIS_URL + ")"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kiviq", description="Batch LLM generation over Redis, on MLX.",
                                formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", default=os.environ.get("KIVIQ_DEBUG") == "1",
                   help="on an error, print the traceback too (default: off, on with KIVIQ_DEBUG=1)")
    # Also after the subcommand; SUPPRESS keeps the top-level value when it is not given there.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print the traceback too (default: off, on with KIVIQ_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], formatter_class=HelpFormatter, **kw)

    # Listed for --help only: main() hands `kiviq worker ...` to `python -m kiviq.worker`.
    sub.add_parser("worker", help="serve jobs from Redis with a model (kiviq worker --help)", add_help=False)
    # Likewise `kiviq serve ...` runs `python -m kiviq.gateway` (the client never imports the gateway).
    sub.add_parser("serve", help="OpenAI-compatible HTTP API over the queue (kiviq serve --help; "
                   "pip install 'kiviq[http]')", add_help=False)

    g = add("generate", help="submit one prompt and stream the answer",
            description="Submit one prompt and stream the answer to stdout; the job id goes to stderr. "
                        "Ctrl-C cancels the job unless --detach.")
    g.add_argument("prompt", help="the user message (with --raw: the completion prompt)")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                   "whose probabilities sum to P (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: none, a random one)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string, not included in the answer (repeatable; default: none)")
    g.add_argument("--priority", choices=("high", "default", "low"), default="default", help="queue to submit to")
    g.add_argument("--raw", action="store_true", help="send as a raw completion prompt (no chat template)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="after the text, print each token's logprob and its N most likely alternatives "
                        "(0..20; default: none)")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    g.add_argument("--detach", action="store_true", help="on Ctrl-C, leave the job running (default: off, "
                   "Ctrl-C cancels it)")
    g.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    g.set_defaults(func=cmd_generate)

    c = add("cancel", help="cancel a queued or running job")
    c.add_argument("job_id", help="the id `kiviq generate` printed, or JobHandle.job_id")
    c.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    c.set_defaults(func=cmd_cancel)

    t = add("top", help="live view of queues, workers and throughput")
    t.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    t.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    t.add_argument("--once", action="store_true", help="print one frame (no ANSI codes) and exit")
    t.add_argument("--json", action="store_true", help="with --once: print the numbers as JSON")
    t.set_defaults(func=cmd_top)

    b = add("bulk", help="run a JSONL file of requests (OpenAI Batch API or plain lines); resumable",
            description="Each result line (OpenAI batch output format, with its custom_id) is "
                        "appended to OUT as its job finishes; a rerun skips custom_ids already in "
                        "OUT (results and errors) and re-attaches to jobs a killed run left queued. "
                        "The summary counts every line of OUT, earlier runs' too. Exit status 1 if "
                        "any line of OUT is an error (or Redis cannot be reached; OUT is then not "
                        "touched), 2 on a usage error.")
    b.add_argument("input", metavar="IN.jsonl")
    b.add_argument("output", metavar="OUT.jsonl")
    b.add_argument("--max-in-flight", type=int, default=64, help="most jobs queued or running at once")
    b.add_argument("--redis-url", default=None, help=REDIS_URL_HELP)
    b.add_argument("--max-tokens", type=int, default=None, help="tokens, for lines that do not set it (default: 256)")
    b.add_argument("--temperature", type=float, default=None, help="for lines that do not set it (default: 0)")
    b.add_argument("--top-p", type=float, default=None, help="for lines that do not set it (default: 1, off)")
    b.add_argument("--seed", type=int, default=None, help="for lines that do not set it (default: none, random)")
    b.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    b.add_argument("--priority", choices=("high", "default", "low"), default=None,
                   help="queue, for lines that do not set it (default: default)")
    b.add_argument("--job-timeout", type=float, default=None, help="seconds each job may run (default: none)")
    b.add_argument("--retry-failed", action="store_true",
                   help="rerun the input lines whose line in OUT is an error, replacing it (OUT keeps one "
                        "line per custom_id)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on stderr (default: when stderr is a terminal)")
    b.set_defaults(func=cmd_bulk)

    d = add("demo", help="start Redis (if needed) and a worker, run a few prompts")
    d.add_argument("--model", default=None,
                   help="model the worker loads: local dir, GGUF file or HF repo id (default: SmolLM2-135M-Instruct)")
    d.add_argument("--redis-url", default=None, help="Redis to use (default: $REDIS_URL; when none is "
                   "named or none answers there, one of the demo's own on a free port)")
    d.add_argument("--max-tokens", type=int, default=64, help="most tokens per answer")
    d.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for each answer")
    d.set_defaults(func=cmd_demo)
    return p


def describe_error(e: BaseException, args: argparse.Namespace) -> tuple[str, int]:
    """The one-line message and exit status of an error a command raised."""
    url = redact_url(getattr(args, "redis_url", None) or "")
    if isinstance(e, UsageError):
        return str(e), 2
    if isinstance(e, InvalidRequest):  # from a file (bulk) or the Python API: the message names the field
        return str(e), 2
    if isinstance(e, AuthenticationError):
        return f"Redis at {url} refused the credentials: {e}; put the right ones in --redis-url", 1
    if isinstance(e, (RedisConnectionError, RedisTimeoutError)):
        return f"cannot reach Redis at {url}: {str(e).rstrip('.')}; start one or pass --redis-url", 1
    if isinstance(e, RedisError):
        return f"Redis at {url}: {type(e).__name__}: {e}", 1
    if isinstance(e, QueueFull):
        return f"{e} (the operator's kiviq worker --max-queued limit)", 1
    if isinstance(e, (JobFailed, RuntimeError)):
        return str(e), 1
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror}", 1
    return f"{type(e).__name__}: {e} (kiviq --debug shows the traceback)", 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The client never imports the worker: `kiviq [--debug] worker ...` runs it in this process's place.
    if argv[:1] == ["worker"] or argv[:2] == ["--debug", "worker"]:
        rest = argv[1:] if argv[0] == "worker" else [*argv[2:], "--debug"]
        os.execv(sys.executable, [sys.executable, "-m", "kiviq.worker", *rest])
    if argv[:1] == ["serve"] or argv[:2] == ["--debug", "serve"]:
        rest = argv[1:] if argv[0] == "serve" else [*argv[2:], "--debug"]
        os.execv(sys.executable, [sys.executable, "-m", "kiviq.gateway", *rest])
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "redis_url"):
            args.redis_url_named = bool(args.redis_url or os.environ.get("REDIS_URL"))  # the demo asks
            args.redis_url = _redis_url(args)
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - every error ends as one line (the traceback with --debug)
        message, status = describe_error(e, args)
        if args.debug:
            traceback.print_exc()
        print(f"kiviq: error: {message}", file=sys.stderr, flush=True)
        return status


if __name__ == "__main__":
    sys.exit(main())
