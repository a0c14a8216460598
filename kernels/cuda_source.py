"""The CUDA text handed to `mx.fast.cuda_kernel`: only what a kernel uses, no comments.

The kernels live in kernels/cuda/ (`kivi.cuh`, the shared device helpers, `kivi_prologue.cuh`,
the split kernels' decode prologue, `kivi_mma.cuh`, the tensor-core kernel's, and one `.cu`
file per kernel body) and are read once at import (`read`).

Why it matters: MLX's CUDA `custom_kernel` pastes header + source into a new
string at every call (while the graph is built) and hashes that whole string at
every evaluation (the key of its compiled-module cache). A decode step calls two
attention kernels per layer, so at B = 1 with 36 layers a 27 KB kernel text
was ~1.7 MB of copying and hashing per step, on the host, which is what a B = 1
step waits on. Stripping comments and indentation and keeping only the header
items a kernel reaches (transitively) leaves the compiled code unchanged: the same
tokens reach NVRTC, in the same order, minus declarations nothing references.

The header grammar this relies on (kernels/cuda/kivi.cuh follows it): every
top-level item is a preprocessor line (with backslash continuations) or a
declaration / definition ending at a `;` or `}` at brace depth 0; an item
defines the first `kivi_*` / `KIVI_*` name it mentions; `//` starts a comment
everywhere (no string literal in the CUDA text contains it).
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx

from kiviq.kernels.cuda_device import cuda_available

SOURCE_DIR = Path(__file__).parent

_NAME = re.compile(r"\b(?:kivi|KIVI)_\w+")

# dtype -> its C type in a kernel
CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
              mx.int32: "int32_t", mx.uint8: "uint8_t"}
MLX_DEVICE_HEADERS = "mlx/backend/cuda/device/"  # where MLX's JIT finds its own headers
_PRELUDE = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n"
            "#include <cooperative_groups.h>\n")


def read(name: str) -> str:
    """The text of a kernel source file, e.g. "cuda/kivi.cuh" (relative to kernels/)."""
    return (SOURCE_DIR / name).read_text()


# The headers as one text (kivi_prologue.cuh and kivi_mma.cuh build on kivi.cuh); each kernel
# gets its share.
HEADER = read("cuda/kivi.cuh") + read("cuda/kivi_prologue.cuh") + read("cuda/kivi_mma.cuh")


def cuda_kernel(file: str, *, name: str, input_names, output_names, prologue: str = "",
                bounds: tuple[int, int] | None = None, mlx_headers: tuple[str, ...] = (), **kw):
    """`mx.fast.cuda_kernel` of the kernel body in kernels/cuda/`file` (after
    `prologue`, generated code), compacted, with the items of kernels/cuda/kivi.cuh,
    kivi_prologue.cuh and kivi_mma.cuh it reaches as its header; None where MLX has no
    CUDA backend.
    bounds: (threads per block, blocks per SM) the compiler must fit (`launch_bounds`).
    mlx_headers: MLX's own device headers to include ("unary_ops.cuh": the functors its
    compiled kernels use), which its JIT compiler carries; a kernel that includes one
    rounds exactly as MLX's ops do, in any MLX version."""
    if not cuda_available():
        return None
    source = prologue + read("cuda/" + file)
    header = "".join(f'#include "{MLX_DEVICE_HEADERS}{h}"\n' for h in mlx_headers)
    header += kernel_header(HEADER, source) + (launch_bounds(*bounds) if bounds else "")
    return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                               source=compact(source), header=header, **kw)


def launch_bounds(threads: int, min_blocks: int) -> str:
    """Header text that gives the kernel MLX declares after the header
    `__launch_bounds__(threads, min_blocks)`: registers capped so that `min_blocks`
    blocks of `threads` fit on an SM.

    MLX writes the kernel's signature itself (`__global__ void custom_kernel_...`) and
    passes NVRTC no register limit, so the header redefines `__global__` (CUDA's own
    macro for `__attribute__((global))`) with the bounds appended. It must come last:
    a `__global__` in the header itself would get the bounds too."""
    return ("#undef __global__\n"
            f"#define __global__ __attribute__((global)) __launch_bounds__({threads}, {min_blocks})\n")


def translation_unit(name: str, header: str, source: str, inputs, outputs, template) -> str:
    """The CUDA file MLX's `cuda_kernel` compiles for one instance (as
    mlx/backend/cuda/custom_kernel.cpp writes it), with the standard CUDA headers in
    place of MLX's utils.cuh, which kiviq's kernels do not use: for compiling a kernel
    offline with nvcc (`kernels.cuda_offline`).
    inputs / outputs: (name, dtype) pairs; template: (name, dtype or int) pairs."""
    text = _PRELUDE + header + "namespace mlx::core::cu {\n__global__ void custom_kernel_" + name + "(\n"
    text += "".join(f"    const {CUDA_TYPES[dt]}* {n},\n" for n, dt in inputs)
    text += ",\n".join(f"    {CUDA_TYPES[dt]}* {n}" for n, dt in outputs) + ") {\n"
    for n, v in template:
        text += (f"  using {n} = {CUDA_TYPES[v]};\n" if isinstance(v, mx.Dtype)
                 else f"  constexpr int {n} = {v};\n")
    return text + source + "\n}\n}\n"


def compact(cuda: str) -> str:
    """`cuda` without `//` comments, indentation, trailing blanks or empty lines
    (line breaks stay: preprocessor lines end at them)."""
    lines = (line.split("//", 1)[0].strip() for line in cuda.splitlines())
    return "\n".join(line for line in lines if line) + "\n"


def top_level_items(cuda: str) -> list[str]:
    """Compacted `cuda` cut into its top-level items, in order."""
    items, current, depth = [], [], 0
    for line in compact(cuda).splitlines():
        current.append(line)
        if depth == 0 and line.startswith("#"):
            if not line.endswith("\\"):
                items.append("\n".join(current))
                current = []
            continue
        if current[0].startswith("#"):  # a continued preprocessor line
            if not line.endswith("\\"):
                items.append("\n".join(current))
                current = []
            continue
        depth += line.count("{") - line.count("}")
        if depth == 0 and (line.endswith("}") or line.endswith(";")):
            items.append("\n".join(current))
            current = []
    if current:
        raise ValueError(f"unterminated item at the end of the CUDA header: {current[0]!r}")
    return items


def _defined(item: str) -> str | None:
    head = re.split(r"[{;]", item, maxsplit=1)[0]
    m = _NAME.search(head)
    return m.group(0) if m else None


def kernel_header(header: str, source: str) -> str:
    """The items of `header` that `source` reaches, directly or through other
    items, compacted and in their original order. Items that define no
    kivi name (includes, type aliases) are always kept."""
    items = top_level_items(header)
    defines: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        name = _defined(item)
        if name is not None:
            defines.setdefault(name, []).append(i)
    keep = {i for i, item in enumerate(items) if _defined(item) is None}
    todo = set(_NAME.findall(compact(source)))  # names in code, not in comments
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for i in defines.get(name, ()):
            if i not in keep:
                keep.add(i)
                todo |= set(_NAME.findall(items[i]))
    return "\n".join(items[i] for i in sorted(keep)) + "\n"
