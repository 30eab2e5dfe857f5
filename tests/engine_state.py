"""What tests ask of an engine's state after a run, defined once for every test that asks it."""

from __future__ import annotations

from collections.abc import Sequence

from firsttoken import LLM, SamplingParams


def all_blocks_free(llm: LLM) -> bool:
    """No request left, and every KV block free but those that pinned prompts hold."""
    stats = llm.stats()
    pinned_blocks = stats.num_pinned_tokens // llm.config.cache.block_size
    no_requests = stats.num_running == 0 and stats.num_waiting == 0
    return no_requests and stats.num_free_kv_blocks + pinned_blocks == stats.num_kv_blocks


def most_blocks_held(llm: LLM, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
    """Streams one request to its end: the most KV blocks in use after any of its steps."""
    most_held = 0
    for delta in llm.stream(prompt_token_ids, params):
        if delta.finished:  # its blocks are free by now
            break
        stats = llm.stats()
        most_held = max(most_held, stats.num_kv_blocks - stats.num_free_kv_blocks)
    return most_held


def tracked_requests(llm: LLM) -> dict:
    """The requests whose tokens the sampler keeps (penalties, grammars, bad words), by id. The
    engine has no public view of these: this is the one place a test reaches for them."""
    return llm.core.worker.runner.sampler.tracked.requests
