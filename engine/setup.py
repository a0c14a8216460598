"""Build an engine from one EngineConfig (the worker's CLI flags), and choose
between the KIVI kernels and the reference at start-up."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import mlx.core as mx

from kiviq.engine.batch_engine import Engine
from kiviq.engine.config import EngineConfig
from kiviq.engine.flat_quantized import flatten_quantized_matmuls
from kiviq.engine.kivi_cache import attention_shape, make_store, model_dtype
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
                            dtype=model_dtype(model), residual=config.kv_residual)
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
    if config.flat_qmm:
        flatten_quantized_matmuls(model)
    if config.kv_bits == 16:
        return SerialEngine(model, tokenizer)
    config = dataclasses.replace(config, use_kernel=kernel_choice(config, model))
    store = make_store(model, config.kv, kv_memory=config.kv_memory, max_sequences=config.max_sequences,
                       context=context_length(model), use_kernel=config.use_kernel)
    compile_decode = config.compile_decode
    if compile_decode is None:
        compile_decode = mx.default_device() == mx.gpu
    if compile_decode:
        store.table_width_multiple = COMPILED_TABLE_COLUMNS
    engine = Engine(model, tokenizer, store, max_batch_tokens=config.max_batch_tokens,
                    compile_decode=compile_decode, pipeline=config.pipeline)
    engine.config = config
    return engine
