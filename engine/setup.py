"""Build an engine from user-facing KV options (the worker's CLI flags)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kiviq.engine.batch_engine import Engine
from kiviq.engine.flat_quantized import flat_qmm_requested, flatten_quantized_matmuls
from kiviq.engine.kivi_cache import make_store
from kiviq.engine.kv_store import KVConfig
from kiviq.engine.serial_engine import SerialEngine

DEFAULT_CONTEXT = 8192


def context_length(model: Any, default: int = DEFAULT_CONTEXT) -> int:
    """The model's context window, from its config (mlx-lm ModelArgs)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "context_length", "max_seq_len"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default

KV_BITS_CHOICES = (2, 4, 8, 16)  # 16 = mlx-lm's plain fp16 cache
# Decode block tables of a compiled engine are padded to a multiple of this many
# columns (KiviStore.table_width_multiple): a retrace every 32 blocks (1024 tokens
# at G = 32) instead of every block. Same tokens; on the H200 the B=1 mean step
# went from 7.03 to 6.44 ms (session 8).
COMPILED_TABLE_COLUMNS = 32


def build_engine(model: Any, tokenizer: Any, *, kv_bits: int = 4, kv_group_size: int = 32,
                 kv_residual: int = 128, kv_flush_blocks: int = 1, kv_memory: int | None = None,
                 max_sequences: int = 32, max_batch_tokens: int = 1024,
                 compile_decode: bool | None = None, pipeline: bool = True,
                 flat_qmm: bool | None = None) -> Engine | SerialEngine:
    """The continuous-batching engine over a KIVI store, or for ``kv_bits=16``
    the serial engine on mlx-lm's own fp16 cache (token-exact with mlx-lm).

    Args:
        kv_bits: 2, 4 or 8 for KIVI; 16 for a plain fp16 cache.
        kv_group_size: G, tokens (keys) or channels (values) per quantization group.
        kv_residual: R, the fp16 window of most recent tokens.
        kv_flush_blocks: k, blocks quantized per flush (a tail flushes at R + k*G
            tokens; see KVConfig).
        kv_memory: byte budget of the KV store (default: a quarter of device memory).
        max_sequences: sequences the store holds at once.
        max_batch_tokens: tokens fed to the model per step (decode + prefill).
        compile_decode: replay decode steps through mx.compile (KIVI engine
            only); decode block tables are then padded to COMPILED_TABLE_COLUMNS
            columns, so a step is retraced once per that many blocks. None (the
            default): where MLX computes on a GPU. On a CPU the traces cost more
            than they save (the four-prompt demo on this 2-core machine: 6.0-6.8 s
            compiled against 5.2-5.7 s plain).
        pipeline: build decode step n+1 while step n runs (KIVI engine only;
            a step's events come out one step later).
        flat_qmm: multiply a batch's rows in one quantized matmul per layer
            (engine.flat_quantized; changes `model`'s quantized modules in place).
            None: `KIVIQ_FLAT_QMM` (default on: same tokens, and a 4-bit-weight
            B=32 step 2.4x faster on an H200, docs/benchmarks.md session 11).

    Compiling (on a GPU) and pipelining are on by default: same tokens as plain
    steps (tests, CPU and GPU), and on an H200 they took B=1 decode from
    0.65-0.9x to ~1x mlx-lm's ``stream_generate``; at B=32 the two were within
    their run-to-run spread of each other (docs/benchmarks.md, sessions 7 and 8).
    """
    if kv_bits not in KV_BITS_CHOICES:
        raise ValueError(f"kv_bits must be one of {KV_BITS_CHOICES}, got {kv_bits}")
    if flat_qmm_requested(flat_qmm):
        flatten_quantized_matmuls(model)
    if kv_bits == 16:
        return SerialEngine(model, tokenizer)
    store = make_store(model, KVConfig(kv_bits, kv_group_size, kv_residual, kv_flush_blocks), kv_memory=kv_memory,
                       max_sequences=max_sequences, context=context_length(model))
    if compile_decode is None:
        compile_decode = mx.default_device() == mx.gpu
    if compile_decode:
        store.table_width_multiple = COMPILED_TABLE_COLUMNS
    return Engine(model, tokenizer, store, max_batch_tokens=max_batch_tokens, compile_decode=compile_decode,
                  pipeline=pipeline)
