"""kiviq engine: model loading, KV caches, scheduling and generation.

Needs only mlx, mlx-lm and numpy (never redis, rq or pydantic).
"""

from engine.batch_engine import Engine
from engine.model_loading import load
from engine.request import Request, SamplingParams, StepEvent
from engine.serial_engine import SerialEngine
from engine.setup import build_engine

__all__ = ["Engine", "Request", "SamplingParams", "SerialEngine", "StepEvent", "build_engine", "load"]
