"""The batching engine with the fused KIVI kernel on a GPU (marker gpu).

Model: SmolLM2-135M-Instruct from ``$KIVIQ_GPU_MODEL`` (a converted MLX
directory carried to the GPU machine) or, where that is unset, the default
model. Skipped where no KIVI kernel backend runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_runs import run_engine
from kiviq.kernels import dispatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not dispatch.kernel_available(),
                       reason="needs MLX's CUDA backend (Linux + NVIDIA) or Metal (Apple silicon); "
                              "this machine has neither"),
]

PROSE = (Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "kjv_prose.txt").read_text()
PROSE = "\n".join(line for line in PROSE.splitlines() if not line.startswith("#"))


@pytest.fixture(scope="module")
def gpu_model():
    from kiviq.engine import load

    return load(os.environ.get("KIVIQ_GPU_MODEL"))


def generate(model, tok, requests, *, bits, join_every=0, table_width_multiple=1, **options):
    from kiviq.engine import build_engine

    engine = build_engine(model, tok, kv_bits=bits, kv_memory=2 << 30, max_sequences=16, **options)
    if options.get("use_kernel") is not False:  # else kernel == reference would hold trivially
        assert engine.kv_store.use_kernel is not False, "the start-up self-check turned the kernels off"
    engine.kv_store.table_width_multiple = table_width_multiple
    out = run_engine(engine, requests, join_every)
    assert engine.kv_store.blocks.used_bytes() == 0
    return out


@pytest.mark.parametrize("bits,rotate", [(4, False), (2, False), (2, True)], ids=["4", "2", "2r"])
def test_greedy_128_tokens_kernel_equals_reference(gpu_model, bits, rotate):
    """2r: the kernels read rotated pools (q rotated on entry, the output rotated back
    in KiviLayerCache.attend), the same launches as at 2 bits."""
    from kiviq.engine import Request

    model, tok = gpu_model
    prompt = tok.encode(PROSE)[:600]  # 600 + 128 tokens: blocks flush during decode too
    assert dispatch.backend() in ("cuda", "metal")
    kernel = generate(model, tok, [Request("k", prompt, 128)], bits=bits, kv_rotate=rotate)["k"]
    assert dispatch.backend(False) == "reference"
    reference = generate(model, tok, [Request("k", prompt, 128)], bits=bits, kv_rotate=rotate, use_kernel=False)["k"]
    assert len(kernel) == 128
    assert kernel == reference


def test_later_chunks_write_blocks_in_place_and_equal_reference(gpu_model):
    """Prompts longer than a step's budget prefill in chunks: a later chunk attends to
    its past and writes its new blocks in place (CUDA) without finishing its reads
    first (KiviStore.append). Its first token, and the decode after it, equal the
    reference store's (scatters, a sync per layer)."""
    from kiviq.engine import Request

    model, tok = gpu_model
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 131: i * 131 + 300 + 170 * i], 16) for i in range(4)]  # noqa: E731
    kernel = generate(model, tok, reqs(), bits=4, max_batch_tokens=128, join_every=2)
    reference = generate(model, tok, reqs(), bits=4, max_batch_tokens=128, join_every=2, use_kernel=False)
    assert all(len(t) == 16 for t in kernel.values())
    assert kernel == reference


def test_compiled_pipelined_2r_equals_plain_with_kernel(gpu_model):
    """2r with the kernels inside the compiled graph (mx.hadamard_transform traced with
    them): the same tokens as plain steps, requests joining and leaving."""
    from kiviq.engine import Request

    model, tok = gpu_model
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 97: i * 97 + 200 + 150 * i], 40 + 4 * i) for i in range(6)]  # noqa: E731
    plain = generate(model, tok, reqs(), bits=2, kv_rotate=True, join_every=3, compile_decode=False, pipeline=False)
    assert generate(model, tok, reqs(), bits=2, kv_rotate=True, join_every=3, compile_decode=True,
                    pipeline=True) == plain


def test_batch_equals_single_with_kernel(gpu_model):
    from kiviq.engine import Request

    model, tok = gpu_model
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 97: i * 97 + 200 + 150 * i], 8 + 4 * i) for i in range(8)]
    batched = generate(model, tok, reqs(), bits=4, join_every=3)
    for r in reqs():
        assert batched[r.request_id] == generate(model, tok, [r], bits=4)[r.request_id], r.request_id


