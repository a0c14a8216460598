"""Scratch: run B sequences of the Qwen3-4B shape to decode, then N engine steps
between cudaProfilerStart/Stop (for nsys), timing them."""
import ctypes, glob, os, sys, time
import mlx.core as mx
sys.path.insert(0, os.getcwd())
from benchmarks.engine import SHAPES
from benchmarks.engine_host import _ID_TOKENIZER as TOK
from engine import Request, build_engine
from mlx_lm.utils import _get_classes

B, CTX, N = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
cfg = dict(SHAPES["qwen3-4b"]); mc, ac = _get_classes(cfg); mx.random.seed(0)
model = mc(ac.from_dict(cfg)); model.set_dtype(mx.bfloat16); mx.eval(model.parameters())
V = cfg["vocab_size"]
prompts = [mx.random.randint(0, V, (CTX + i,), key=mx.random.key(i)).tolist() for i in range(B)]
tokens = sum(map(len, prompts)) + B * (N + 20)
eng = build_engine(model, TOK, kv_bits=4, max_sequences=B, kv_memory=tokens * 36 * 8 * 128 * 4,
                   max_batch_tokens=1 << 16)
for i, p in enumerate(prompts):
    eng.add(Request(str(i), p, N + 16))
while eng.stats["prefill_tokens"] < sum(map(len, prompts)):
    eng.step()
for _ in range(8):
    eng.step()
mx.synchronize()
lib = None
for cand in ["libcudart.so", "libcudart.so.13", "libcudart.so.12"] + glob.glob("/usr/local/cuda*/lib64/libcudart.so*") + glob.glob("/usr/local/lib/python3*/dist-packages/nvidia/*/lib/libcudart.so*"):
    try:
        lib = ctypes.CDLL(cand); break
    except OSError:
        pass
print("cudart", lib)
if lib: lib.cudaProfilerStart()
t0 = time.perf_counter()
ts = []
for _ in range(N):
    a = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - a)
mx.synchronize()
t1 = time.perf_counter()
if lib: lib.cudaProfilerStop()
ts.sort()
print(f"B={B} ctx={CTX}: {N} steps, {(t1-t0)/N*1e3:.2f} ms/step wall; per-step min/med/max "
      f"{ts[0]*1e3:.2f}/{ts[len(ts)//2]*1e3:.2f}/{ts[-1]*1e3:.2f} ms")
