"""Rebuild a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata.

A GGUF file carries no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges,
the token types and the special token ids as metadata. This module turns them back into
the two files `transformers.AutoTokenizer` (and so `mlx_lm.load`) reads.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: that is what the
embedded SmolLM2 model and most modern llama-architecture GGUFs use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (gguf.TokenType).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (see llama-vocab.cpp)."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell"):
        # llama.cpp runs `\p{N}` first (every digit its own piece), then the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama3", "llama-bpe", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # "gpt2", "default" and unknown names: plain GPT-2 splitting. Unknown names may be off
    # for some inputs; a wrong split only costs tokenization fidelity, never a crash.
    return byte_level


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """Build a `tokenizers.Tokenizer` equivalent to the one llama.cpp builds from `metadata`.

    Args:
        metadata: GGUF metadata as returned by `mx.load(path, return_metadata=True)`.

    Returns:
        A byte-level BPE tokenizer whose CONTROL tokens are special added tokens and whose
        USER_DEFINED tokens are plain added tokens (both are matched whole in the text).

    Raises:
        ValueError: if the GGUF tokenizer is not byte-level BPE.
    """
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is supported")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("GGUF vocabulary has duplicate tokens")
    # Byte-level tokens never contain a literal space (it is spelled 'Ġ'), so one split is safe.
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # Affects offsets only; mirrors what HF byte-level tokenizers ship.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    types = [int(t) for t in metadata.get("tokenizer.ggml.token_type", [])]
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    # Tokens already in the vocabulary keep their ids, so this does not grow the vocab.
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok


def _token(metadata: dict[str, Any], key: str) -> str | None:
    value = metadata.get(f"tokenizer.ggml.{key}")
    return None if value is None else metadata["tokenizer.ggml.tokens"][int(value.item())]


def tokenizer_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer_config.json` contents for the GGUF's tokenizer.

    Special tokens come from the `tokenizer.ggml.*_token_id` keys; `add_bos_token` and
    `add_eos_token` are taken from the metadata (False when absent: byte-level BPE models
    rarely add them, and the chat template writes its own markers).
    """
    config: dict[str, Any] = {
        # The plain tokenizers-backed class: it uses tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token = _token(metadata, key)
        if token is not None:
            config[name] = token
    arch = metadata.get("general.architecture", "llama")
    if f"{arch}.context_length" in metadata:
        config["model_max_length"] = int(metadata[f"{arch}.context_length"].item())
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer_files(metadata: dict[str, Any], out_dir: str | Path) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for `metadata` into `out_dir`."""
    out = Path(out_dir)
    build_tokenizer(metadata).save(str(out / "tokenizer.json"))
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(metadata), f, indent=2, ensure_ascii=False)
