"""The Metal kernels, which no machine here can run, at least parse and instantiate.

kernels/metal/ is written without Apple hardware (its GPU tests skip everywhere here).
This compiles each kernel body, wrapped in a function with the arguments MLX's
`metal_kernel` gives it, as C++17 with stand-ins for Metal's names
(tests/metal_stand_ins.h), and instantiates every template the dispatcher can pick:
a typo, an undeclared name or a type mismatch fails here instead of on a user's Mac.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
METAL = ROOT / "kernels" / "metal"

ATTEND = """template <typename T, typename SD, int D, int G, int BITS, int REP, int NW>
void attend(const device T* q, const device uint8_t* k_codes, const device SD* k_scales, const device SD* k_zeros,
  const device uint8_t* v_codes, const device SD* v_scales, const device SD* v_zeros, const device SD* tail_k,
  const device SD* tail_v, const device int32_t* block_tables, const device int32_t* num_blocks,
  const device int32_t* slots, const device int32_t* tail_lens, const device int32_t* params,
  const device float* qscale_in, device float* part_acc, device float* part_ml,
  uint3 thread_position_in_threadgroup, uint thread_index_in_simdgroup, uint simdgroup_index_in_threadgroup,
  uint3 threadgroup_position_in_grid, uint3 threadgroups_per_grid) {
%s
}
"""
FLUSH = """template <typename SD, int D, int G, int BITS>
void flush(const device SD* rows_k, const device SD* rows_v, const device int32_t* params,
  device uint8_t* k_codes, device SD* k_scales, device SD* k_zeros, device uint8_t* v_codes, device SD* v_scales,
  device SD* v_zeros, uint3 thread_position_in_threadgroup, uint3 threadgroup_position_in_grid) {
%s
}
"""
MERGE = """template <typename T, int D, int REP>
void merge(const device float* part_acc, const device float* part_ml, const device int32_t* params, device T* out,
  uint3 thread_position_in_threadgroup, uint3 threadgroup_position_in_grid) {
%s
}
"""


def instantiations() -> list[str]:
    lines = []
    for sd in ("half", "bfloat16_t"):
        for bits in (2, 4, 8):
            for g, d in ((32, 64), (32, 128), (16, 64), (64, 128)):
                lines.append(f"template void attend<{sd}, {sd}, {d}, {g}, {bits}, 4, 4>(const {sd}*, const uint8_t*, "
                             f"const {sd}*, const {sd}*, const uint8_t*, const {sd}*, const {sd}*, const {sd}*, "
                             f"const {sd}*, const int32_t*, const int32_t*, const int32_t*, const int32_t*, "
                             "const int32_t*, const float*, float*, float*, uint3, uint, uint, uint3, uint3);")
                lines.append(f"template void flush<{sd}, {d}, {g}, {bits}>(const {sd}*, const {sd}*, const int32_t*, "
                             f"uint8_t*, {sd}*, {sd}*, uint8_t*, {sd}*, {sd}*, uint3, uint3);")
        lines.append(f"template void merge<{sd}, 128, 4>(const float*, const float*, const int32_t*, {sd}*, uint3, uint3);")
    return lines


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (no Apple hardware needed)")
def test_metal_kernels_parse_and_instantiate_as_cpp(tmp_path):
    read = lambda name: (METAL / name).read_text()  # noqa: E731
    unit = "\n".join([
        '#include "metal_stand_ins.h"', read("kivi.metal"),
        ATTEND % read("attend_split.metal"), FLUSH % read("flush_quantize.metal"), MERGE % read("attend_merge.metal"),
        *instantiations()])
    src = tmp_path / "metal_kernels.cpp"
    src.write_text(unit)
    r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-unused", f"-I{ROOT / 'tests'}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr[-3000:]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ (no Apple hardware needed)")
def test_metal_lane_order_index_math_matches_the_layout(tmp_path):
    """kivi_lane_k / kivi_lane_v of kivi.metal (the same text as kivi.cuh's, which the
    GPU tests cover), run on the CPU, put every unit where kernels.layout says."""
    from kiviq.kernels.layout import key_lane_positions, value_lane_positions

    cases = [(d, bits) for d in (64, 128) for bits in (2, 4)]
    body = "\n".join(
        f'for (int c = 0; c < {d}; ++c) for (int u = 0; u < 8; ++u) printf("%d ", kivi_lane_k<{d}, {bits}>(c, u));'
        f' printf("\\n");'
        f'for (int t = 0; t < 32; ++t) for (int u = 0; u < {d} / 4; ++u) printf("%d ", kivi_lane_v<{d}, {bits}>(t, u));'
        f' printf("\\n");'
        for d, bits in cases)
    src = tmp_path / "lane_index.cpp"
    src.write_text('#include <cstdio>\n#include "metal_stand_ins.h"\n' + (METAL / "kivi.metal").read_text()
                   + "\nint main() {\n" + body + "\nreturn 0;\n}\n")
    exe = tmp_path / "lane_index"
    subprocess.run(["g++", "-std=c++17", f"-I{ROOT / 'tests'}", str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    lines = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    for i, (d, bits) in enumerate(cases):
        ub = bits // 2
        for line, positions in ((lines[2 * i], key_lane_positions(d, bits)),
                                (lines[2 * i + 1], value_lane_positions(d, bits))):
            units = [int(v) for v in line.split()]
            # positions are bytes; a unit's first byte is at unit index * (bits / 2)
            assert [u * ub for u in units] == list(positions[::ub]), (d, bits)
