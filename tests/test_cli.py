"""The command line as a user meets it: every error is one line ``kiviq: error:
...`` with exit status 2 (usage) or 1 (runtime), and the traceback only under
--debug; `generate` says its job id, warns when no worker serves the queue and
cancels its job on Ctrl-C; every option's help says its default.

No test here starts a worker: the worker's start-up errors come before the
model loads, and a queued job can be cancelled with no worker at all."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rq import Queue, Worker
from rq.job import Job
from rq.serializers import JSONSerializer

from kiviq.client.cli import build_parser, main
from kiviq.client.local_redis import free_port
from kiviq.jobs.keys import queue_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def dead_url() -> str:
    """A Redis URL nothing listens on (never the user's :6379)."""
    return f"redis://127.0.0.1:{free_port()}/0"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_error_line(err: str, prog: str = "kiviq") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def run_process(*argv: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(ROOT))
    full.pop("KIVIQ_DEBUG", None)
    full.update(env or {})
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(autouse=True)
def no_debug_env(monkeypatch):
    monkeypatch.delenv("KIVIQ_DEBUG", raising=False)


# --- one test per error class ---------------------------------------------


@pytest.mark.parametrize("flags, flag", [
    (["--max-tokens", "-5"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--logprobs", "50"], "--logprobs"),
    (["--top-p", "0"], "--top-p"),
    (["--stop", ""], "--stop"),
])
def test_invalid_request_is_a_usage_error_naming_the_flag(capsys, dead_url, flags, flag):
    status, _, err = run_cli(capsys, "generate", "hi", *flags, "--redis-url", dead_url)
    line = assert_one_error_line(err)
    assert status == 2 and f"{flag}:" in line


@pytest.mark.parametrize("argv", [["generate", "hi"], ["cancel", "some-job"], ["top", "--once"], ["bulk"]])
def test_unreachable_redis_is_a_runtime_error(capsys, dead_url, tmp_path, argv):
    if argv == ["bulk"]:
        src = tmp_path / "in.jsonl"
        src.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n")
        argv = ["bulk", str(src), str(tmp_path / "out.jsonl")]
    status, _, err = run_cli(capsys, *argv, "--redis-url", dead_url)
    line = assert_one_error_line(err)
    assert status == 1
    assert f"cannot reach Redis at {dead_url}" in line and "start one or pass --redis-url" in line


def test_malformed_redis_url_is_a_usage_error(capsys, monkeypatch):
    status, _, err = run_cli(capsys, "generate", "hi", "--redis-url", "localhost:6379")
    line = assert_one_error_line(err)
    assert status == 2 and "--redis-url 'localhost:6379'" in line
    assert "must start with redis://, rediss:// or unix://" in line and "redis://localhost:6379/0" in line
    monkeypatch.setenv("REDIS_URL", "localhost:6379")  # the same check for the environment's URL
    status, _, err = run_cli(capsys, "top", "--once")
    assert status == 2 and "$REDIS_URL 'localhost:6379'" in assert_one_error_line(err)


def test_top_json_without_once_is_a_usage_error(capsys, dead_url):
    status, out, err = run_cli(capsys, "top", "--json", "--redis-url", dead_url)
    assert status == 2 and "--json needs --once" in assert_one_error_line(err) and out == ""


def test_cancel_of_an_unknown_job_is_one_line(capsys, redis_url):
    status, _, err = run_cli(capsys, "cancel", "no-such-job", "--redis-url", redis_url)
    assert status == 1 and "no-such-job: no such job" in assert_one_error_line(err)


@pytest.mark.parametrize("how", ["--debug first", "--debug last", "KIVIQ_DEBUG=1"])
@pytest.mark.parametrize("argv, status", [
    (["generate", "hi", "--max-tokens", "-5"], 2),
    (["generate", "hi"], 1),  # unreachable Redis
    (["top", "--json"], 2),
])
def test_debug_shows_the_traceback(capsys, monkeypatch, dead_url, how, argv, status):
    argv = [*argv, "--redis-url", dead_url]
    if how == "--debug first":
        argv = ["--debug", *argv]
    elif how == "--debug last":
        argv = [*argv, "--debug"]
    else:
        monkeypatch.setenv("KIVIQ_DEBUG", "1")
    got, _, err = run_cli(capsys, *argv)
    assert got == status
    assert err.startswith("Traceback (most recent call last):")
    assert err.strip().splitlines()[-1].startswith("kiviq: error: ")  # the same line ends it


# --- the worker's own command line (subprocesses: it loads mlx) -------------------


def test_worker_bad_config_flag_is_a_usage_error(dead_url):
    argv = ["-m", "kiviq.client.cli", "worker", "--kv-residual", "100", "--redis-url", dead_url]
    proc = run_process(*argv)
    line = assert_one_error_line(proc.stderr, "kiviq worker")
    assert proc.returncode == 2 and "kv_residual (100)" in line and "--kv-residual" in line
    debug = run_process("-m", "kiviq.client.cli", "--debug", *argv[2:])  # kiviq --debug worker ...
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


def test_worker_missing_model_is_a_usage_error(redis_url):
    argv = ["-m", "kiviq.worker", "--model", "/nonexistent", "--redis-url", redis_url, "--log-level", "WARNING"]
    proc = run_process(*argv)
    line = assert_one_error_line(proc.stderr, "kiviq worker")
    assert proc.returncode == 2 and "--model" in line and "/nonexistent" in line
    debug = run_process(*argv, "--debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == line


def test_worker_unreachable_redis_is_a_runtime_error(dead_url):
    proc = run_process("-m", "kiviq.worker", "--redis-url", dead_url)
    line = assert_one_error_line(proc.stderr, "kiviq worker")
    assert proc.returncode == 1 and f"cannot reach Redis at {dead_url}" in line


def test_worker_malformed_redis_url_is_a_usage_error():
    proc = run_process("-m", "kiviq.worker", "--redis-url", "localhost:6379")
    line = assert_one_error_line(proc.stderr, "kiviq worker")
    assert proc.returncode == 2 and "must start with redis://" in line


# --- generate ---------------------------------------------------------------------


def _queued_job(redis_conn, priority: str) -> Job:
    ids = Queue(queue_name(priority), connection=redis_conn, serializer=JSONSerializer).job_ids
    assert len(ids) == 1
    return Job.fetch(ids[0], connection=redis_conn, serializer=JSONSerializer)


def test_generate_flags_reach_the_request(capsys, redis_url, redis_conn):
    status, _, err = run_cli(capsys, "generate", "hi", "--seed", "7", "--top-p", "0.9", "--top-k", "40",
                             "--stop", "END", "--stop", "\n\n", "--priority", "high", "--max-tokens", "9",
                             "--timeout", "0.5", "--redis-url", redis_url)
    job = _queued_job(redis_conn, "high")
    request = job.args[0]
    assert (request["seed"], request["top_p"], request["top_k"], request["stop"], request["priority"],
            request["max_tokens"]) == (7, 0.9, 40, ["END", "\n\n"], "high", 9)
    lines = err.strip().splitlines()
    assert lines[0] == f"kiviq: job {job.id} queued on {queue_name('high')}"
    assert "no worker serves" in lines[1] and "waits" in lines[1]
    assert status == 1 and lines[2].startswith("kiviq: error: no result within --timeout 0.5 s")
    assert f"job {job.id} is queued" in lines[2] and len(lines) == 3


def test_generate_warns_only_when_no_worker_serves_its_queue(capsys, redis_url, redis_conn):
    worker = Worker([Queue(queue_name("low"), connection=redis_conn)], connection=redis_conn, name="low-only")
    worker.register_birth()  # registered, serving kiviq-low only
    try:
        _, _, err = run_cli(capsys, "generate", "hi", "--timeout", "0.1", "--redis-url", redis_url)
        assert "no worker serves kiviq-default" in err
        _, _, err = run_cli(capsys, "generate", "hi", "--priority", "low", "--timeout", "0.1",
                            "--redis-url", redis_url)
        assert "no worker serves" not in err
    finally:
        worker.register_death()


@pytest.mark.parametrize("detach", [False, True])
def test_ctrl_c_cancels_the_job_unless_detach(redis_url, redis_conn, detach):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # SIGINT back to its default in the child: a test run started in the background by a
    # non-interactive shell inherits it ignored, and Python then never raises KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, "-m", "kiviq.client.cli", "generate", "hi", "--redis-url", redis_url,
                             *(["--detach"] if detach else [])],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stderr.readline()
        assert first.startswith("kiviq: job "), first + proc.stderr.read()
        job_id = first.split()[2]
        warning = proc.stderr.readline()
        assert "no worker serves kiviq-default" in warning and "the job waits" in warning
        time.sleep(0.3)  # streaming: inside the try that handles Ctrl-C
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    status = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer).get_status(refresh=True).value
    if detach:
        assert status == "queued" and f"kiviq cancel {job_id}" in rest
    else:
        assert status == "canceled" and f"cancelled job {job_id}" in rest
    assert "Traceback" not in rest


# --- kiviq serve (the HTTP gateway; subprocesses, as `kiviq serve` execs it) ---------


@pytest.mark.parametrize("flags, words", [
    (["--port", "http"], "--port"), (["--frobnicate"], "--frobnicate"), (["--port", "0"], "--port 0"),
    (["--redis-url", "localhost:6379"], "must start with redis://"), (["--api-key", ""], "--api-key"),
])
def test_serve_bad_flag_is_one_line(flags, words):
    proc = run_process("-m", "kiviq.client.cli", "serve", *flags)
    line = assert_one_error_line(proc.stderr, "kiviq serve")
    assert proc.returncode == 2 and words in line


def test_serve_help_and_redacted_url_in_errors():
    proc = run_process("-m", "kiviq.client.cli", "serve", "--help")
    assert proc.returncode == 0 and "--api-key" in proc.stdout and "kiviq[http]" in proc.stdout
    proc = run_process("-m", "kiviq.client.cli", "serve", "--redis-url", "http://u:s3cret@host/0")
    assert proc.returncode == 2 and "s3cret" not in proc.stderr
    assert "serve" in run_process("-m", "kiviq.client.cli", "--help").stdout


# --- help ---------------------------------------------------------------------------


def _parsers() -> list[argparse.ArgumentParser]:
    from kiviq.gateway.cli import build_parser as serve_parser
    from kiviq.worker.cli import build_parser as worker_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return [top, worker_parser(), serve_parser(),
            *(p for name, p in sub.choices.items() if name not in ("worker", "serve"))]


def test_every_option_says_its_default():
    missing = []
    for parser in _parsers():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS and action.dest != "help":
                text = formatter._expand_help(action)
                if "default" not in text or "None" in text:
                    missing.append(f"{parser.prog} {action.option_strings[0]}: {text!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("prog, option, unit", [
    ("kiviq generate", "--timeout", "seconds"), ("kiviq generate", "--max-tokens", "tokens"),
    ("kiviq top", "--interval", "seconds"), ("kiviq bulk", "--job-timeout", "seconds"),
    ("kiviq demo", "--timeout", "seconds"), ("kiviq demo", "--max-tokens", "tokens"),
    ("kiviq worker", "--grace", "seconds"), ("kiviq worker", "--kv-memory", "bytes"),
    ("kiviq worker", "--memory-limit", "bytes"),    ("kiviq worker", "--kv-residual", "tokens"), ("kiviq worker", "--max-batch-tokens", "tokens"),
    ("kiviq serve", "--request-timeout", "seconds"),
])
def test_options_with_a_unit_say_it(prog, option, unit):
    parser = next(p for p in _parsers() if p.prog == prog)
    action = next(a for a in parser._actions if option in a.option_strings)
    assert unit in parser._get_formatter()._expand_help(action)


def test_demo_stops_when_its_worker_cannot_start(redis_url):
    proc = run_process("-m", "kiviq.client.cli", "demo", "--model", "/nonexistent", "--redis-url", redis_url)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("kiviq worker: error: --model") and len(lines) == 2
    assert lines[1] == "kiviq: error: the demo's worker exited with status 2 (its error is above)"


CRASH_WHILE_SERVING = """
import sys
import kiviq.worker.main as worker_main
def crash(*args, **kwargs):
    raise KeyError("boom")
worker_main.run_worker = crash
from kiviq.worker.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_worker_crash_keeps_its_traceback(dead_url):
    """Not a user error: a crash while serving may not happen again, so its
    traceback is printed even without --debug (the one line still ends it)."""
    proc = run_process("-c", CRASH_WHILE_SERVING, "--redis-url", dead_url,
                       env={"KIVIQ_OPENBLAS": "0"})  # no re-exec: the patch stays
    assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "kiviq worker: error: KeyError: 'boom'"


OUT_OF_MEMORY_AT_START = """
import sys
from types import SimpleNamespace
import kiviq.engine
import kiviq.engine.warmup
from kiviq.engine.config import EngineConfig
OOM = RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")
MODEL = SimpleNamespace(args=SimpleNamespace(vocab_size=100), parameters=dict, named_modules=list)
kiviq.engine.load = lambda *a, **k: (MODEL, object())
def build_engine(lm, tokenizer, config):
    if sys.argv[1] == "store":
        raise OOM
    return SimpleNamespace(config=EngineConfig(max_batch_tokens=16384),
                           kv_store=SimpleNamespace(budget_bytes=lambda: 10 << 30))
def warm_up(engine, vocab):
    raise RuntimeError(f"warm-up request failed: RuntimeError: {OOM}")
kiviq.engine.build_engine = build_engine
kiviq.engine.warmup.warm_up = warm_up
from kiviq.worker.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("where, says", [
    ("store", "out of device memory setting up the engine (its KV store: --kv-memory 3.0 GiB): "),
    ("warm-up", "out of device memory in the warm-up (steps of up to 16384 tokens, --max-batch-tokens; "
                "a KV store of 10.0 GiB): "),
])
def test_out_of_device_memory_at_start_says_what_to_do(redis_url, where, says):
    proc = run_process("-c", OUT_OF_MEMORY_AT_START, where, "--redis-url", redis_url, "--kv-memory", "3GiB",
                       "--warm-up", env={"KIVIQ_OPENBLAS": "0"}, timeout=60)  # no re-exec: the patches stay
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("kiviq worker: error: " + says + "another process may be holding this GPU's memory "
                    "(free it), or lower --kv-memory or --max-batch-tokens")


def test_demo_starts_its_own_redis_unless_one_is_named(monkeypatch, capsys):
    """Without --redis-url or $REDIS_URL the demo never uses a server that merely
    answers on the default port (someone's data may live there)."""
    import kiviq.client.cli as cli

    calls = []

    def fake(name):
        def record(*a):
            calls.append((name, *a))
            raise RuntimeError("stopped here")
        return record

    monkeypatch.setattr(cli, "start_redis", fake("start"))
    monkeypatch.setattr(cli, "ensure_redis", fake("ensure"))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert main(["demo"]) == 1
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    assert main(["demo"]) == 1
    assert main(["demo", "--redis-url", "redis://127.0.0.1:2/0"]) == 1
    assert calls == [("start",), ("ensure", "redis://127.0.0.1:1/0"), ("ensure", "redis://127.0.0.1:2/0")]
    assert capsys.readouterr().err.count("kiviq: error: stopped here") == 3
