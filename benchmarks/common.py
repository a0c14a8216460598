"""Small helpers shared by the benchmarks: the machine line, markdown tables, and
code trees run in fresh processes."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def probe_work() -> int:
    """A fixed pure-Python loop (dict stores, integer arithmetic): ~20-40 ms of
    plain host code with nothing of MLX or the GPU in it."""
    acc, d = 0, {}
    for i in range(200_000):
        d[i & 1023] = acc = (acc * 31 + i) & 0xFFFF
    return acc


def current_cpu() -> int | None:
    """The CPU this thread last ran on (field 39 of /proc/<pid>/task/<tid>/stat)."""
    try:
        return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def host_probe(repeats: int = 7) -> dict:
    """How fast this process's main thread runs plain host code right now: the
    best of ``repeats`` runs of ``probe_work``, and the CPU the thread is on. A
    host's speed can move 2x within a second (benchmarks/host_speed.py), so a
    benchmark that compares runs reports this beside its times."""
    best = min(_timed(probe_work) for _ in range(repeats))
    return {"host_probe_ms": best * 1e3, "host_cpu": current_cpu()}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def machine() -> str:
    """One line describing where a benchmark ran (CPU model and count, MLX
    backend, BLAS). The CPU model matters on a GPU too: kiviq's decode steps are
    host-bound, so the same GPU kind on different hosts gives different results."""
    import mlx.core as mx

    device = mx.default_device()
    blas = "OpenBLAS preloaded" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX's bundled BLAS"
    return (f"{platform.machine()} {os.cpu_count()}-core{_cpu_model()}{_smt()}, {platform.system()}, "
            f"mlx {mx.__version__} ({device} backend), {blas}, Python {platform.python_version()}")


def _smt() -> str:
    """' N threads per core' where sysfs says the CPUs are SMT threads, else ''."""
    cpus = range(os.cpu_count() or 1)
    per_core = len(cpus) / max(1, len(physical_cores(cpus)))
    return f", {per_core:g} threads per core" if per_core > 1 else ""


def physical_cores(cpus, core_of=None) -> list[list[int]]:
    """``cpus`` grouped by physical core (``core_of``: a CPU's core, by default
    `physical_core`), each group sorted, the groups by their lowest CPU."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault((core_of or physical_core)(cpu), []).append(cpu)
    return sorted(cores.values())


def physical_core(cpu: int) -> str:
    """The CPUs that share ``cpu``'s physical core, as sysfs lists them ("0,8" or
    "0-1"); the CPU alone where sysfs does not say."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return path.read_text().strip()
    except OSError:
        return str(cpu)


def _cpu_model() -> str:
    """' (model name)' from /proc/cpuinfo, or '' where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f" ({line.split(':', 1)[1].strip()})"
    except OSError:
        pass
    return ""


def command() -> str:
    """The command line that is running, as it could be typed again."""
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories that are device work
API_EVENTS = ("cuda_runtime", "cuda_driver")  # the host's CUDA calls (graph building, launches, syncs)


@contextlib.contextmanager
def device_trace(categories: tuple[str, ...] = DEVICE_EVENTS):
    """Record the device ops run inside the block (CUDA, needs PyTorch): CUPTI, through
    torch.profiler, sees every kernel of the process, MLX's included. The yielded list
    is filled on exit with the ops' trace events (``name``, ``ts`` and ``dur`` in us):
    device time itself, whatever the host spent launching them. With API_EVENTS among
    ``categories``, the host's CUDA runtime and driver calls come too (``cat`` tells
    them apart)."""
    import torch.profiler

    events: list[dict] = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with profiler:
        yield events
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    events.extend(e for e in trace.get("traceEvents", []) if e.get("cat") in categories and "dur" in e)


