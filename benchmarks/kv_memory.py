"""KV cache memory of one long sequence: KIVI store bytes vs fp16, and the
transient memory of one decode step's attention.

No model is needed: a KiviStore only needs the attention shape, and the K/V
written into it are random fp16 (the byte count does not depend on values).

For each shape and bit width:
  * a KiviStore sized exactly for the sequence (the blocks it needs, one slot)
    is filled by appending ``--seq`` tokens of random K/V per layer in prefill
    chunks; its bytes are summed from the real pool buffers (``.nbytes``) and
    checked against ``store.blocks.used_bytes()`` and the caches' ``nbytes``;
  * the fp16 size is ``seq * layers * 2 * H_kv * D * 2`` bytes, confirmed by
    filling mlx-lm's own ``KVCache`` per layer with the same sequence;
  * decode transient: ``mx.reset_peak_memory()``, then one decode step's
    attention over every layer (``tests.kv_helpers.decode_attend`` with a random query,
    evaluated per layer); transient = peak - active memory before the step
    (the resident cache, the queries and everything else already allocated).

Run (2-core CPU):
    PYTHONPATH=. python benchmarks/kv_memory.py
    PYTHONPATH=. python benchmarks/kv_memory.py --chunk-blocks 0   # one split, like the old reference
    git show f8e5ef2:kernels/kivi_reference.py > /tmp/old_reference.py
    PYTHONPATH=. python benchmarks/kv_memory.py --decode-from /tmp/old_reference.py   # the old reference itself
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

# The repository root first: run as a script, this file's folder would come first
# and benchmarks/engine.py would shadow the engine package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import kiviq.kernels.kivi_reference as reference  # noqa: E402
from benchmarks.common import command, machine, mib, table  # noqa: E402
from kiviq.engine.kivi_cache import KiviLayerCache  # noqa: E402
from kiviq.engine.kv_store import KiviStore, KVConfig  # noqa: E402
from tests import kv_helpers  # noqa: E402

SHAPES = {
    # name: (layers, kv heads, head dim, query heads)
    "smollm2-135m": (30, 3, 64, 9),
    "qwen3-4b": (36, 8, 128, 32),
}


def fill_store(store: KiviStore, seq_len: int, chunk: int, h_kv: int, d: int, rng: np.random.Generator):
    """Append seq_len tokens of random fp16 K/V to every layer, in prefill chunks."""
    seq = store.blocks.allocate()
    for layer in range(store.num_layers):
        for start in range(0, seq_len, chunk):
            n = min(chunk, seq_len - start)
            k = mx.array(rng.standard_normal((h_kv, n, d), dtype=np.float32)).astype(mx.float16)
            v = mx.array(rng.standard_normal((h_kv, n, d), dtype=np.float32)).astype(mx.float16)
            store.append(layer, seq, k, v)
            mx.eval(store.pools[layer])
    return seq


def mlx_lm_fp16_bytes(layers: int, h_kv: int, d: int, seq_len: int, chunk: int) -> int:
    """Bytes of mlx-lm KVCaches holding the sequence in fp16 (filled layer by layer,
    each dropped after counting so the biggest shape does not hold them all)."""
    from mlx_lm.models.cache import KVCache

    total = 0
    for _ in range(layers):
        c = KVCache()
        for start in range(0, seq_len, chunk):
            n = min(chunk, seq_len - start)
            kv = mx.zeros((1, h_kv, n, d), dtype=mx.float16)
            c.update_and_fetch(kv, kv)
        mx.eval(c.keys, c.values)
        assert c.offset == seq_len
        total += c.nbytes
        del c
    return total


def decode_transient(store: KiviStore, seq, h_q: int, d: int, rng: np.random.Generator,
                     per_layer_eval: bool) -> tuple[int, float]:
    """Peak minus active memory of one decode step's attention over every layer."""
    qs = [mx.array(rng.standard_normal((1, h_q, d), dtype=np.float32)).astype(mx.float16)
          for _ in range(store.num_layers)]
    mx.eval(qs)
    gc.collect()
    mx.clear_cache()
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    outs = []
    for layer in range(store.num_layers):
        out = kv_helpers.decode_attend(store, layer, [seq], qs[layer], d**-0.5)
        if per_layer_eval:
            mx.eval(out)
        outs.append(out)
    mx.eval(outs)
    dt = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    assert all(not np.isnan(np.array(o.astype(mx.float32))).any() for o in outs)
    return peak - active, dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192, help="sequence length (tokens)")
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--prefill-chunk", type=int, default=512, help="tokens per append while filling")
    ap.add_argument("--chunk-blocks", type=int, default=None,
                    help="kernels.kivi_reference.CHUNK_BLOCKS for the decode step "
                         f"(default {reference.CHUNK_BLOCKS}; 0 = unbounded: one split, as before the rewrite)")
    ap.add_argument("--decode-from", metavar="FILE",
                    help="take decode_attention from this file instead (e.g. the pre-rewrite reference: "
                         "git show f8e5ef2:kernels/kivi_reference.py > /tmp/old_reference.py)")
    ap.add_argument("--lazy", action="store_true",
                    help="also measure the step with one eval for all layers (as the engine runs it)")
    args = ap.parse_args()
    if args.chunk_blocks is not None:
        reference.CHUNK_BLOCKS = args.chunk_blocks if args.chunk_blocks > 0 else 1 << 30
    # chunk_desc: the table column; decode_desc: the header line.
    chunk_desc = "unbounded" if reference.CHUNK_BLOCKS >= 1 << 30 else str(reference.CHUNK_BLOCKS)
    decode_desc = f"reference, CHUNK_BLOCKS={chunk_desc}"
    from kiviq.kernels.dispatch import backend

    if args.decode_from:
        import importlib.util

        spec = importlib.util.spec_from_file_location("decode_from", args.decode_from)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        kv_helpers.dispatch_decode_attend = module.decode_attention
        chunk_desc = decode_desc = f"decode_attention from {args.decode_from}"
    elif backend() != "reference":  # decode_attend dispatches to a kernel
        chunk_desc = decode_desc = f"{backend()} kernel"

    print(f"# {command()}")
    print(f"# {machine()}")
    print(f"# seq={args.seq} G={args.group_size} R={args.residual} fp16 storage; decode attention: {decode_desc}\n")
    rng = np.random.default_rng(0)
    size_rows, mem_rows = [], []
    for name in args.shapes:
        layers, h_kv, d, h_q = SHAPES[name]
        fp16 = args.seq * layers * 2 * h_kv * d * 2
        fp16_layer = fp16 // layers
        measured_fp16 = mlx_lm_fp16_bytes(layers, h_kv, d, args.seq, args.prefill_chunk)
        # mlx-lm grows its buffers in steps of 256 tokens.
        assert measured_fp16 == -(-args.seq // 256) * 256 * fp16 // args.seq, (measured_fp16, fp16)
        gc.collect()
        mx.clear_cache()
        for bits in args.bits:
            config = KVConfig(bits, args.group_size, args.residual)
            probe = KiviStore(layers, h_kv, d, config=config, num_blocks=1, num_slots=1)
            nb = probe.blocks.blocks_needed(args.seq)
            del probe
            store = KiviStore(layers, h_kv, d, config=config, num_blocks=nb, num_slots=1)
            t0 = time.perf_counter()
            seq = fill_store(store, args.seq, args.prefill_chunk, h_kv, d, rng)
            fill_s = time.perf_counter() - t0
            assert store.blocks.free_blocks == 0 and all(u == nb for u in seq.blocks_used)
            assert all(seq.offset(layer, args.group_size) == args.seq for layer in range(layers))
            pool_bytes = sum(a.nbytes for pool in store.pools for a in pool)
            cache_bytes = sum(KiviLayerCache(store, layer, [seq]).nbytes for layer in range(layers))
            used = store.blocks.used_bytes()
            assert pool_bytes == used == cache_bytes, (pool_bytes, used, cache_bytes)
            size_rows.append([name, bits, nb, seq.tail_lens[0], mib(pool_bytes), mib(fp16),
                              f"{pool_bytes / fp16:.3f}x"])
            transient, dt = decode_transient(store, seq, h_q, d, rng, per_layer_eval=True)
            row = [name, bits, chunk_desc, mib(pool_bytes), mib(transient),
                   f"{transient / fp16_layer:.2f}x", f"{transient / fp16:.3f}x"]
            if args.lazy:
                lazy, _ = decode_transient(store, seq, h_q, d, rng, per_layer_eval=False)
                row.append(mib(lazy))
            mem_rows.append(row)
            print(f"  {name} {bits}-bit: filled in {fill_s:.1f} s, decode step {dt * 1e3:.0f} ms "
                  f"(CPU, noisy)", flush=True)
            del store, seq
            gc.collect()
            mx.clear_cache()

    print("\n## Bytes held for one sequence\n")
    print(table(["shape", "bits", "blocks", "tail tokens", "KIVI bytes (pool buffers)", "fp16 bytes",
                 "ratio"], size_rows))
    print("\n## Decode-step transient (peak - active, attention over every layer, eval per layer)\n")
    header = ["shape", "bits", "decode attention (reference CHUNK_BLOCKS)", "resident KIVI cache", "transient",
              "vs fp16 of ONE layer", "vs fp16 of whole cache"]
    if args.lazy:
        header.append("transient, one eval for all layers")
    print(table(header, mem_rows))


if __name__ == "__main__":
    main()
