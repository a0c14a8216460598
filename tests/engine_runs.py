"""Drive an engine to completion the way the worker does (shared by the CPU
and GPU engine tests)."""

from __future__ import annotations


def run_engine(engine, requests, join_every: int = 0) -> dict[str, list[int]]:
    """Feed requests (one every ``join_every`` steps, or all at once) until
    every one has ended; returns each request's generated token ids.

    Fails the calling test on any error event.
    """
    out = {r.request_id: [] for r in requests}
    pending, step = list(requests), 0
    while pending or engine.has_work():
        while pending and (join_every == 0 or step % join_every == 0):
            engine.add(pending.pop(0))
            if join_every:
                break
        for ev in engine.step():
            assert ev.finish_reason != "error", ev.error
            out[ev.request_id] += ev.token_ids
        step += 1
    return out


# A tiny llama of mlx-lm's: the engine's paths (prefill, flushes, decode) on weights that
# cost nothing to build or run.
TINY_LLAMA = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                  rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True)


def tiny_model(**config):
    """An mlx-lm model of ``TINY_LLAMA``'s shape with ``config``'s changes, random
    weights seeded the same on every call (not yet evaluated)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = {**TINY_LLAMA, **config}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    return model_cls(args_cls.from_dict(config))


class NullDetokenizer:
    """Random weights have no text: the engines only need token ids."""

    last_segment = ""

    def add_token(self, token):
        pass

    def finalize(self):
        pass


class IdTokenizer:
    """A tokenizer stand-in for runs on token ids alone (random-weight models)."""

    eos_token_ids: set = set()

    @property
    def detokenizer(self):
        return NullDetokenizer()
