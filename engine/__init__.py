"""kiviq engine: model loading, KV caches, scheduling and generation.

Needs only mlx, mlx-lm and numpy (never redis, rq or pydantic).
"""

from kiviq.engine.batch_engine import Engine
from kiviq.engine.model_loading import load
from kiviq.engine.request import Request, SamplingParams, StepEvent
from kiviq.engine.serial_engine import SerialEngine
from kiviq.engine.setup import build_engine

__all__ = ["Engine", "Request", "SamplingParams", "SerialEngine", "StepEvent", "build_engine", "load"]
