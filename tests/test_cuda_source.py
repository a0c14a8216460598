"""The CUDA text kiviq hands to MLX (kernels.cuda_source): smaller, and the same code.

The nvcc tests compile every kernel source file (kernels/cuda/) both ways and compare
the PTX; they run where nvcc is installed (no GPU needed) and are skipped elsewhere.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import shutil

import mlx.core as mx
import pytest

from kiviq.kernels.cuda_flush import layer_prologue
from kiviq.kernels.cuda_offline import compile_and_count, find_cuobjdump, ptx_code, split_mma_unit
from kiviq.kernels.cuda_source import HEADER, SOURCE_DIR, compact, kernel_header, read, top_level_items, translation_unit
from kiviq.kernels.launch import MMA_BLOCKS_PER_SM, POOL_NAMES, WARPS

SOURCES = {"split_mma": read("cuda/attend_split_mma.cu"), "split": read("cuda/attend_split.cu"),
           "merge": read("cuda/attend_merge.cu"), "flush": read("cuda/flush_quantize.cu"),
           "flush_fused": read("cuda/flush_fused.cu"),
           "write_blocks": read("cuda/write_blocks.cu"), "add_rms_norm": read("cuda/add_rms_norm.cu"),
           "swiglu_down": read("cuda/swiglu_down.cu")}
NAME = re.compile(r"\b(?:kivi|KIVI)_\w+")


@functools.lru_cache(maxsize=None)
def _compiled() -> dict:
    """(registers, opcode counts of the block loop) of the MMA kernel at D = 128, REP = 4,
    per (pool dtype, bits), under the product's launch bounds
    (`launch.MMA_BLOCKS_PER_SM`): compiled once for all the tests that read them, in
    parallel (nvcc and cuobjdump are subprocesses, ~2.5 s each)."""
    keys = [(dtype, bits) for dtype in (mx.float16, mx.bfloat16) for bits in (2, 4)]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as ex:
        jobs = {k: ex.submit(compile_and_count, split_mma_unit(k[0], k[1], 128, 4, MMA_BLOCKS_PER_SM.get(k)),
                             find_cuobjdump(), None)
                for k in keys}
        return {k: job.result() for k, job in jobs.items()}


def block_loop(dtype: mx.Dtype, bits: int):
    return _compiled()[dtype, bits][1]


def test_compact_drops_comments_and_indentation_but_keeps_line_breaks():
    text = ("// a comment\n#define A(x) \\\n    (x + 1)  // trailing\n\n"
            "__device__ int f() {\n    return A(2);  // why\n}\n")
    assert compact(text) == "#define A(x) \\\n(x + 1)\n__device__ int f() {\nreturn A(2);\n}\n"


def test_items_split_at_depth_zero():
    text = ("#define KIVI_X 1\n#define KIVI_M \\\n  int a; \\\n  int b;\n"
            "template <typename T> __device__ T kivi_g(float x);\n"
            "template <int B>\n__device__ int kivi_h(int x) {\n  if (x) { return B; }\n  return kivi_g<int>(x);\n}\n")
    assert top_level_items(text) == [
        "#define KIVI_X 1", "#define KIVI_M \\\nint a; \\\nint b;",
        "template <typename T> __device__ T kivi_g(float x);",
        "template <int B>\n__device__ int kivi_h(int x) {\nif (x) { return B; }\nreturn kivi_g<int>(x);\n}"]
    with pytest.raises(ValueError, match="unterminated"):
        top_level_items("__device__ int kivi_f() {\n  return 1;\n")


def test_every_header_item_is_a_whole_declaration():
    items = top_level_items(HEADER)
    assert compact("\n".join(items)) == compact(HEADER)  # nothing lost or reordered
    for item in items:
        assert item.startswith("#") or item.endswith(("}", ";")), item


@pytest.mark.parametrize("kernel", sorted(SOURCES))
def test_kernel_header_defines_everything_the_kernel_reaches(kernel):
    source = SOURCES[kernel]
    header = kernel_header(HEADER, source)
    assert len(header) + len(compact(source)) < 0.7 * (len(HEADER) + len(source))
    defined = {m for item in top_level_items(header) for m in NAME.findall(re.split(r"[{;]", item)[0])[:1]}
    used = set(NAME.findall(compact(source))) | set(NAME.findall(header))
    assert used <= defined, used - defined
    assert kernel_header(header, source) == header  # closed: pruning again drops nothing


def test_every_kernel_source_file_is_tested():
    assert {p.name for p in (SOURCE_DIR / "cuda").glob("*.cu")} == {
        "attend_split_mma.cu", "attend_split.cu", "attend_merge.cu", "flush_quantize.cu", "flush_fused.cu",
        "write_blocks.cu", "add_rms_norm.cu", "swiglu_down.cu"}


def test_merge_and_flush_leave_the_split_machinery_out():
    for source in (SOURCES["merge"], SOURCES["flush"], SOURCES["write_blocks"]):
        header = kernel_header(HEADER, source)
        assert "kivi_mma" not in header and "kivi_tail_attend" not in header


# ---- the same PTX, compiled with nvcc (no GPU needed) ----------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed (no GPU needed, only the compiler)")
def test_pruned_compact_kernels_compile_to_the_same_ptx(tmp_path):
    """(swiglu_down is not here: it includes MLX's own device headers, which only MLX's
    JIT compiler carries.)"""
    bf, u8, f32, i32 = mx.bfloat16, mx.uint8, mx.float32, mx.int32
    pool = list(zip(POOL_NAMES, [u8, bf, bf, u8, bf, bf, bf, bf]))
    attend_in = [("q", bf), *pool, ("block_tables", i32), ("num_blocks", i32), ("slots", i32),
                 ("tail_lens", i32), ("params", i32), ("qscale_in", f32), ("k_new", bf), ("v_new", bf),
                 ("q_norm", bf), ("k_norm", bf), ("offsets", i32), ("rope", f32)]
    attend_out = [("part_acc", f32), ("part_ml", f32)]
    cases = [
        ("split_mma", attend_in, attend_out,
         [("T", bf), ("SD", bf), ("D", 128), ("G", 32), ("BITS", 4), ("REP", 4), ("NW", 4), ("PRO", 0),
          ("NORM", 0), ("ROT_IN", 0)]),
        ("split_mma", [(n, mx.float16 if dt == bf else dt) for n, dt in attend_in], attend_out,
         [("T", mx.float16), ("SD", mx.float16), ("D", 64), ("G", 32), ("BITS", 2), ("REP", 8), ("NW", 4),
          ("PRO", 1), ("NORM", 0), ("ROT_IN", 1)]),
        ("split_mma", attend_in, attend_out,  # the decode prologue inside (Qwen3's q/k norms)
         [("T", bf), ("SD", bf), ("D", 128), ("G", 32), ("BITS", 4), ("REP", 4), ("NW", 4), ("PRO", 1),
          ("NORM", 1), ("ROT_IN", 0)]),
        ("split_mma", [(n, f32 if n in ("q", "q_norm", "k_norm") else dt) for n, dt in attend_in], attend_out,
         [("T", f32), ("SD", bf), ("D", 64), ("G", 32), ("BITS", 4), ("REP", 2), ("NW", 4), ("PRO", 0),
          ("NORM", 0), ("ROT_IN", 0)]),
        ("split", attend_in, attend_out,
         [("T", bf), ("SD", bf), ("D", 64), ("G", 16), ("BITS", 8), ("REP", 3), ("NW", 4), ("PRO", 1),
          ("NORM", 1), ("ROT_IN", 1)]),
        ("split", attend_in, attend_out,  # D = 256: no prologue (it is instantiated for D 64 only)
         [("T", bf), ("SD", bf), ("D", 256), ("G", 32), ("BITS", 8), ("REP", 2), ("NW", 4), ("PRO", 0),
          ("NORM", 0), ("ROT_IN", 0)]),
        ("merge", [("part_acc", f32), ("part_ml", f32), ("params", i32)], [("out", bf)],
         [("T", bf), ("D", 128), ("REP", 4), ("MAX_SPLITS", 1024), ("MERGE_WARPS", 16), ("ROTATE", 0)]),
        ("merge", [("part_acc", f32), ("part_ml", f32), ("params", i32)], [("out", mx.float16)],
         [("T", mx.float16), ("D", 64), ("REP", 3), ("MAX_SPLITS", 1024), ("MERGE_WARPS", 16), ("ROTATE", 1)]),
        ("merge", [("part_acc", f32), ("part_ml", f32), ("params", i32)], [("out", f32)],  # float32 queries
         [("T", f32), ("D", 64), ("REP", 2), ("MAX_SPLITS", 1024), ("MERGE_WARPS", 16), ("ROTATE", 0)]),
        ("flush", [("rows_k", bf), ("rows_v", bf), ("params", i32)], pool[:6],
         [("SD", bf), ("D", 128), ("G", 32), ("BITS", 2)]),
        ("flush_fused", [(f"{n}_{layer}", dt) for layer in range(3) for n, dt in pool]
         + [("slots", i32), ("ids", i32), ("params", i32)],
         [("done", i32)], [("SD", bf), ("D", 128), ("G", 32), ("BITS", 4)]),
        ("write_blocks", [*pool[:6], ("keys", bf), ("values", bf), ("first", i32), ("ids", i32), ("params", i32)],
         [("done", i32)], [("SD", bf), ("D", 128), ("G", 32), ("BITS", 2)]),
        ("add_rms_norm", [("x", bf), ("r", bf), ("w", bf)], [("h", bf), ("y", bf)],
         [("T", bf), ("N", 2560), ("BLOCK", 64), ("CHUNKS", 5), ("EPS_BITS", 897988541)]),
        ("add_rms_norm", [("x", mx.float16), ("r", mx.float16), ("w", mx.float16)],
         [("h", mx.float16), ("y", mx.float16)],
         [("T", mx.float16), ("N", 576), ("BLOCK", 128), ("CHUNKS", 1), ("EPS_BITS", 897988541)]),
    ]

    def ptx(i: int, pruned: bool) -> list[str]:
        kernel, inputs, outputs, template = cases[i]
        source = layer_prologue(3) + SOURCES[kernel] if kernel == "flush_fused" else SOURCES[kernel]
        header, text = (kernel_header(HEADER, source), compact(source)) if pruned else (HEADER, source)
        return ptx_code(translation_unit(kernel, header, text, inputs, outputs, template), str(tmp_path),
                        f"{kernel}_{i}_{'small' if pruned else 'full'}")

    # Two nvcc runs per case, independent: in parallel (nvcc is a subprocess).
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool_:
        jobs = {(i, pruned): pool_.submit(ptx, i, pruned) for i in range(len(cases)) for pruned in (False, True)}
        for i, (kernel, *_rest) in enumerate(cases):
            assert jobs[i, False].result() == jobs[i, True].result(), kernel


@pytest.mark.skipif(shutil.which("nvcc") is None or find_cuobjdump() is None,
                    reason="needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump); no GPU")
def test_the_block_loop_never_dequantizes():
    """The MMA kernel's block loop (kernels.cuda_offline) at both pool dtypes and bits:
    no HSUB2 / HFMA2 (counted as HADD2 / HFMA2; dequantizing took 128 of each per
    D = 128 tile), the scales on the other operand (32 HMUL2); bf16's code offsets cost
    exactly two MMAs per k-tile pair more (tk and tv: 16), nothing else."""
    for bits in (2, 4):
        loops = {dtype: block_loop(dtype, bits) for dtype in (mx.float16, mx.bfloat16)}
        for dtype, loop in loops.items():
            assert loop["HFMA2"] == 0 and loop["HADD2"] == 0 and loop["HMUL2"] == 32, (bits, dtype)
        assert loops[mx.bfloat16]["HMMA"] == loops[mx.float16]["HMMA"] + 16, bits


@pytest.mark.skipif(shutil.which("nvcc") is None or find_cuobjdump() is None,
                    reason="needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump); no GPU")
def test_launch_bounds_hold_the_mma_kernel_to_its_blocks_per_sm():
    """The header's `__launch_bounds__` (cuda_source.launch_bounds, which MLX cannot be
    given otherwise: it writes the kernel's signature itself) reaches the kernel: bounded
    to 4 blocks per SM, bf16 4-bit fits 128 registers where it takes 162 without; and the
    product's bounded kernels (launch.MMA_BLOCKS_PER_SM) fit their blocks of WARPS warps
    in an SM's 65,536 registers."""
    cuobjdump = find_cuobjdump()
    free, _ = compile_and_count(split_mma_unit(mx.bfloat16, 4, 128, 4), cuobjdump, None)
    held, _ = compile_and_count(split_mma_unit(mx.bfloat16, 4, 128, 4, 4), cuobjdump, None)
    assert held * WARPS * 32 * 4 <= 65536 < free * WARPS * 32 * 4, (held, free)
    for (dtype, bits), blocks in MMA_BLOCKS_PER_SM.items():
        registers = _compiled()[dtype, bits][0]
        assert registers * WARPS * 32 * blocks <= 65536, (dtype, bits, blocks, registers)


@pytest.mark.skipif(shutil.which("nvcc") is None or find_cuobjdump() is None,
                    reason="needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump); no GPU")
def test_lane_order_loads_a_lanes_codes_as_words():
    """The pool is in lane order at 2 and 4 bits (kernels.layout): a lane reads its K
    and V codes of a block as 16-byte words (2 or 4 per tile at D = 128), each k-tile's
    four key scales (zeros) as one 8-byte word, and joins nothing: the plain layout cost
    one 1- or 2-byte load per channel and code pair (113 shared loads per block at D =
    128) and 32 PRMTs joining them."""
    for bits in (2, 4):
        for dtype in (mx.float16, mx.bfloat16):
            loop = block_loop(dtype, bits)
            assert loop["LDS"] <= 48 and loop["PRMT"] == 0, (bits, dtype, loop["LDS"], loop["PRMT"])
