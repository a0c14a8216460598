"""A request's life inside the batching engine (pure Python)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kiviq.engine.request import Request


class Status(Enum):
    WAITING = "waiting"  # not in the KV store (new, or preempted)
    PREFILLING = "prefilling"  # context partly in the KV store
    RUNNING = "running"  # decoding one token per step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's state.

    ``context`` is what the KV store must hold before the next decode step:
    the prompt, plus (after a preemption) the tokens generated so far, which
    are recomputed rather than swapped.
    """

    request: Request
    arrival: int
    status: Status = Status.WAITING
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # context tokens already in the KV store
    kv: Any = None  # the store's handle while admitted
    runtime: Any = None  # engine-side objects (detokenizer, sampler row, ...)
    preemptions: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def context(self) -> list[int]:
        return self.request.prompt_tokens + self.generated

    @property
    def num_tokens(self) -> int:
        """Tokens this sequence holds in the KV store once fully prefilled."""
        return len(self.request.prompt_tokens) + len(self.generated)
