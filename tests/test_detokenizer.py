"""Streaming detokenizers (engine.detokenizer): the text streamed token by token is the
decode of the tokens, a completion keeps its first space, and a character split across
tokens comes out whole once its last byte arrives."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper

from kiviq.engine.detokenizer import ByteStreamDetokenizer, make_detokenizer, text_reader

TEXTS = [
    "The sky is blue.\nfor i in range(3):\n    print(i)  # café, naïve, Zürich",
    "Emoji 🙂👍🏽 and CJK 日本語の文章, Cyrillic Привет, Greek αβγ, math ∑∫√ and ＦＵＬＬ width.",
    "  two leading spaces, a tab\tand trailing spaces   ",
]


def stream(tokenizer, ids: list[int]) -> list[str]:
    """What the engines emit: one segment per token, then what ``finalize`` releases."""
    d = make_detokenizer(tokenizer)
    out = []
    for token in ids:
        d.add_token(token)
        out.append(d.last_segment)
    d.finalize()
    out.append(d.last_segment)
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_the_stream_is_the_decode_of_its_tokens(smollm2, text):
    _, tokenizer = smollm2
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert isinstance(make_detokenizer(tokenizer), ByteStreamDetokenizer)
    segments = stream(tokenizer, ids)
    assert "".join(segments) == tokenizer.decode(ids) == text
    for n in range(len(ids) + 1):  # every prefix too: nothing emitted is taken back
        assert "".join(stream(tokenizer, ids[:n])) == tokenizer.decode(ids[:n])


def test_a_completion_keeps_its_first_space(smollm2):
    _, tokenizer = smollm2
    prompt = tokenizer.encode("The sky is", add_special_tokens=False)
    both = tokenizer.encode("The sky is blue", add_special_tokens=False)
    assert both[:len(prompt)] == prompt
    assert "".join(stream(tokenizer, both[len(prompt):])) == " blue"


def test_a_character_split_across_tokens_comes_out_whole_and_an_unfinished_one_as_a_replacement(smollm2):
    _, tokenizer = smollm2
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE spells this emoji in several tokens
    segments = stream(tokenizer, ids)
    assert segments[:len(ids) - 1] == [""] * (len(ids) - 1) and segments[len(ids) - 1] == "🙂"
    cut = ids[:-1]  # the completion ended inside the character
    assert "".join(stream(tokenizer, cut)) == tokenizer.decode(cut) == "\ufffd"


def test_a_token_past_the_tokenizers_map_is_spelled_as_mlx_lm_spells_it(smollm2):
    """A model's vocabulary may be padded beyond its tokenizer's (random-weight models
    draw such ids)."""
    _, tokenizer = smollm2
    assert "".join(stream(tokenizer, [len(tokenizer) + 5])) == "!"


def test_special_tokens_keep_their_text(smollm2):
    _, tokenizer = smollm2
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)


def spm_tokenizer() -> TokenizerWrapper:
    """A small SentencePiece-style tokenizer (word marks, byte fallback), as Llama 2 and
    Mistral ship theirs, behind mlx-lm's SPM detokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    pieces = ["\u2581", "\u2581the", "\u2581sky", "\u2581is", "\u2581blue", "\u2581caf", "é", *"abehiklstuy"]
    vocab += [(p, -1.0 - i * 0.01) for i, p in enumerate(pieces)]
    t = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return TokenizerWrapper(hf, SPMStreamingDetokenizer)


@pytest.mark.parametrize("text", ["the sky is blue", "café 🙂 日本 the sky", "a\u2581b"])
def test_sentencepiece_streams_its_decode_with_the_first_space(text):
    tokenizer = spm_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    got = "".join(stream(tokenizer, ids))
    # SentencePiece's decode strips the space its first word mark stands for; a
    # completion keeps it.
    assert got[0] == " " and got[1:] == tokenizer.decode(ids)
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert stream(tokenizer, emoji)[-2:] == ["🙂", ""]


def test_the_engines_reader_streams_what_add_token_and_last_segment_stream(smollm2):
    """text_reader (the batch engine's per-token call): the same segments, for kiviq's
    byte-level detokenizer (its text_of) and for mlx-lm's (add_token, last_segment)."""
    _, tokenizer = smollm2
    naive = TokenizerWrapper(tokenizer._tokenizer, NaiveStreamingDetokenizer)
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False) + [len(tokenizer) + 5]
    for wrapper in (tokenizer, naive):
        d = make_detokenizer(wrapper)
        read = text_reader(d)
        assert (read == d.text_of) if isinstance(d, ByteStreamDetokenizer) else not hasattr(d, "text_of")
        got = [read(token) for token in ids]
        d.finalize()
        assert got + [d.last_segment] == stream(wrapper, ids)


def test_other_tokenizers_keep_mlx_lms_detokenizer(smollm2):
    _, tokenizer = smollm2
    naive = TokenizerWrapper(tokenizer._tokenizer, NaiveStreamingDetokenizer)
    d = make_detokenizer(naive)
    assert isinstance(d, NaiveStreamingDetokenizer)
    ids = tokenizer.encode(TEXTS[0], add_special_tokens=False)
    assert "".join(stream(naive, ids)) == TEXTS[0]


def test_the_token_for_byte_zero_decodes_as_the_tokenizer_decodes_it(smollm2):
    """GPT-2's byte-level spelling writes byte 0 as "Ā"; mlx-lm's BPE detokenizer kept
    the letter, ``tokenizer.decode`` gives U+0000."""
    _, tokenizer = smollm2
    zero = tokenizer.convert_tokens_to_ids("\u0100")
    assert "".join(stream(tokenizer, [zero])) == tokenizer.decode([zero]) == "\x00"
