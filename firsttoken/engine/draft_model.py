"""The draft-model proposer: a second, smaller model sharing the target's tokenizer, run by
this engine's own code (its own worker, scheduler and paged KV cache), proposes tokens greedily.

Each step it is asked to continue every speculating sequence by up to k tokens: it runs them as
one batch of greedy requests. Its prompt cache keeps each sequence's full blocks from the
previous step, so a proposal costs the prefill of the few tokens added since (the target's
accepted tokens) and k - 1 batched decode steps. Greedy proposals are a point mass: accepting
while the target's own draw equals the proposal is exact speculative sampling for them.
"""

from __future__ import annotations

import dataclasses

from firsttoken.config import EngineConfig, SpeculativeConfig
from firsttoken.errors import InvalidInputError
from firsttoken.sampling_params import SamplingParams


class DraftModelProposer:
    def __init__(
        self, target_config: EngineConfig, speculative: SpeculativeConfig, target_vocab_size: int
    ) -> None:
        # Imported here: the engine core imports this module to build its proposer.
        from firsttoken.engine.engine_core import EngineCore

        config = EngineConfig.from_kwargs(
            model_config=dataclasses.replace(target_config.model_config, model=speculative.model),
            kv_cache_memory_bytes=speculative.draft_kv_cache_memory_bytes,
            block_size=target_config.cache.block_size,
            chunk_size=target_config.scheduler.max_num_batched_tokens,
            enable_prompt_cache=True,
            # Its steps run between the target's, on the threads the target's governor chose.
            adaptive_threads=False,
        )
        self.num_speculative_tokens = speculative.num_speculative_tokens
        self.core = EngineCore(config)
        if self.core.worker.vocab_size != target_vocab_size:
            raise InvalidInputError(
                "speculative_config.model",
                f"the draft model's vocabulary has {self.core.worker.vocab_size} tokens, the target's "
                f"{target_vocab_size}: a draft model must share the target's tokenizer",
            )

    def propose_batch(self, token_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {}
        order = []
        for sequence, limit in zip(token_ids, max_tokens):
            req_id = self.core.new_request_id()
            order.append(req_id)
            proposals[req_id] = []
            greedy = SamplingParams(
                temperature=0, max_tokens=min(limit, self.num_speculative_tokens), ignore_eos=True
            )
            try:
                self.core.add_request(req_id, sequence, greedy)
            except InvalidInputError:
                continue  # longer than the draft's cache or context holds: this one goes without
        while self.core.has_unfinished_requests():
            for delta in self.core.step():
                proposals[delta.request_id].extend(delta.token_ids)
        return [proposals[req_id] for req_id in order]