# 32 columns: block tables padded as the worker pads them (a retrace every 1024 tokens
# instead of every G) change the kernel's plan: more, empty splits, so the merge sums in
# another order, and tokens may differ from the unpadded run's in the end (seen on an
# H200: r7, 1.2k tokens, after ~30). Compiled and pipelined equal plain at either width.
# Two cases, not one test: each is ~100 s on an H200, and pytest-xdist runs them at once.
@pytest.mark.parametrize("table_width_multiple", [1, 32])
def test_compiled_pipelined_decode_equals_plain_with_kernel(gpu_model, table_width_multiple):
    """Decode steps through mx.compile (engine.compiled_decode), pipelined, with the
    kernels inside the compiled graph: the same tokens as plain steps, with
    requests joining and leaving and block tables widening (retraces)."""
    from kiviq.engine import Request

    model, tok = gpu_model
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 97: i * 97 + 200 + 150 * i], 40 + 4 * i) for i in range(8)]
    plain = generate(model, tok, reqs(), bits=4, join_every=3, compile_decode=False, pipeline=False,
                     table_width_multiple=table_width_multiple)
    assert generate(model, tok, reqs(), bits=4, join_every=3, compile_decode=True, pipeline=True,
                    table_width_multiple=table_width_multiple) == plain


@pytest.mark.parametrize("pipeline,compiled", [(False, False), (True, False), (True, True)])
def test_decode_steps_write_the_tails_in_place_with_kernel(gpu_model, pipeline, compiled):
    """Steady decode steps, flushes included, allocate less than half of one layer's
    tail array: a write evaluated while a read of the same buffer is still pending on
    the device (a pipelined step in flight, a flush's own read) makes MLX copy the
    whole array. 2048 slots make each tail array 126 MB. What the steps may hold
    besides: a B=4 step's own buffers (split-K partials, logits) were 8-9 MB (H100,
    synchronized steps), and MLX frees them only once the device has run them, so up to
    three steps' worth were alive at once (6-27 MB over 64 steps in every mode); at 512
    slots (a 31 MB array) that came within 4 MB of the bound."""
    import mlx.core as mx

    from kiviq.engine import Request, build_engine

    model, tok = gpu_model
    engine = build_engine(model, tok, kv_bits=4, kv_memory=8 << 30, max_sequences=2048, pipeline=pipeline,
                          compile_decode=compiled)
    ids = tok.encode(PROSE)
    for i in range(4):
        engine.add(Request(f"r{i}", ids[i * 50: i * 50 + 300 + 7 * i], 200))
    for _ in range(60):  # prefill, then decoding past a flush of each (kernels built)
        engine.step()
    tail = engine.kv_store.pools[0].tail_k.nbytes
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    for _ in range(64):  # every sequence flushes twice (G = 32)
        engine.step()
    mx.synchronize()
    growth = mx.get_peak_memory() - base
    assert engine.stats["pipelined_steps"] >= (100 if pipeline else 0)
    assert growth < tail / 2, (growth, tail)


def test_flat_quantized_matmuls_give_the_same_tokens_with_kernel():
    """engine.flat_quantized on the GPU: 12 sequences decoding together make MLX take
    its batched quantized matmul (M * B >= 8); flattened, the same rows go through one
    GEMM. Same greedy tokens either way (a model too large to dequantize runs this way)."""
    from kiviq.engine import Request, load
    from kiviq.engine.flat_quantized import flat_quantized_matmuls

    model, tok = load(os.environ.get("KIVIQ_GPU_MODEL"), dequantize=False)  # its 4-bit layers kept
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 131: i * 131 + 300], 24) for i in range(12)]  # noqa: E731
    plain = generate(model, tok, reqs(), bits=4, flat_qmm=False)
    with flat_quantized_matmuls(model) as flattened:
        assert flattened > 0
        flat = generate(model, tok, reqs(), bits=4, flat_qmm=False)
    assert flat == plain


