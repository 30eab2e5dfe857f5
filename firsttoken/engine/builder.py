"""Builds an engine core with its proposer of draft tokens: the one way both front ends (LLM,
AsyncEngine) get an EngineCore."""

from __future__ import annotations

import dataclasses

from firsttoken.config import EngineConfig
from firsttoken.engine.engine_core import EngineCore
from firsttoken.errors import InvalidInputError
from firsttoken.speculative.draft_model import DraftModelProposer
from firsttoken.speculative.ngram import NgramProposer
from firsttoken.speculative.proposer import DraftProposer


def build_engine_core(config: EngineConfig) -> EngineCore:
    """The engine of `config`; a draft model's own engine is built first, then the target's."""
    speculative = config.speculative_config
    if speculative.method != "draft":
        return EngineCore(config, ngram_proposer(config))
    draft_core = EngineCore(draft_engine_config(config))
    core = EngineCore(config, DraftModelProposer(draft_core, speculative.num_speculative_tokens))
    check_shared_vocabulary(core, draft_core)
    return core


def ngram_proposer(config: EngineConfig) -> DraftProposer | None:
    """The prompt-lookup proposer when `config` asks for one."""
    speculative = config.speculative_config
    if speculative.method != "ngram":
        return None
    return NgramProposer(
        speculative.num_speculative_tokens, speculative.prompt_lookup_max, speculative.prompt_lookup_min
    )


def draft_engine_config(target: EngineConfig) -> EngineConfig:
    """The draft model's engine: the target's model options and block size, its own KV budget,
    its prompt cache on (each sequence's blocks stay for the next proposal)."""
    speculative = target.speculative_config
    return EngineConfig.from_kwargs(
        model_config=dataclasses.replace(target.model_config, model=speculative.model),
        kv_cache_memory_bytes=speculative.draft_kv_cache_memory_bytes,
        block_size=target.cache.block_size,
        chunk_size=target.scheduler.max_num_batched_tokens,
        enable_prompt_cache=True,
        # Its steps run between the target's, on the threads the target's governor chose.
        adaptive_threads=False,
    )


def check_shared_vocabulary(core: EngineCore, draft_core: EngineCore) -> None:
    """A draft model proposes token ids of the target's vocabulary, so the two must share it."""
    draft_vocab_size = draft_core.worker.vocab_size
    target_vocab_size = core.worker.vocab_size
    if draft_vocab_size != target_vocab_size:
        raise InvalidInputError(
            "speculative_config.model",
            f"the draft model's vocabulary has {draft_vocab_size} tokens, the target's "
            f"{target_vocab_size}: a draft model must share the target's tokenizer",
        )
