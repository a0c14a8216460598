"""Concurrent long sequences per KV memory budget: kiviq's KIVI store vs
mlx-lm's fp16 ``KVCache``.

Question (issue #5): in the same memory budget, how many concurrent
``--context``-token sequences (default 16384) does each system hold?

No model weights are needed: the caches only need the attention shape
(default Qwen3-4B: 36 layers, 8 kv heads, head_dim 128, bf16 activations),
and the K/V written are random bf16 (bytes do not depend on values). Both
sides really allocate and fill their memory (MLX arrays, evaluated):

* kiviq: the store is built exactly as the worker builds it for
  ``--kv-memory BUDGET --max-active N``: ``engine.kivi_cache.make_store`` with
  ``max_sequences=N`` and the model's context length (``engine.setup``), i.e.
  N fp16 tails are preallocated and the rest of the budget becomes quantized
  blocks. Sequences with a ``--context``-token prompt are then offered to the
  engine's own ``Scheduler`` (``reserve_tokens`` = the engine's default 64, over
  the store's block manager, ``store.blocks``); every admitted sequence gets
  a slot (``store.blocks.allocate``) and its prefill chunks, as the scheduler plans
  them (``max_batch_tokens`` tokens per step), are written with
  ``KiviStore.append`` into ``--fill-layers`` layers (default all), which
  allocates its blocks through the store's allocator. When every admitted
  sequence is prefilled and running, the scheduler refuses the next one; the
  count is the number running. Slots: "fit" picks the smallest N that
  maximizes the count (tails are preallocated per slot, so too many slots cost
  blocks); 32 is the worker's default ``--max-active``.
* fp16: per sequence, one mlx-lm ``KVCache`` per layer (what ``stream_generate``
  and ``BatchGenerator`` use for each prompt), filled to ``--context`` tokens in
  every layer by ``update_and_fetch`` of bf16 chunks of ``--fp16-chunk`` tokens
  (mlx-lm's ``prefill_step_size``, 2048). Sequences are added while the next
  one still fits the budget by the caches' ``nbytes``; ``KVCache`` grows in
  steps of 256 tokens, so a 16384-token sequence holds exactly 16384.

Active memory (``mx.get_active_memory()`` minus what was active before) and the
peak are reported for each, so the count is backed by what was allocated.

A counts-only projection to other budgets follows: the same make_store sizing
arithmetic (from the measured block and slot bytes) and the same Scheduler
against a counts-only allocator, with nothing allocated; at the budgets that
were run it is asserted equal to the measured counts.

Every system's run allocates up to the whole budget, one after another (fp16,
then each kiviq store), so before each the budget plus ``--headroom-gib`` must
be available, else the rest of that budget is skipped.

Run (2-core CPU, about 25 minutes with every layer filled):
    PYTHONPATH=. python benchmarks/concurrency.py --budget-gib 4 8
"""

from __future__ import annotations

import argparse
import gc
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

# The repository root first: run as a script, this file's folder would come first
# and benchmarks/engine.py would shadow the engine package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from benchmarks.common import command, machine, table  # noqa: E402
from kiviq.engine.batch_engine import Engine  # noqa: E402
from kiviq.engine.block_manager import blocks_for_budget  # noqa: E402
from kiviq.engine.kivi_cache import KiviLayerCache, make_store  # noqa: E402
from kiviq.engine.kv_store import KiviStore, KVConfig  # noqa: E402
from kiviq.engine.request import Request  # noqa: E402
from kiviq.engine.scheduler import Scheduler  # noqa: E402
from kiviq.engine.sequence import Sequence  # noqa: E402
from kiviq.engine.setup import GPU_BATCH_TOKENS, GPU_SEQUENCES, context_length  # noqa: E402