def interleaved_device_us(arms: dict, operands: list[tuple], repeats: int,
                          calls: int) -> dict[str, tuple[list[float], float]]:
    """Per arm (name -> function of one operand tuple): its device us per call, one
    figure per block of ``calls`` evaluated calls, and the device ops per call. Each
    arm is warmed first (compiles and first launches outside the trace); the blocks
    are interleaved, the first arm rotating, and the operands rotate across calls."""
    import mlx.core as mx

    names = list(arms)
    times: dict[str, list[float]] = {name: [] for name in names}
    ops: dict[str, float] = {}
    for name in names:
        mx.eval(arms[name](*operands[0]))
    k = 0
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            with device_trace() as events:
                for _ in range(calls):
                    mx.eval(arms[name](*operands[k % len(operands)]))
                    k += 1
            if not events:
                raise SystemExit("the device trace recorded nothing (CUPTI unavailable?)")
            times[name].append(sum(e["dur"] for e in events) / calls)
            ops[name] = len(events) / calls
    return {name: (times[name], ops[name]) for name in names}


def table(header: list[str], rows: list[list[object]]) -> str:
    """A markdown table (numbers already formatted by the caller)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def spread(values: list[float], fmt: str) -> str:
    """'min / median / max' of ``values``, each formatted with ``fmt``; '-' for none."""
    if not values:
        return "-"
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


def mib(n: int | float) -> str:
    return f"{n / 2**20:.1f} MiB"


def kv_budget(model, bits: int, tokens: list[int], flush_blocks: int = 1, slack_blocks: int = 0) -> int:
    """KV bytes kiviq's store (default G and R) needs for sequences of these
    token counts at this bit width: a tail slot each, and ceil(n / G) +
    ``slack_blocks`` blocks each (a pool sized to the run, not to the device)."""
    from kiviq.engine.kivi_cache import attention_shape, model_dtype
    from kiviq.engine.kv_store import KiviStore, KVConfig

    layers, kv_heads, head_dim = attention_shape(model)
    probe = KiviStore(layers, kv_heads, head_dim, config=KVConfig(bits, flush_blocks=flush_blocks), num_blocks=1,
                      num_slots=1, dtype=model_dtype(model))
    g = probe.config.group_size
    return sum(probe.blocks.slot_bytes + (-(-n // g) + slack_blocks) * probe.blocks.block_bytes for n in tokens)


def prefilled_engine(model, tokenizer, prompts: list[list[int]], gen: int, *, bits: int, rotate: bool = False,
                     kv_bytes: int | None = None, flush_blocks: int = 1, compile_decode: bool = False,
                     pipeline: bool = False, max_sequences: int | None = None):
    """kiviq's engine with every prompt added and prefilled (no decode step yet).

    Args:
        gen: decode steps the caller runs after the prefill, every sequence
            emitting in each. Sequences prefilled in an early step decode
            during the later prefill steps, so each request's max_tokens is
            gen plus the most prefill steps this batch can take.
        kv_bytes: KV budget; default: exactly the blocks and tails this run
            needs at this bit width, plus one block per sequence (a fixed budget
            that held only part of a large batch made the prefill loop preempt
            forever; a bf16-sized one held several engines' worth at 4 bits).
        compile_decode, pipeline: as in ``engine.build_engine`` (off here: a
            benchmark arm states what it runs).
        max_sequences: the store's tails (default: one per prompt).
        rotate: K and V Hadamard-rotated (``--kv-bits 2r`` with bits=2).

    Raises:
        SystemExit: the budget did not hold the batch (a preemption).
    """
    from kiviq.engine import Request, build_engine

    b, prompt_tokens = len(prompts), sum(map(len, prompts))
    budget = 1 << 16  # tokens per engine step
    gen += b + prompt_tokens // budget + 1
    slots = max_sequences or b
    if kv_bytes is None:
        room = max(gen, 64)  # admission asks for the engine's default 64-token reserve
        kv_bytes = kv_budget(model, bits, [len(p) + room for p in prompts] + [0] * (slots - b), flush_blocks,
                             slack_blocks=1)
    engine = build_engine(model, tokenizer, kv_bits=bits, kv_rotate=rotate, kv_flush_blocks=flush_blocks, max_sequences=slots,
                          kv_memory=kv_bytes, max_batch_tokens=budget, compile_decode=compile_decode,
                          pipeline=pipeline, flat_qmm=False)  # an arm that wants it flattens the model itself
    for i, p in enumerate(prompts):
        engine.add(Request(str(i), p, gen))
    while engine.stats["prefill_tokens"] < prompt_tokens:
        engine.step()
        if engine.stats["preemptions"]:
            raise SystemExit(f"the KV budget ({kv_bytes >> 20} MiB) does not hold B={b}")
    return engine


ROOT = Path(__file__).resolve().parents[1]


def arm_tree(spec: str, tmp: str) -> str:
    """A directory holding an arm's code: the working tree (``.``), a directory, or a
    git revision extracted into ``tmp``."""
    if spec == ".":
        return str(ROOT)
    if Path(spec).is_dir():
        return str(Path(spec).resolve())
    dest = Path(tmp) / spec.replace("/", "_")
    if not dest.exists():
        dest.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", spec], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return str(dest)


def named_trees(specs: list[str] | None, default: str = "this=.") -> list[list[str]]:
    """``--arm NAME=TREE`` arguments as [name, tree spec] pairs (default ``default``);
    a malformed one ends the program with one line."""
    arms = [a.split("=", 1) for a in (specs or [default])]
    if any(len(a) != 2 or not a[0] for a in arms):
        sys.exit(f"--arm: expected NAME=TREE, got {specs}")
    return arms


def run_in_trees(script: str, trees: list[str] | None, processes: int) -> dict[str, list[dict]]:
    """This command line without ``--processes`` and ``--tree``, run as
    ``benchmarks/<script>`` of each code tree (``NAME=.``, ``NAME=DIR`` or
    ``NAME=<git revision>``; default ``this=.``) in ``processes`` fresh processes
    per tree, the trees interleaved (A B A B ...). Each child writes what it
    measured to ``--summary-json PATH``; returns those summaries per tree name,
    in order."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a in ("--processes", "--tree"):
            skip = True
        elif not a.startswith(("--processes=", "--tree=")):
            argv.append(a)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        named = [t.split("=", 1) for t in (trees or ["this=."])]
        if any(len(t) != 2 or not t[0] for t in named):
            raise SystemExit(f"--tree: expected NAME=TREE, got {trees}")
        dirs = [(name, arm_tree(spec, tmp)) for name, spec in named]
        for i in range(processes):
            for name, tree in dirs:
                path = os.path.join(tmp, f"{name}-{i}.json")
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, *filter(None, [os.environ.get("PYTHONPATH")])]))
                subprocess.run([sys.executable, os.path.join(tree, "benchmarks", script), *argv, "--summary-json", path],
                               check=True, env=env, cwd=tree)
                with open(path) as f:
                    results.setdefault(name, []).append(json.load(f))
    return results


def module_at(rev: str, path: str):
    """The module at ``path`` (e.g. engine/sampler.py) as of git revision ``rev``,
    imported under a name of its own, beside this tree's. Raises
    subprocess.CalledProcessError when git cannot show it."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    name = os.path.splitext(os.path.basename(path))[0] + "_at_rev"
    file = os.path.join(tempfile.mkdtemp(), name + ".py")
    with open(file, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def revision_arms(this_module, rev: str | None, path: str) -> dict:
    """{"this tree": this_module} and, with ``rev``, that revision's module at ``path``
    (``module_at``); a revision git cannot show ends the program with one line."""
    modules = {"this tree": this_module}
    if rev:
        try:
            modules[rev] = module_at(rev, path)
        except subprocess.CalledProcessError as e:
            sys.exit(f"--rev {rev}: git show failed ({e.stderr.strip()}); give a revision of this repository")
    return modules
