"""What tests ask of an engine's state after a run, defined once for every test that asks it."""

from __future__ import annotations

from firsttoken import LLM


def all_blocks_free(llm: LLM) -> bool:
    """No request left, and every KV block free but those that pinned prompts hold."""
    stats = llm.stats()
    pinned_blocks = stats.num_pinned_tokens // llm.config.cache.block_size
    no_requests = stats.num_running == 0 and stats.num_waiting == 0
    return no_requests and stats.num_free_kv_blocks + pinned_blocks == stats.num_kv_blocks


def tracked_requests(llm: LLM) -> dict:
    """The requests whose tokens the sampler keeps (penalties, grammars, bad words), by id. The
    engine has no public view of these: this is the one place a test reaches for them."""
    return llm.core.worker.runner.sampler.tracked.requests