GIB = 1 << 30
# The engine's defaults (the worker passes neither): admission reserve, tokens per step.
_ENGINE_DEFAULTS = inspect.signature(Engine.__init__).parameters
RESERVE_TOKENS = _ENGINE_DEFAULTS["reserve_tokens"].default
MAX_BATCH_TOKENS = GPU_BATCH_TOKENS[1]  # the default on a large GPU (engine.setup.default_batch_tokens)
WORKER_MAX_ACTIVE = GPU_SEQUENCES[0]  # the least `kiviq worker --max-active` picks on a GPU
TARGETS = {4: 2.8, 2: 4.0}  # issue #5: concurrent 16k sequences vs fp16

# name: (layers, kv heads, head_dim, query heads, model context window)
SHAPES = {
    "qwen3-4b": (36, 8, 128, 32, 40960),
}


def stub_model(layers: int, h_kv: int, d: int, h_q: int, max_positions: int) -> SimpleNamespace:
    """What make_store and context_length read of an mlx-lm model: ``args``
    (a real qwen3 ModelArgs; Qwen3-4B's config where the attention shape does
    not decide) and ``layers`` (only counted). No weights."""
    from mlx_lm.models.qwen3 import ModelArgs

    args = ModelArgs(model_type="qwen3", hidden_size=2560, num_hidden_layers=layers, intermediate_size=9728,
                     num_attention_heads=h_q, rms_norm_eps=1e-6, vocab_size=151936, num_key_value_heads=h_kv,
                     max_position_embeddings=max_positions, head_dim=d, tie_word_embeddings=True,
                     rope_theta=1e6)
    return SimpleNamespace(args=args, layers=[None] * layers)


def _fresh() -> int:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def _random_kv(h_kv: int, n: int, d: int, seed: int) -> tuple[mx.array, mx.array]:
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((h_kv, n, d), dtype=np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((h_kv, n, d), dtype=np.float32)).astype(mx.bfloat16)
    mx.eval(k, v)
    return k, v


# ---- kiviq -------------------------------------------------------------------

@dataclass
class _Counts:
    """A counts-only allocator for the Scheduler (nothing allocated)."""

    free_blocks: int
    free_slots: int
    probe: KiviStore

    def blocks_needed(self, num_tokens: int) -> int:
        return self.probe.blocks.blocks_needed(num_tokens)

    def blocks_held(self, seq: Sequence) -> int:
        return 0


def _offer(count: int, context: int) -> list[Sequence]:
    """``count`` waiting sequences with ``context``-token prompts (one shared list)."""
    prompt = [0] * context
    return [Sequence(Request(f"s{i}", prompt, max_tokens=1), arrival=i) for i in range(count)]


def probe_store(layers: int, h_kv: int, d: int, config: KVConfig) -> KiviStore:
    """The one-block, one-slot store make_store sizes from (real arrays)."""
    return KiviStore(layers, h_kv, d, config=config, num_blocks=1, num_slots=1, dtype=mx.bfloat16)


def planned_blocks(probe: KiviStore, budget: int, max_sequences: int, model_context: int) -> int:
    """make_store's num_blocks for this budget (engine.block_manager.blocks_for_budget),
    from the probe's measured bytes; checked against the real make_store where run."""
    return blocks_for_budget(budget, block_bytes=probe.blocks.block_bytes, slot_bytes=probe.blocks.slot_bytes,
                             max_sequences=max_sequences, group_size=probe.config.group_size,
                             context=model_context)


def admitted_by_counts(probe: KiviStore, num_blocks: int, max_sequences: int, context: int) -> int:
    """How many ``context``-token sequences the engine's Scheduler admits into
    a store of ``num_blocks`` blocks and ``max_sequences`` slots (counts only)."""
    if num_blocks < 1 or max_sequences < 1:
        return 0
    sched = Scheduler(_Counts(num_blocks, max_sequences, probe), MAX_BATCH_TOKENS, RESERVE_TOKENS)
    for s in _offer(max_sequences + 1, context):
        sched.add(s)
    return len(sched.schedule().admit)


