"""Streaming detokenizers: a completion's text as its tokens arrive, equal to the
decode of its tokens.

Byte-level BPE vocabularies (GPT-2 style: SmolLM2, Llama 3, Qwen) and SentencePiece
ones spell every token as bytes. A request's text is then its tokens' bytes through
one incremental UTF-8 decoder: a character split across tokens comes out whole with
its last byte, and bytes that can never be UTF-8 come out as U+FFFD, as
``tokenizer.decode`` gives them. The token -> bytes table is built once per tokenizer
(from mlx-lm's token map); a token then costs a list index and one decoder call.

Why not mlx-lm's streaming detokenizers as they are: they drop the first space of a
generation (right for a chat answer shown alone, wrong for a completion appended to
its prompt: "The sky is" + " blue"), re-decode what they hold back, and grow each
request's whole text by concatenation, which copies it at every token (quadratic over
a long completion). A decode step's events are host time the GPU waits for.

Tokenizers of any other kind keep mlx-lm's detokenizer (it re-decodes the line so far).
"""

from __future__ import annotations

import codecs
import weakref
from typing import Any, Callable

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

# What mlx-lm's BPE detokenizer spells a token past its token map as (a model's
# vocabulary padded beyond its tokenizer's).
_PAST_THE_MAP = b"!"
_SPM_SPACE = "\u2581".encode()


class ByteStreamDetokenizer:
    """One request's text from tokens whose bytes ``pieces`` holds (shared, read-only).

    The interface the engines use of mlx-lm's detokenizers: ``add_token``,
    ``last_segment`` (the text since it was last read), ``finalize``."""

    __slots__ = ("_pieces", "_decode", "_segment")

    def __init__(self, pieces: list[bytes]):
        self._pieces = pieces
        self._decode = codecs.getincrementaldecoder("utf-8")("replace").decode
        self._segment = ""

    def add_token(self, token: int) -> None:
        self._segment = self.text_of(token)

    @property
    def last_segment(self) -> str:
        segment, self._segment = self._segment, ""
        return segment

    def text_of(self, token: int) -> str:
        """``add_token`` then ``last_segment`` in one call: the engine's path for
        every generated token (one method call instead of two and no concatenation)."""
        pieces = self._pieces
        text = self._decode(pieces[token] if token < len(pieces) else _PAST_THE_MAP)
        if self._segment:
            text, self._segment = self._segment + text, ""
        return text

    def finalize(self) -> None:
        """Bytes of a character the completion never finished come out as U+FFFD."""
        self._segment += self._decode(b"", True)


def bpe_pieces(tokenmap: list[str]) -> list[bytes]:
    """Byte-level BPE tokens (GPT-2's printable spelling of bytes) as bytes; characters
    outside that spelling (an added token's text) as their UTF-8."""
    byte_of = _byte_decoder()
    return [b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode() for c in token) for token in tokenmap]


def spm_pieces(tokenmap: list[bytes]) -> list[bytes]:
    """SentencePiece tokens (mlx-lm's map: byte tokens already bytes) with each token's
    word marks as spaces, token by token as ``tokenizer.decode`` does."""
    return [t.replace(_SPM_SPACE, b" ") for t in tokenmap]


def _pieces(tokenizer: Any) -> list[bytes] | None:
    """The token -> bytes table of an mlx-lm TokenizerWrapper, or None where its
    detokenizer is not a byte-level BPE or SentencePiece one."""
    probe = tokenizer.detokenizer
    if isinstance(probe, BPEStreamingDetokenizer):
        return bpe_pieces(probe.tokenmap)
    if isinstance(probe, SPMStreamingDetokenizer):
        return spm_pieces(probe.tokenmap)
    return None


_TABLES: "weakref.WeakKeyDictionary[Any, list[bytes] | None]" = weakref.WeakKeyDictionary()


def text_reader(detokenizer: Any) -> Callable[[int], str]:
    """token -> the text it completes (``add_token``, then ``last_segment``), for any
    detokenizer ``make_detokenizer`` returns."""
    text_of = getattr(detokenizer, "text_of", None)
    if text_of is not None:
        return text_of

    def read(token: int) -> str:
        detokenizer.add_token(token)
        return detokenizer.last_segment

    return read


def make_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for an mlx-lm TokenizerWrapper (the token table is
    built at a tokenizer's first request: ~80 ms for a 49k vocabulary)."""
    try:
        pieces = _TABLES[tokenizer]
    except KeyError:
        pieces = _TABLES[tokenizer] = _pieces(tokenizer)
    except TypeError:  # an object that takes no weak reference: nothing kept
        pieces = _pieces(tokenizer)
    return tokenizer.detokenizer if pieces is None else ByteStreamDetokenizer(pieces)
