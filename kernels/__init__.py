"""KIVI kernels: storage layout, plain-ops reference, CUDA/Metal kernels, dispatch."""

from kiviq.kernels.dispatch import decode_attend, flush, kernel_available
from kiviq.kernels.kivi_quant import (
    blocks_to_tokens,
    dequantize_key_blocks,
    dequantize_value_blocks,
    pack,
    quantize_key_blocks,
    quantize_value_blocks,
    tokens_to_blocks,
    unpack,
)
from kiviq.kernels.kivi_reference import decode_attention, decode_attention_dense, flush_tails
from kiviq.kernels.layout import KiviPool, allocate_pool, check_layout
from kiviq.kernels.self_check import self_check

__all__ = [
    "KiviPool",
    "allocate_pool",
    "blocks_to_tokens",
    "check_layout",
    "decode_attend",
    "decode_attention",
    "decode_attention_dense",
    "dequantize_key_blocks",
    "dequantize_value_blocks",
    "flush",
    "flush_tails",
    "kernel_available",
    "pack",
    "quantize_key_blocks",
    "quantize_value_blocks",
    "self_check",
    "tokens_to_blocks",
    "unpack",
]