def fitted_slots(probe: KiviStore, budget: int, context: int, model_context: int) -> tuple[int, int]:
    """(smallest max_sequences that maximizes the admitted count, that count)."""
    best = (1, 0)
    for ms in range(1, max(1, budget // probe.blocks.slot_bytes) + 1):
        n = admitted_by_counts(probe, planned_blocks(probe, budget, ms, model_context), ms, context)
        if n > best[1]:
            best = (ms, n)
        if n < ms:  # blocks, not slots, are the limit: more slots only take blocks away
            break
    return best


@dataclass
class KiviResult:
    bits: int
    slots: int
    slots_label: str
    num_blocks: int
    held: int
    bytes_per_seq: int
    blocks_per_seq: int
    store_bytes: int
    active_bytes: int
    active_before_fill: int
    peak_bytes: int
    refusal: str
    fill_layers: int
    fill_s: float


def run_kiviq(shape: tuple, bits: int, budget: int, context: int, max_sequences: int, slots_label: str, *,
              group_size: int = 32, residual: int = 128, fill_layers: int | None = None,
              max_batch_tokens: int = MAX_BATCH_TOKENS, log=print) -> KiviResult:
    layers, h_kv, d, h_q, max_positions = shape
    fill_layers = layers if fill_layers is None else fill_layers
    if not 1 <= fill_layers <= layers:
        raise ValueError(f"fill_layers must be in 1..{layers}")
    model = stub_model(*shape)
    bank = [_random_kv(h_kv, max_batch_tokens, d, seed) for seed in range(4)]  # prefill K/V, reused
    a0 = _fresh()
    # Exactly the worker's store: build_engine -> make_store(model, KVConfig(b, G, R),
    # kv_memory=..., max_sequences=max_active, context=context_length(model)).
    store = make_store(model, KVConfig(bits, group_size, residual), kv_memory=budget,
                       max_sequences=max_sequences, context=context_length(model), dtype=mx.bfloat16)
    pool_bytes = sum(a.nbytes for pool in store.pools for a in pool)
    assert pool_bytes == store.blocks.budget_bytes() <= budget, (pool_bytes, store.blocks.budget_bytes(), budget)
    active_before_fill = mx.get_active_memory() - a0

    sched = Scheduler(store.blocks, max_batch_tokens, RESERVE_TOKENS)
    offered = _offer(max_sequences + 1, context)
    for s in offered:
        sched.add(s)
    t0 = time.perf_counter()
    step = 0
    while True:  # the engine's step loop, with the model forward replaced by random K/V
        plan = sched.schedule()
        assert not plan.preempt and not plan.fail, (plan.preempt, plan.fail)
        for s in plan.admit:
            s.kv = store.blocks.allocate()
        if not plan.prefill:
            break
        for s, n in plan.prefill:
            for layer in range(fill_layers):
                k, v = bank[(step + layer) % len(bank)]
                store.append(layer, s.kv, k[:, :n], v[:, :n])
                mx.eval(store.pools[layer])
            s.prefilled += n
            if s.prefilled == s.num_tokens:
                sched.prefill_done(s)
                log(f"    kiviq {bits}-bit slots={max_sequences}: sequence {len(sched.running)} prefilled "
                    f"({time.perf_counter() - t0:.0f} s)")
            step += 1
    fill_s = time.perf_counter() - t0
    running = sched.running
    held = len(running)
    assert held == len(sched.schedule().decode) and not sched.prefilling
    nxt = sched.waiting[0] if sched.waiting else None
    if nxt is None:
        refusal = "none offered"
    elif store.blocks.free_slots == 0:
        refusal = "no free slot"
    else:
        refusal = (f"blocks: needs {store.blocks.blocks_needed(nxt.num_tokens + RESERVE_TOKENS)}, "
                   f"{store.blocks.free_blocks} free")
    # What one admitted sequence holds, three ways that must agree.
    seq = running[-1].kv
    nb = len(seq.block_ids)
    assert nb == store.blocks.blocks_needed(context) and all(u == nb for u in seq.blocks_used[:fill_layers])
    per_seq = nb * store.blocks.block_bytes + store.blocks.slot_bytes
    if fill_layers == layers:
        cache_bytes = sum(KiviLayerCache(store, layer, [seq]).nbytes for layer in range(layers))
        assert cache_bytes == per_seq, (cache_bytes, per_seq)
        assert all(seq.offset(layer, group_size) == context for layer in range(layers))
    # The data landed: the last sequence's last block in the last filled layer is not zeros.
    pool = store.pools[fill_layers - 1]
    last = mx.array(seq.block_ids[-1:], dtype=mx.int32)
    assert bool(mx.any(pool.k_scales[last] != 0)) and bool(mx.any(pool.v_codes[last] != 0))
    active = mx.get_active_memory() - a0
    peak = mx.get_peak_memory() - a0
    result = KiviResult(bits, max_sequences, slots_label, store.blocks.num_blocks, held, per_seq, nb,
                        store.blocks.budget_bytes(), active, active_before_fill, peak, refusal, fill_layers, fill_s)
    del store, sched, running, offered, seq, pool, bank
    _fresh()
    return result


# ---- fp16 (mlx-lm KVCache) ----------------------------------------------------

@dataclass
class Fp16Result:
    held: int
    bytes_per_seq: int
    cache_bytes: int
    active_bytes: int
    peak_bytes: int
    fill_s: float


def fill_kvcache(layers: int, context: int, chunk: int, bank: list) -> list[KVCache]:
    """One sequence's mlx-lm caches, every layer filled to ``context`` tokens."""
    caches = [KVCache() for _ in range(layers)]
    for layer, c in enumerate(caches):
        for i, start in enumerate(range(0, context, chunk)):
            n = min(chunk, context - start)
            k, v = bank[(layer + i) % len(bank)]
            c.update_and_fetch(k[None, :, :n], v[None, :, :n])
            mx.eval(c.keys, c.values)
        assert c.offset == context
    return caches


def run_fp16(shape: tuple, budget: int, context: int, *, chunk: int = 2048, log=print) -> Fp16Result:
    layers, h_kv, d, _, _ = shape
    bank = [_random_kv(h_kv, chunk, d, seed) for seed in range(4)]
    a0 = _fresh()
    held: list[list[KVCache]] = []
    held_bytes = per_seq = 0
    t0 = time.perf_counter()
    while per_seq == 0 or held_bytes + per_seq <= budget:
        caches = fill_kvcache(layers, context, chunk, bank)
        nbytes = sum(c.nbytes for c in caches)
        if held_bytes + nbytes > budget:  # only possible for the first: a budget below one sequence
            del caches
            break
        held.append(caches)
        held_bytes += nbytes
        per_seq = nbytes
        log(f"    fp16: sequence {len(held)} filled ({time.perf_counter() - t0:.0f} s)")
    fill_s = time.perf_counter() - t0
    active = mx.get_active_memory() - a0
    peak = mx.get_peak_memory() - a0
    result = Fp16Result(len(held), per_seq, held_bytes, active, peak, fill_s)
    del held, bank
    _fresh()
    return result


def kvcache_growth(shape: tuple, context: int, chunk: int) -> tuple[int, int]:
    """nbytes of one layer's KVCache at ``context`` tokens and after one more
    (a decoded token): mlx-lm grows in steps of 256 tokens."""
    _, h_kv, d, _, _ = shape
    c = KVCache()
    bank = [_random_kv(h_kv, chunk, d, 0)]
    for start in range(0, context, chunk):
        k, v = bank[0]
        n = min(chunk, context - start)
        c.update_and_fetch(k[None, :, :n], v[None, :, :n])
    mx.eval(c.keys, c.values)
    before = c.nbytes
    k, v = bank[0]
    c.update_and_fetch(k[None, :, :1], v[None, :, :1])
    mx.eval(c.keys, c.values)
    return before, c.nbytes


# ---- report -------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, nargs="+", default=[8.0], help="KV memory budgets to run (GiB)")
    ap.add_argument("--context", type=int, default=16384, help="tokens per sequence (prompt)")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--shape", default="qwen3-4b", choices=list(SHAPES))
    ap.add_argument("--slots", nargs="+", default=["fit", str(WORKER_MAX_ACTIVE)],
                    help="kiviq max_sequences (--max-active) to run: 'fit' (the smallest that maximizes the "
                         f"count) and/or numbers (worker default {WORKER_MAX_ACTIVE})")
    ap.add_argument("--fill-layers", type=int, default=None, help="layers written per kiviq sequence (default all)")
    ap.add_argument("--fp16-chunk", type=int, default=2048, help="tokens per KVCache update (mlx-lm prefill step)")
    ap.add_argument("--project-gib", type=float, nargs="*", default=[4, 8, 12, 16, 24, 32, 64, 128],
                    help="budgets for the counts-only projection (nothing allocated)")
    ap.add_argument("--headroom-gib", type=float, default=3.0,
                    help="before each system's run, stop the budget unless the budget plus this much "
                         "memory is available (others share the machine)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    layers, h_kv, d, h_q, max_positions = shape
    model_context = context_length(stub_model(*shape))

    print(f"# {command()}")
    print(f"# {machine()}")
    print(f"# shape {args.shape}: {layers} layers, {h_kv} kv heads, head_dim {d}, bf16 K/V; context {args.context} "
          f"tokens per sequence; KIVI G={args.group_size} R={args.residual}, scheduler reserve "
          f"{RESERVE_TOKENS} tokens, {MAX_BATCH_TOKENS} tokens per step; fp16 chunks of {args.fp16_chunk}\n")

    probes = {b: probe_store(layers, h_kv, d, KVConfig(b, args.group_size, args.residual)) for b in args.bits}
    rows, measured = [], {}

    def room(budget: int, what: str) -> bool:
        avail = _mem_available()
        if avail is not None and avail < budget + args.headroom_gib * GIB:
            print(f"  {what} skipped (and the rest of this budget): {_gib(avail)} available, needs "
                  f"{_gib(budget + args.headroom_gib * GIB)}\n", flush=True)
            return False
        return True

    for budget_gib in args.budget_gib:
        budget = int(budget_gib * GIB)
        print(f"## budget {budget_gib:g} GiB = {_mib(budget)}", flush=True)
        if not room(budget, "fp16"):
            continue
        fp = run_fp16(shape, budget, args.context, chunk=args.fp16_chunk,
                      log=lambda m: print(m, flush=True))
        assert fp.bytes_per_seq == 0 or fp.held == budget // fp.bytes_per_seq
        measured[(budget_gib, "fp16")] = fp.held
        rows.append([f"{budget_gib:g} GiB", "fp16 (mlx-lm KVCache)", "-", _mib(fp.bytes_per_seq), fp.held,
                     "1.00x", "-", "-", _mib(fp.active_bytes), _mib(fp.peak_bytes), "next sequence over budget"])
        for bits, slots in [(b, sl) for b in args.bits for sl in args.slots]:
            probe = probes[bits]
            if not room(budget, f"kiviq {bits}-bit slots={slots}"):
                break
            if slots == "fit":
                ms, _ = fitted_slots(probe, budget, args.context, model_context)
                label = f"{ms} (fit)"
            else:
                ms = int(slots)
                label = f"{ms} (worker default)" if ms == WORKER_MAX_ACTIVE else str(ms)
            r = run_kiviq(shape, bits, budget, args.context, ms, label, group_size=args.group_size,
                          residual=args.residual, fill_layers=args.fill_layers,
                          log=lambda m: print(m, flush=True))
            expect = admitted_by_counts(probe, planned_blocks(probe, budget, ms, model_context), ms,
                                        args.context)
            assert r.num_blocks == planned_blocks(probe, budget, ms, model_context)
            assert r.held == expect, (r.held, expect)
            measured[(budget_gib, bits, ms)] = r.held
            ratio = r.held / fp.held if fp.held else float("inf")
            target = TARGETS.get(bits)
            rows.append([f"{budget_gib:g} GiB", f"kiviq KIVI {bits}-bit", label, _mib(r.bytes_per_seq), r.held,
                         f"{ratio:.2f}x", f">= {target}x" if target else "-",
                         ("met" if ratio >= target else "missed") if target else "-",
                         _mib(r.active_bytes), _mib(r.peak_bytes), r.refusal])
            print(f"    -> {r.held} sequences, store {_gib(r.store_bytes)} ({r.num_blocks} blocks of "
                  f"{probe.blocks.block_bytes} B, {ms} slots of {probe.blocks.slot_bytes} B); active {_mib(r.active_bytes)} "
                  f"(before fill {_mib(r.active_before_fill)}), peak {_mib(r.peak_bytes)}; "
                  f"{r.fill_layers} layers filled in {r.fill_s:.0f} s\n", flush=True)
        print(flush=True)

    if rows:
        print("## Measured (arrays allocated and filled)\n")
        print(table(["budget", "system", "slots (max_sequences)", f"bytes per {args.context}-token sequence",
                     "sequences held", "ratio vs fp16", "target", "met?", "active memory", "peak memory",
                     "next sequence refused by"], rows))

    # Counts-only projection: budget-independence of the ratios apart from rounding.
    fp16_seq = -(-args.context // KVCache.step) * KVCache.step * layers * 2 * h_kv * d * 2
    before, after = kvcache_growth(shape, args.context, args.fp16_chunk)
    assert before * layers == fp16_seq, (before * layers, fp16_seq)
    proj_header = ["budget", "fp16"]
    per_seq = {}
    for bits in args.bits:
        p = probes[bits]
        per_seq[bits] = p.blocks.blocks_needed(args.context) * p.blocks.block_bytes + p.blocks.slot_bytes
        proj_header += [f"{bits}-bit (slots fit)", f"{bits}-bit ratio", f"{bits}-bit, 32 slots", "ratio"]
    proj = []
    for budget_gib in args.project_gib:
        budget = int(budget_gib * GIB)
        n_fp = budget // fp16_seq
        if (budget_gib, "fp16") in measured:
            assert measured[(budget_gib, "fp16")] == n_fp
        row = [f"{budget_gib:g} GiB", n_fp]
        for bits in args.bits:
            p = probes[bits]
            ms, n_fit = fitted_slots(p, budget, args.context, model_context)
            n32 = admitted_by_counts(p, planned_blocks(p, budget, WORKER_MAX_ACTIVE, model_context),
                                     WORKER_MAX_ACTIVE, args.context)
            for key, n in (((budget_gib, bits, ms), n_fit), ((budget_gib, bits, WORKER_MAX_ACTIVE), n32)):
                if key in measured:
                    assert measured[key] == n, (key, measured[key], n)
            row += [f"{n_fit} ({ms} slots)", f"{n_fit / n_fp:.2f}x" if n_fp else "-", n32,
                    f"{n32 / n_fp:.2f}x" if n_fp else "-"]
        proj.append(row)
    limit = ", ".join(f"{b}-bit {fp16_seq / per_seq[b]:.3f}x ({_mib(per_seq[b])} per sequence)" for b in args.bits)
    print("\n## Counts-only projection (same sizing and Scheduler, nothing allocated)\n")
    print(f"Per-sequence bytes: fp16 {_mib(fp16_seq)}; byte ratio vs fp16 (the large-budget limit): {limit}.\n")
    print(table(proj_header, proj))
    print(f"\nmlx-lm KVCache, one layer: {_mib(before)} at {args.context} tokens, {_mib(after)} after one more "
          f"token (+{(after - before) / before:.1%}: step-256 growth; the fp16 counts above are for the prompt "
          f"alone, the most favourable case for fp16)")


if __name__ == "__main__":
    main()
