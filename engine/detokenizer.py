"""Streaming detokenizers that keep a completion's leading space.

mlx-lm's BPE and SentencePiece streaming detokenizers drop the first space of
a generation (right for a chat answer shown alone, wrong for a completion
appended to its prompt: "The sky is" + " blue"). kiviq's text must equal the
decode of its tokens, so it uses the same detokenizers without that trim.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer


class _KeepSpaceBPE(BPEStreamingDetokenizer):
    def _maybe_trim_space(self, current_text: str) -> str:
        return current_text


def make_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer for an mlx-lm TokenizerWrapper.

    Starts from the wrapper's own per-request copy, which shares the
    vocabulary-sized token map (building a new one costs ~0.4 s).
    """
    detok = tokenizer.detokenizer
    if type(detok) is BPEStreamingDetokenizer:
        detok.__class__ = _KeepSpaceBPE
    elif isinstance(detok, SPMStreamingDetokenizer):
        detok.trim_space = False
    return detok
