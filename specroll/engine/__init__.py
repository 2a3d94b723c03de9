"""Rollout engine: continuous batching, per-request sampling, policy log-probs."""

from specroll.engine.engine import Engine, EngineConfig
from specroll.engine.request import Request, Result, SamplingParams

__all__ = ["Engine", "EngineConfig", "Request", "Result", "SamplingParams"]