# ---- 2r: rotated pools ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("d", [64, 128])
def test_rotated_store_with_kernels_matches_reference(dtype, d):
    """A 2r store (KVConfig.rotate) through KiviLayerCache.attend, kernels vs the
    reference: prefill, then decode steps across flushes. The kernels see rotated
    pools and a rotated q, nothing else: the pools stay bit-identical (flush kernel
    contract; the same rotation op on the same rows), and the outputs, rotated back
    by the same orthogonal op, agree within the kernels' stated rounding (row RMS:
    the rotation keeps 2-norms, not maxima)."""
    import mlx.core as mx
    import numpy as np

    from kiviq.engine.kivi_cache import KiviLayerCache
    from kiviq.engine.kv_store import KiviStore, KVConfig
    from kiviq.kernels.layout import KiviPool

    dtype, R = getattr(mx, dtype), 128
    # The stated contract of tests/test_kernels_gpu.py: 1 output ulp + 6 u max|v|.
    out_tol = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    u = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}[dtype]

    def to_np(a):
        return np.array(a.astype(mx.float32))

    rng = np.random.default_rng(d + (dtype == mx.bfloat16))
    h_kv, h_q, scale = 2, 8, d**-0.5
    stores = [KiviStore(1, h_kv, d, config=KVConfig(2, 32, R, rotate=True), num_blocks=32, num_slots=3,
                        dtype=dtype, use_kernel=use) for use in (None, False)]
    seqs = [[s.blocks.allocate() for _ in range(2)] for s in stores]

    def rows(b, n):
        x = rng.normal(size=(b, h_kv, n, d)).astype(np.float32)
        x[..., 3] *= 15  # an outlier channel, as real keys have
        return mx.array(x).astype(dtype)

    for i, n in enumerate((R + 50, R - 20)):  # blocks already, and a tail only: both flush below
        k, v = rows(1, n), rows(1, n)
        for store, ss in zip(stores, seqs):
            cache = KiviLayerCache(store, 0, [ss[i]])
            cache.update_and_fetch(k, v)
            cache.attend(mx.zeros((1, h_q, n, d), dtype=dtype), k, v, scale)
    for step in range(2 * 32 + 5):  # both sequences flush during decode
        q = mx.array(rng.normal(size=(2, h_q, 1, d)).astype(np.float32)).astype(dtype)
        k, v = rows(2, 1), rows(2, 1)
        outs = []
        for store, ss in zip(stores, seqs):
            cache = KiviLayerCache(store, 0, ss)
            cache.update_and_fetch(k, v)
            outs.append(to_np(cache.attend(q, k, v, scale)))
        got, ref = outs
        err = np.sqrt(((got - ref) ** 2).mean(-1))
        rms = np.sqrt((ref**2).mean(-1))
        vmax = float(np.abs(to_np(stores[1].pools[0].tail_v)).max())
        bound = 2 * out_tol * rms + 6 * u * vmax + 1e-4
        assert (err <= bound).all(), (step, err.max(), bound.min())
    assert all(s.blocks_used[0] >= 1 for s in seqs[0])
    for name, a, b in zip(KiviPool._fields, stores[0].pools[0], stores[1].pools[0]):
        if name.startswith("tail"):  # rows past each tail length are never read
            for s0, s1 in zip(*seqs):
                t = s0.tail_lens[0]
                assert np.array_equal(to_np(a[s0.slot, :, :t]), to_np(b[s1.slot, :, :t])), name
        else:
            ids0 = [bid for s in seqs[0] for bid in s.block_ids[:s.blocks_used[0]]]
            ids1 = [bid for s in seqs[1] for bid in s.block_ids[:s.blocks_used[0]]]
            assert np.array_equal(to_np(a[mx.array(ids0)]), to_np(b[mx.array(ids1)])), name


def test_padded_prefill_attention_gives_the_same_tokens(gpu_model):
    """On a GPU prefill attention runs on bucketed shapes (engine.model_runner): a
    group of first chunks on a power-of-two number of rows, a later chunk padded to a
    multiple of 256 tokens. Greedy tokens equal those of the same forwards with the
    attention unpadded (the same widths and cuts)."""
    from kiviq.engine import Request, build_engine

    model, tok = gpu_model
    ids = tok.encode(PROSE)
    reqs = lambda: [Request(f"r{i}", ids[i * 97: i * 97 + 150 + 130 * i], 12) for i in range(7)]  # noqa: E731

    def run(padded):
        engine = build_engine(model, tok, kv_bits=4, kv_memory=2 << 30, max_sequences=16, max_batch_tokens=700)
        assert engine.scheduler.chunk_multiple == engine.runner.prefill_chunk_multiple == 256
        if not padded:
            engine.runner.prefill_chunk_multiple = 1
        return run_engine(engine, reqs(), join_every=0)

    padded = run(True)
    assert all(len(t) == 12 for t in padded.values())
    assert padded == run(False)


# Attention graphs of ever new shapes in a fresh process, as a worker builds them for
# prompts of many lengths (bf16, head_dim 128: shapes MLX runs through cuDNN and caches);
# prints how many ran before the first error, and the error.
MANY_SHAPES = """
import sys
import kiviq
import mlx.core as mx
for i in range(int(sys.argv[1])):
    q = mx.random.normal((1, 32, 2 + i, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, 8, 2 + i, 128)).astype(mx.bfloat16)
    try:
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=0.1, mask="causal"))
    except Exception as e:
        print(i, e)
        break
else:
    print(sys.argv[1], "ok")
"""


def test_a_kiviq_process_survives_mlx_cache_misses():
    """MLX's CUDA caches raise "Cache thrashing is happening" once a process has
    missed twice their capacity (cuDNN attention graphs: 256 by default, so a worker
    would fail every prompt of a new shape after 512 of them). With MLX's check on, a
    run of new shapes fails; in a process that imported kiviq (the check off) the
    same run and more go through."""
    env = dict(os.environ, MLX_CUDA_SDPA_CACHE_SIZE="2")

    def run(shapes, env):
        out = subprocess.run([sys.executable, "-c", MANY_SHAPES, str(shapes)], env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().split(maxsplit=1)

    failed_at, error = run(600, dict(env, MLX_ENABLE_CACHE_THRASHING_CHECK="1"))
    assert "Cache thrashing" in error
    env.pop("MLX_ENABLE_CACHE_THRASHING_CHECK", None)
    shapes = int(failed_at) + 4
    assert run(shapes, env) == [str(shapes), "ok"]
