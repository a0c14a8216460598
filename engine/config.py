"""The engine's configuration: one frozen object built from the worker's flags
(worker/cli.py) and passed to ``build_engine``, the engine and the store."""

from __future__ import annotations

from dataclasses import dataclass

from kiviq.kernels.layout import check_layout

KV_BITS_CHOICES = (2, 4, 8, 16)  # 16 = mlx-lm's plain fp16 cache
# The worker's --kv-bits values: "2r" is 2-bit with K and V Hadamard-rotated (kv_rotate).
KV_BITS_NAMES = ("2", "2r", "4", "8", "16")


def parse_kv_bits(text: str) -> tuple[int, bool]:
    """A ``--kv-bits`` value -> (kv_bits, kv_rotate): '2r' -> (2, True), '4' -> (4, False).

    Raises:
        ValueError: not one of KV_BITS_NAMES.
    """
    name = str(text).strip().lower()
    if name not in KV_BITS_NAMES:
        raise ValueError(f"kv_bits must be one of {', '.join(KV_BITS_NAMES)} (2r: 2-bit with K and V "
                         f"Hadamard-rotated), got {text!r}")
    return int(name.rstrip("r")), name.endswith("r")


@dataclass(frozen=True, slots=True)
class KVConfig:
    """KIVI parameters: bits b, group size G, residual length R, and k, the
    blocks quantized per flush.

    A sequence's fp16 tail flushes when it reaches R + k*G tokens: its oldest
    k*G tokens become k blocks, so past its first R tokens the tail holds R to
    R + k*G - 1 tokens. k = 1 is DESIGN.md's rule. A flush costs the same graph
    nodes per layer whatever the number of blocks, and with B sequences of
    unrelated lengths some sequence flushes in most steps when k = 1; k > 1
    makes each sequence flush k times less often. When a sequence flushes
    depends only on its own length, so a batch still decodes exactly as its
    sequences would alone. Each tail holds (k - 1) * G more rows.
    """

    bits: int = 4
    group_size: int = 32
    residual: int = 128
    flush_blocks: int = 1
    # The cache lives in a rotated basis: K and V (and q) are multiplied by the
    # normalized Hadamard matrix along head_dim before anything is stored, and
    # the attention output is rotated back (engine.kivi_cache, kernels.rotation;
    # on CUDA inside the decode prologue and attention kernels).
    # Pools, flushes and kernels are those of `bits`; only the values differ.
    rotate: bool = False

    def __post_init__(self):
        check_layout(self.bits, self.group_size)
        if self.residual < self.group_size or self.residual % self.group_size:
            raise ValueError(f"residual ({self.residual}) must be a positive multiple of group_size")
        if self.flush_blocks < 1:
            raise ValueError(f"flush_blocks ({self.flush_blocks}) must be >= 1")

    @property
    def flush_tokens(self) -> int:
        """Tokens one flush quantizes: k * G."""
        return self.flush_blocks * self.group_size

    @property
    def label(self) -> str:
        """The bit width as ``--kv-bits`` names it: '2r' for rotated 2-bit, else the bits."""
        return f"{self.bits}{'r' if self.rotate else ''}"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything ``build_engine`` needs besides the model and tokenizer.

    Args:
        kv_bits: 2, 4 or 8 for KIVI; 16 for a plain fp16 cache (serial engine).
        kv_rotate: with kv_bits=2, Hadamard-rotate K and V along head_dim before
            quantization (``--kv-bits 2r``; see KVConfig.rotate and
            ``parse_kv_bits``). Needs a power-of-two head_dim.
        kv_group_size: G, tokens (keys) or channels (values) per quantization group.
        kv_residual: R, the fp16 window of most recent tokens (a multiple of G).
        kv_flush_blocks: k, blocks quantized per flush (see KVConfig).
        kv_memory: byte budget of the KV store; None: a quarter of device memory
            (``engine.device_memory.default_kv_memory``).
        memory_limit: bytes of device memory the engine's process may hold (its
            model, KV store, working buffers and MLX's cache; MLX's memory limit);
            None: on a GPU, what the process holds plus what the device has free
            when the engine is built, at most MLX's own limit
            (``engine.device_memory.apply_memory_limit``).
        max_sequences: sequences the store holds at once; None: chosen for the
            device and the KV budget (``engine.setup.default_max_sequences``).
        max_batch_tokens: tokens fed to the model per step (decode + prefill);
            None: chosen for the device (``engine.setup.default_batch_tokens``).
        prefill_while_decoding: prompt tokens a step prefills at most while
            sequences decode, so that a burst of long prompts delays running
            sequences by at most that many tokens per step; None: no cap (a step
            may prefill all max_batch_tokens leaves).
        compile_decode: replay decode steps through mx.compile; None: where MLX
            computes on a GPU (on a CPU the traces cost more than they save).
        pipeline: build decode step n+1 while step n runs (events one step later).
        flat_qmm: multiply a batch's rows in one quantized matmul per layer
            (engine.flat_quantized; changes the model's quantized modules in place).
        use_kernel: None: the KIVI kernels where they run; False: the plain-ops
            reference (every kernels.dispatch call gets it).
    """

    kv_bits: int = 4
    kv_rotate: bool = False
    kv_group_size: int = 32
    kv_residual: int = 128
    kv_flush_blocks: int = 1
    kv_memory: int | None = None
    memory_limit: int | None = None
    max_sequences: int | None = None
    max_batch_tokens: int | None = None
    prefill_while_decoding: int | None = None
    compile_decode: bool | None = None
    pipeline: bool = True
    flat_qmm: bool = True
    use_kernel: bool | None = None

    def __post_init__(self):
        if self.kv_bits not in KV_BITS_CHOICES:
            raise ValueError(f"kv_bits must be one of {KV_BITS_CHOICES}, got {self.kv_bits}")
        if self.kv_rotate not in (False, True):
            raise ValueError(f"kv_rotate must be a bool, got {self.kv_rotate!r}")
        if self.kv_rotate and self.kv_bits != 2:
            raise ValueError(f"kv_rotate (kv_bits 2r) is a 2-bit setting, got kv_bits={self.kv_bits}")
        if self.kv_group_size < 1:
            raise ValueError(f"kv_group_size must be >= 1, got {self.kv_group_size}")
        if self.kv_residual < self.kv_group_size or self.kv_residual % self.kv_group_size:
            raise ValueError(f"kv_residual ({self.kv_residual}) must be a positive multiple of "
                             f"kv_group_size ({self.kv_group_size})")
        if self.kv_flush_blocks < 1:
            raise ValueError(f"kv_flush_blocks must be >= 1, got {self.kv_flush_blocks}")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise ValueError(f"kv_memory must be a positive byte count or None, got {self.kv_memory}")
        if self.memory_limit is not None and self.memory_limit < 1:
            raise ValueError(f"memory_limit must be a positive byte count or None, got {self.memory_limit}")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.max_batch_tokens is not None and self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.prefill_while_decoding is not None and self.prefill_while_decoding < 1:
            raise ValueError(f"prefill_while_decoding must be >= 1, got {self.prefill_while_decoding}")
        if self.use_kernel not in (None, False):
            raise ValueError(f"use_kernel must be None (kernels where they run) or False, got {self.use_kernel!r}")
        if self.kv_bits != 16:
            try:
                check_layout(self.kv_bits, self.kv_group_size)
            except ValueError as e:
                raise ValueError(f"kv_bits / kv_group_size: {e}") from e

    @property
    def kv(self) -> KVConfig:
        """The KIVI parameters (KIVI configurations only)."""
        return KVConfig(self.kv_bits, self.kv_group_size, self.kv_residual, self.kv_flush_blocks,
                        rotate=self.kv_rotate)

    @property
    def kv_label(self) -> str:
        """The cache as ``--kv-bits`` names it: '2', '2r', '4', '8' or '16'."""
        return f"{self.kv_bits}{'r' if self.kv_rotate else ''}"
