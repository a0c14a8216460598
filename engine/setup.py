"""Build an engine from one EngineConfig (the worker's CLI flags), and choose
between the KIVI kernels and the reference at start-up."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import mlx.core as mx

from kiviq.engine.batch_engine import Engine
from kiviq.engine.config import EngineConfig
from kiviq.engine.decode_attention import decode_prologue, install_decode_attention
from kiviq.engine.fused_trunk import install_fused_trunk
from kiviq.engine.flat_quantized import flatten_quantized_matmuls
from kiviq.engine.fused_projections import fuse_projections
from kiviq.engine.device_memory import apply_memory_limit, default_kv_memory, total_memory
from kiviq.engine.kivi_cache import attention_shape, make_store, model_dtype, store_sizes
from kiviq.engine.layer_pacer import LAYERS_AHEAD
from kiviq.engine.serial_engine import SerialEngine

log = logging.getLogger("kiviq.engine")

DEFAULT_CONTEXT = 8192
# Decode block tables of a compiled engine are padded to a multiple of this many
# columns (KiviStore.table_width_multiple): a retrace every 32 blocks (1024 tokens
# at G = 32) instead of every block, with the same tokens.
COMPILED_TABLE_COLUMNS = 32


def context_length(model: Any, default: int = DEFAULT_CONTEXT) -> int:
    """The model's context window, from its config (mlx-lm ModelArgs)."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "context_length", "max_seq_len"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


CPU_BATCH_TOKENS = 1024  # a CPU computes a prefill at the same rate in any chunk size
GPU_BATCH_TOKENS = (1024, 16384)  # least and most per step on a GPU
ACTIVATION_SHARE = 0.12  # of device memory, for one step's activations


def activation_bytes_per_token(model: Any) -> int:
    """About what one token of a prefill step keeps alive at its peak: the layers
    a paced forward has queued on the device (``layer_pacer.LAYERS_AHEAD`` and the
    one being built), each holding its residual stream, q/k/v and attention output,
    and its MLP intermediates (gate, up and their product), twice over for the
    allocator's slack, in the model's dtype. For the Qwen3-4B shape in bf16 this is
    534 KiB; an H100 measured 438-579 KiB per token at steps of 4,096 and 16,384
    tokens (docs/performance.md, "What a prefill step holds")."""
    args = model.args
    hidden = args.hidden_size
    inter = getattr(args, "intermediate_size", 4 * hidden)
    layers, n_kv, head_dim = attention_shape(model)
    qkv = (args.num_attention_heads + 2 * n_kv) * head_dim
    one_layer = 2 * model_dtype(model).size * (3 * hidden + qkv + hidden + 3 * inter)
    return (LAYERS_AHEAD + 1) * one_layer


def default_batch_tokens(model: Any, device_memory: int | None = None, on_gpu: bool | None = None) -> int:
    """Tokens per engine step when none is configured: on a GPU, the largest
    power of two whose activations fit ``ACTIVATION_SHARE`` of its memory (the
    device's, also where the engine holds a share of it: 9 GB at most),
    within ``GPU_BATCH_TOKENS`` (16384 at the Qwen3-4B shape on an H200, where
    a prefill forward of 16k tokens runs the matmuls near their peak; 4096 on a
    24 GB GPU); on a CPU, ``CPU_BATCH_TOKENS``."""
    if on_gpu is None:
        on_gpu = mx.default_device() == mx.gpu
    if not on_gpu:
        return CPU_BATCH_TOKENS
    if device_memory is None:
        device_memory = total_memory()
    fit = int(device_memory * ACTIVATION_SHARE) // activation_bytes_per_token(model)
    lo, hi = GPU_BATCH_TOKENS
    tokens = lo
    while tokens * 2 <= min(fit, hi):
        tokens *= 2
    return tokens


CPU_SEQUENCES = 32
GPU_SEQUENCES = (32, 128)  # least and most sequences at once on a GPU
SEQUENCE_TOKENS = 4096  # the sequence length a GPU's default is sized for


