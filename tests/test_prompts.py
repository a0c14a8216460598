"""A burst of prompts encoded together (``worker.prompts.encode_prompts``) gives
each request exactly the ids it gets alone, and a request that cannot be
rendered fails alone."""

from __future__ import annotations

from kiviq.jobs.models import GenerateRequest
from kiviq.worker.prompts import _batch_encoder, encode_prompt, encode_prompts


def burst(tokenizer) -> list[GenerateRequest]:
    bos = tokenizer.bos_token or ""
    return [
        GenerateRequest(prompt="The capital of Italy is", max_tokens=4),
        GenerateRequest(messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=4),
        GenerateRequest(prompt="Numbers 12345 and\nnew lines\n\n end", max_tokens=4),
        GenerateRequest(prompt=bos + "Starts with the special token itself", max_tokens=4),
        GenerateRequest(messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Why is the sea salty?"}], max_tokens=4),
        GenerateRequest(prompt="x" * 3000, max_tokens=4),
    ]


def test_a_burst_encodes_each_prompt_as_it_is_encoded_alone(smollm2):
    _, tokenizer = smollm2
    assert _batch_encoder(tokenizer) is not None  # the default model's tokenizer takes the batch path
    requests = burst(tokenizer)
    assert encode_prompts(tokenizer, requests) == [encode_prompt(tokenizer, r) for r in requests]


class OneByOne:
    """A tokenizer with no batch encoder, whose chat template fails on one word."""

    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + list(text.encode())

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        if "unrenderable" in messages[0]["content"]:
            raise ValueError("template error")
        return "|".join(m["content"] for m in messages)


def test_a_request_that_cannot_be_rendered_fails_alone():
    tokenizer = OneByOne()
    requests = [GenerateRequest(prompt="ab", max_tokens=1),
                GenerateRequest(messages=[{"role": "user", "content": "unrenderable"}], max_tokens=1),
                GenerateRequest(messages=[{"role": "user", "content": "cd"}], max_tokens=1)]
    first, failed, last = encode_prompts(tokenizer, requests)
    assert first == [1, 97, 98] and last == [99, 100]
    assert isinstance(failed, ValueError) and "template error" in str(failed)
