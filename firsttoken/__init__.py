"""firsttoken: an LLM inference engine built for the shortest time to first token."""

from firsttoken.config import (
    AttentionConfig,
    CacheConfig,
    ChunkedPrefillConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    PromptCacheConfig,
    SchedulerConfig,
)
from firsttoken.engine.llm import LLM
from firsttoken.outputs import EngineStats, PinnedPrefix, RequestDelta, RequestOutput
from firsttoken.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "RequestDelta",
    "PinnedPrefix",
    "EngineStats",
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ChunkedPrefillConfig",
    "PromptCacheConfig",
    "AttentionConfig",
    "ParallelConfig",
]