def default_max_sequences(model: Any, config: EngineConfig, on_gpu: bool | None = None) -> int:
    """Sequences at once (``--max-active``) when none is configured. On a GPU, as
    many ``SEQUENCE_TOKENS``-token sequences as the KV budget holds (a tail slot and
    its blocks each), within ``GPU_SEQUENCES``: a decode step is host-bound, so a
    larger batch costs little more time per step and makes more tokens (H200,
    Qwen3-4B shape, 4k tokens: 9-14 ms per step at 32 sequences, 19 ms at 128;
    docs/performance.md), and a bulk run of more jobs than the cap waits in line.
    128 at the Qwen3-4B shape on an H200, 32 on a 24 GB GPU. On a CPU,
    ``CPU_SEQUENCES``."""
    if on_gpu is None:
        on_gpu = mx.default_device() == mx.gpu
    if not on_gpu:
        return CPU_SEQUENCES
    sizes = store_sizes(model, config.kv)
    per_sequence = sizes.slot_bytes + -(-SEQUENCE_TOKENS // config.kv_group_size) * sizes.block_bytes
    budget = config.kv_memory if config.kv_memory is not None else default_kv_memory()
    lo, hi = GPU_SEQUENCES
    return max(lo, min(hi, budget // per_sequence))


def kernel_choice(config: EngineConfig, model: Any) -> bool | None:
    """``use_kernel`` for this worker: the config's, unless the kernels'
    start-up self-check (kiviq.kernels.self_check) reports a disagreement with
    the reference for this model's shape, bits and dtype, or fails. Then one
    warning is logged and the worker uses the reference: never wrong tokens.
    """
    if config.use_kernel is False:
        return False
    from kiviq.kernels.self_check import self_check  # here, so a test can put a fake in sys.modules
    _, n_kv, head_dim = attention_shape(model)
    try:
        reason = self_check(bits=config.kv_bits, group_size=config.kv_group_size, head_dim=head_dim,
                            num_q_heads=model.args.num_attention_heads, num_kv_heads=n_kv,
                            dtype=model_dtype(model), residual=config.kv_residual,
                            prologue=decode_prologue(model, rotate=config.kv_rotate))
    except Exception as e:  # noqa: BLE001 - any failure means the kernel is not trusted
        reason = f"self-check raised {type(e).__name__}: {e}"
    if reason is None:
        return config.use_kernel
    log.warning("KIVI kernels disabled, using the reference attention: %s", reason)
    return False


def build_engine(model: Any, tokenizer: Any, config: EngineConfig | None = None,
                 **options: Any) -> Engine | SerialEngine:
    """The continuous-batching engine over a KIVI store, or for ``kv_bits=16``
    the serial engine on mlx-lm's own fp16 cache (token-exact with mlx-lm).

    Args:
        config: the engine's configuration (see EngineConfig).
        **options: EngineConfig fields, instead of ``config`` (tests, benchmarks).

    Compiling (on a GPU) and pipelining give the same tokens as plain steps.
    """
    if config is None:
        config = EngineConfig(**options)
    elif options:
        config = dataclasses.replace(config, **options)
    fuse_projections(model)  # q/k/v and gate/up as one matmul each: fewer ops per step
    install_decode_attention(model)  # split, q/k norms and RoPE of a decode step in one launch (CUDA)
    install_fused_trunk(model)  # residual add + norm, and at one sequence SwiGLU + down, one launch each (CUDA)
    if config.flat_qmm:
        flatten_quantized_matmuls(model)
    # Before any default is sized from device memory: they count on this limit's share.
    config = dataclasses.replace(config, memory_limit=apply_memory_limit(config.memory_limit))
    if config.kv_bits == 16:
        return SerialEngine(model, tokenizer)
    config = dataclasses.replace(config, use_kernel=kernel_choice(config, model))
    if config.max_sequences is None:
        config = dataclasses.replace(config, max_sequences=default_max_sequences(model, config))
    store = make_store(model, config.kv, kv_memory=config.kv_memory, max_sequences=config.max_sequences,
                       context=context_length(model), use_kernel=config.use_kernel)
    if config.max_batch_tokens is None:
        config = dataclasses.replace(config, max_batch_tokens=default_batch_tokens(model))
    compile_decode = config.compile_decode
    if compile_decode is None:
        compile_decode = mx.default_device() == mx.gpu
    if compile_decode:
        store.table_width_multiple = COMPILED_TABLE_COLUMNS
    engine = Engine(model, tokenizer, store, max_batch_tokens=config.max_batch_tokens,
                    compile_decode=compile_decode, pipeline=config.pipeline,
                    prefill_while_decoding=config.prefill_while_decoding)
    engine.config = config
    return engine
