"""Where one small-batch decode step's time goes: per-op launch costs and a
step broken down by leaving parts out.

The B = 1 target of issue #5 (no slower than mlx-lm's one-request decode) is
about fixed per-step costs, not bandwidth: at B = 1 and a 4k context a layer's
attention reads ~5 MB. This benchmark measures those fixed costs on a model
with the Qwen3-4B attention shape (36 layers, 32 query heads, 8 kv heads,
head_dim 128) whose hidden size and vocabulary are tiny (so the matmuls cost
little; `--hidden 2560 --vocab 151936` gives the real Qwen3-4B):

1. Per-op cost of a chain of N dependent ops, built then evaluated once
   (build = Python + graph construction; eval = MLX's per-op dispatch and the
   device work): an elementwise op, MLX's fused SDPA at the decode shape, a
   trivial `mx.fast.cuda_kernel`, the KIVI decode attention (split + merge),
   the two tail scatters of `KiviStore.write_decode`, and (not a chain: one
   call) the flush of one sequence's tail in all 36 layers.
2. One decode step, arms interleaved in one process (A/B/C/... per round, each
   round a fresh run of `--steps` steps whose tokens differ): mlx-lm's own
   KVCache (`mlxlm`, B = 1 only), kiviq's `ModelRunner.decode` + argmax
   (`runner`), the same with the decode attention replaced by its query
   (`no-attend`) and with the tail writes left out too (`no-kv`), and the
   whole `Engine.step` (`engine`). Differences between arms place the time.
   Arms that leave work out produce other tokens: they are timings of a
   part, not alternatives.

    python benchmarks/decode_overhead.py --batch 1 32 --context 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import command, machine, prefilled_engine, table  # noqa: E402
from benchmarks.engine_host import _ID_TOKENIZER as ID_TOKENIZER  # noqa: E402
from benchmarks.engine_host import model_args  # noqa: E402
from kiviq.engine import kv_store as kv_store_module  # noqa: E402
from kiviq.kernels import dispatch  # noqa: E402

def stats(xs: list[float], unit: float = 1e6) -> str:
    v = [x * unit for x in xs]
    return f"{min(v):.1f} / {statistics.median(v):.1f} / {max(v):.1f}"


# ---- 1. per-op costs ----------------------------------------------------------

def chain_cost(make_op, x0, n: int, repeats: int) -> tuple[list[float], list[float]]:
    """Per-op (build, eval) seconds of n dependent ops x = op(x), over repeats."""
    build, ev = [], []
    for r in range(repeats + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        x = x0
        for _ in range(n):
            x = make_op(x)
        t1 = time.perf_counter()
        mx.eval(x)
        mx.synchronize()
        t2 = time.perf_counter()
        if r:  # the first round compiles and warms up
            build.append((t1 - t0) / n)
            ev.append((t2 - t1) / n)
    return build, ev


_COPY = None


def trivial_kernel(x):
    global _COPY
    if _COPY is None:
        _COPY = mx.fast.cuda_kernel(name="kiviq_copy", input_names=["inp"], output_names=["out"],
                                    source="const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                           "if (i < n) out[i] = inp[i];",
                                    header="")
    return _COPY(inputs=[x], template=[("n", x.size)], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                 output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def op_costs(args, dtype) -> list[list]:
    """Rows: op, build us/op, eval us/op (min / median / max)."""
    from kiviq.kernels.kivi_quant import quantize_key_blocks, quantize_value_blocks
    from kiviq.kernels.layout import allocate_pool, KiviPool

    rows = []
    n, rep = args.chain, args.repeats
    x = mx.random.normal((1, 32, 128)).astype(dtype)
    mx.eval(x)
    rows.append(["elementwise x*1+0 [1,32,128]", *chain_cost(lambda y: y * 1.0001, x, n, rep)])
    s = args.context
    k = mx.random.normal((1, 8, s, 128)).astype(dtype)
    v = mx.random.normal((1, 8, s, 128)).astype(dtype)
    mx.eval(k, v)
    q4 = x[:, :, None]
    rows.append([f"mx.fast SDPA B=1 S={s}", *chain_cost(
        lambda y: mx.fast.scaled_dot_product_attention(y, k, v, scale=0.088), q4, n, rep)])
    if mx.cuda.is_available():
        rows.append(["trivial mx.fast.cuda_kernel", *chain_cost(trivial_kernel, x, n, rep)])
    # A KIVI pool holding one sequence of `s` tokens.
    g, r_ = 32, 128
    nblk = max(0, (s - r_) // g)
    tail = s - nblk * g
    pool = allocate_pool(nblk + 1, 1, 8, 128, bits=4, group_size=g, residual=r_, dtype=mx.float16)
    sd = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    kb = mx.random.normal((nblk + 1, 8, g, 128)).astype(sd)
    kq = quantize_key_blocks(kb, bits=4, scale_dtype=sd)
    vq = quantize_value_blocks(kb, bits=4, scale_dtype=sd)
    pool = KiviPool(*kq, *vq, mx.random.normal(pool.tail_k.shape).astype(dtype),
                    mx.random.normal(pool.tail_v.shape).astype(dtype))
    mx.eval(pool)
    tables = mx.arange(nblk, dtype=mx.int32)[None] if nblk else mx.zeros((1, 1), mx.int32)
    nb, slots, tl = (mx.array([nblk], dtype=mx.int32), mx.array([0], dtype=mx.int32),
                     mx.array([tail], dtype=mx.int32))
    rows.append([f"KIVI decode attention B=1 S={s} ({dispatch.backend()})", *chain_cost(
        lambda y: dispatch.decode_attend(y, pool, tables, nb, slots, tl, scale=0.088, bits=4), x, n, rep)])
    plan = dispatch.attend_plan(x.shape, x.dtype, pool, tables, nb, slots, tl, scale=0.088, bits=4)
    rows.append(["KIVI decode attention, plan made once (a layer of a step)", *chain_cost(
        lambda y: plan(y, pool), x, n, rep)])
    pos = mx.array([tail - 1], dtype=mx.int32)

    def write(y):
        pool.tail_k[slots, :, pos] = y[:, :8]
        pool.tail_v[slots, :, pos] = y[:, 8:16]
        return y * 1.0001  # the chain link (one elementwise op, subtract row 1)
    rows.append(["2 tail scatters, tail[slots, :, pos] (+1 elementwise link)", *chain_cost(write, x, n, rep)])
    shape = (1, 8)
    index = (mx.broadcast_to(slots[:, None], shape), mx.broadcast_to(mx.arange(8, dtype=mx.int32)[None], shape),
             mx.broadcast_to(pos[:, None], shape))

    def write_prepared(y):  # KiviStore.write_decode's form: [B, H_kv] index arrays made once per step
        pool.tail_k[index] = y[:, :8]
        pool.tail_v[index] = y[:, 8:16]
        return y * 1.0001
    rows.append(["2 tail scatters, prepared [B, H_kv] indices (+1 link)", *chain_cost(write_prepared, x, n, rep)])
    rows.append(["flush of one tail in all 36 layers (per flush)", *flush_cost(dtype, rep)])
    return [[name, stats(b), stats(e)] for name, b, e in rows]


def flush_cost(dtype, repeats: int, flushes: int = 32) -> tuple[list[float], list[float]]:
    """(build, eval) seconds of one flush of one sequence in a 36-layer store.

    A decode step pays this whenever a tail fills (every G steps per sequence,
    so about every step at B = 32): build includes flush_layers' host sync on
    the gathered rows, eval the quantization and the scatters.
    """
    store = kv_store_module.KiviStore(36, 8, 128, config=kv_store_module.KVConfig(4, 32, 128),
                                      num_blocks=flushes, num_slots=1, dtype=dtype)
    g, r = store.config.group_size, store.config.residual
    build, ev = [], []
    for rep in range(repeats + 1):
        for i in range(flushes):
            mx.synchronize()
            t0 = time.perf_counter()
            kv_store_module.flush_layers(store.pools, [0], [i], [r + g - 1], bits=4, group_size=g)
            t1 = time.perf_counter()
            mx.eval(store.pools)
            mx.synchronize()
            t2 = time.perf_counter()
            if rep:  # the first round compiles and warms up
                build.append(t1 - t0)
                ev.append(t2 - t1)
    return build, ev


# ---- 2. one decode step, parts left out -------------------------------------------

class Arms:
    """The step arms over one model; each `run(arm)` decodes `steps` tokens for B
    fresh sequences and returns per-step seconds (after `warmup` steps)."""

    def __init__(self, args, model, vocab: int):
        self.args, self.model, self.vocab = args, model, vocab
        self.round = 0
        self.real_plan = kv_store_module.attend_plan
        self.real_write = kv_store_module.KiviStore.write_decode

    def prompts(self, b: int) -> list[list[int]]:
        self.round += 1
        return [mx.random.randint(0, self.vocab, (self.args.context + i,),
                                  key=mx.random.key(1000 * self.round + i)).tolist()
                for i in range(b)]

    def _patch(self, arm: str) -> None:
        stub = lambda *_, **__: (lambda q, pool: q)  # noqa: E731
        kv_store_module.attend_plan = stub if arm in ("no-attend", "no-kv") else self.real_plan
        kv_store_module.KiviStore.write_decode = ((lambda *a, **k: None) if arm == "no-kv" else self.real_write)

    def run(self, arm: str, b: int) -> list[float]:
        self._patch(arm)
        try:
            if arm == "mlxlm":
                return self._mlxlm(self.prompts(b)[0])
            return self._kiviq(arm, b)
        finally:
            self._patch("runner")

    def _mlxlm(self, prompt: list[int]) -> list[float]:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(prompt)[None], cache=cache)
        tok = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(tok)
        times = []
        for i in range(self.args.warmup + self.args.steps):
            t0 = time.perf_counter()
            logits = self.model(tok[:, None], cache=cache)
            tok = mx.argmax(logits[:, -1], axis=-1)
            mx.eval(tok)
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
        return times

    def _kiviq(self, arm: str, b: int) -> list[float]:
        prompts = self.prompts(b)
        n = self.args.warmup + self.args.steps
        engine = prefilled_engine(self.model, ID_TOKENIZER, prompts, n + 2, bits=self.args.bits,
                                  kv_bytes=(self.args.kv_gb << 30) if self.args.kv_gb else None)
        times = []
        if arm == "engine":
            for i in range(n):
                t0 = time.perf_counter()
                engine.step()
                if i >= self.args.warmup:
                    times.append(time.perf_counter() - t0)
            return times
        seqs = list(engine.scheduler.running)
        kvs = [s.kv for s in seqs]
        tok = mx.array([s.generated[-1] for s in seqs])
        for i in range(n):
            t0 = time.perf_counter()
            logits = engine.runner.decode(kvs, tok)
            tok = mx.argmax(logits, axis=-1)
            engine.runner.settle(tok)
            if i >= self.args.warmup:
                times.append(time.perf_counter() - t0)
        return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of all arms")
    p.add_argument("--repeats", type=int, default=5, help="per-op chains")
    p.add_argument("--chain", type=int, default=200, help="ops per chain")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--kv-gb", type=int, default=None, dest="kv_gb",
                   help="KV memory budget (default: the size of the run's tokens at the model's dtype)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--arms", nargs="+", default=["mlxlm", "runner", "no-attend", "no-kv", "engine"])
    p.add_argument("--skip-ops", action="store_true")
    args = p.parse_args()
    from mlx_lm.utils import _get_classes

    dtype = getattr(mx, args.dtype)
    print(f"# {command()}\n# {machine()}; device {mx.default_device()}; attention backend {dispatch.backend()}\n")
    if not args.skip_ops:
        print(f"## Per-op cost, chains of {args.chain} dependent ops x {args.repeats} (us/op, min / median / max)\n")
        print(table(["op", "build us", "eval us"], op_costs(args, dtype)), flush=True)
    cfg = model_args(args.hidden, args.vocab)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    arms = Arms(args, model, args.vocab)
    print(f"\n## One decode step, hidden {args.hidden}, vocab {args.vocab}, {args.dtype}, context {args.context}, "
          f"KIVI {args.bits}-bit; {args.steps} steps x {args.rounds} rounds per arm (ms, min / median / max)\n")
    print(table(["B", "arm", "step ms", "tok/s (median)"], []), flush=True)
    for b in args.batch:
        names = [a for a in args.arms if a != "mlxlm" or b == 1]
        times: dict[str, list[float]] = {a: [] for a in names}
        for r in range(args.rounds + 1):
            for a in (names if r % 2 == 0 else names[::-1]):
                t = arms.run(a, b)
                if r:  # round 0 compiles and warms every arm
                    times[a] += t
        for a in names:
            print(f"| {b} | {a} | {stats(times[a], 1e3)} | {b / statistics.median(times[a]):.0f} |", flush=True)


if __name__ == "__main__":
    main()
