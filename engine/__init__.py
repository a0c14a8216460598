"""kiviq engine: model loading, KV caches, scheduling and generation.

Needs only mlx, mlx-lm and numpy (never redis, rq or pydantic).
"""

from engine.engine import Engine
from engine.model_loading import load
from engine.request import Request, SamplingParams, StepEvent

__all__ = ["Engine", "Request", "SamplingParams", "StepEvent", "load"]
