"""The engine's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from kiviq.kernels.layout import check_layout


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
