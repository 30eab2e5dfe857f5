"""Logits processors: what a request's parameters and its tokens so far do to its logits before
a token is drawn, batched over a step's rows.

The processors run in vLLM's order: bad words and min_tokens ban tokens, logit_bias adds to
logits, then the penalties (repetition, frequency, presence); the sampler then applies
temperature, min_p, top-k and top-p. A greedy row takes the argmax of the processed logits.

Batching: each processor is a few tensor ops over the rows that use it (an index_put over
(row, token) pairs for the bans and biases; a gather, a few element-wise ops and a scatter of
whole rows for the penalties). Rows that use none are not touched, and a step whose rows use
none runs nothing here. Every op on a row is row-wise or an exactly rounded element-wise op
(add, multiply, divide, compare), so a row's result does not depend on its neighbours.

Token state (`TrackedTokens`): a request with penalties, bad words or min_tokens is tracked. The
step that first schedules it sends a TrackedRequest (its prompt, its stop ids, its bad words'
tokens); from then on its generated tokens are counted as they come back as step inputs: a
chunk carries the tokens at positions [start, start + n), and the positions past the prompt not
counted yet are generated tokens. Counting inputs rather than draws keeps the counts equal to
the scheduler's tokens whatever it drops (a draw for a request preempted or aborted while its
step ran) and through recomputes, whose chunks resend tokens already counted. A token's KV is
written only when it is an input, so a cached prefix never holds a token not counted yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.core.batch import SampleSpec, ScheduledChunk, TrackedRequest

_INITIAL_SLOTS = 4


@dataclass
class RequestTokens:
    """What the sampler knows of one tracked request's tokens."""

    num_counted_positions: int  # positions below this are the prompt or counted outputs
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    slot: int | None  # its row of the count buffers; None without penalties


class TokenCountBuffers:
    """Rows (slots) of generated-token counts [slots, V] and prompt-token masks [slots, V], one
    per tracked request with penalties; grown by doubling, slots reused after release."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free_slots: list[int] = []

    def assign(self, prompt_token_ids: list[int] | None) -> int:
        """A zeroed slot; its prompt mask is set when `prompt_token_ids` is given (repetition)."""
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self.output_counts[slot].zero_()
        if prompt_token_ids is not None:
            self.prompt_mask[slot].zero_()
            index = torch.tensor(prompt_token_ids, dtype=torch.long, device=self.device)
            self.prompt_mask[slot].index_fill_(0, index, True)
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def count(self, slots: list[int], token_ids: list[int]) -> None:
        """Add one to each (slot, token) pair's count; pairs may repeat."""
        index = torch.tensor([slots, token_ids], dtype=torch.long, device=self.device)
        ones = torch.ones(len(slots), dtype=torch.float32, device=self.device)
        self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _grow(self) -> None:
        num_slots = self.output_counts.shape[0]
        new_num_slots = max(_INITIAL_SLOTS, 2 * num_slots)
        self.output_counts = _grown(self.output_counts, new_num_slots)
        self.prompt_mask = _grown(self.prompt_mask, new_num_slots)
        self._free_slots.extend(reversed(range(num_slots, new_num_slots)))


def _grown(buffer: torch.Tensor, num_rows: int) -> torch.Tensor:
    grown = torch.zeros(num_rows, buffer.shape[1], dtype=buffer.dtype, device=buffer.device)
    grown[: buffer.shape[0]] = buffer
    return grown


class TrackedTokens:
    """Owns the token state of every tracked request, by request id, and its count buffers."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.requests: dict[str, RequestTokens] = {}
        self.counts = TokenCountBuffers(vocab_size, device)

    def add(self, tracked: list[TrackedRequest]) -> None:
        for request in tracked:
            params = request.sampling_params
            slot = None
            if params.has_penalties:
                slot = self.counts.assign(
                    request.prompt_token_ids if params.repetition_penalty != 1 else None
                )
            self.requests[request.req_id] = RequestTokens(
                num_counted_positions=len(request.prompt_token_ids),
                output_token_ids=[],
                stop_token_ids=request.stop_token_ids,
                bad_words_token_ids=request.bad_words_token_ids,
                slot=slot,
            )

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            tokens = self.requests.pop(req_id, None)
            if tokens is not None and tokens.slot is not None:
                self.counts.release(tokens.slot)

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """Count the generated tokens among the step's inputs that were not counted yet."""
        slots: list[int] = []
        token_ids: list[int] = []
        for chunk in chunks:
            tokens = self.requests.get(chunk.req_id)
            if tokens is None:
                continue
            # A gap would be positions never sent as inputs: never computed, so never cached.
            assert chunk.start_position <= tokens.num_counted_positions, "uncounted positions skipped"
            new_token_ids = chunk.token_ids[tokens.num_counted_positions - chunk.start_position :]
            if not new_token_ids:
                continue
            tokens.output_token_ids.extend(new_token_ids)
            tokens.num_counted_positions += len(new_token_ids)
            if tokens.slot is not None:
                slots.extend([tokens.slot] * len(new_token_ids))
                token_ids.extend(new_token_ids)
        if slots:
            self.counts.count(slots, token_ids)

    def get(self, spec: SampleSpec) -> RequestTokens:
        tokens = self.requests.get(spec.req_id)
        if tokens is None:
            raise KeyError(f"{spec.req_id}: its parameters need token state, but it is not tracked")
        return tokens


def apply_logits_processors(logits: torch.Tensor, specs: list[SampleSpec], tracked: TrackedTokens) -> None:
    """Process logits [R, V] in place, one row per spec."""
    apply_bans(logits, banned_tokens(specs, tracked))
    apply_logit_bias(logits, specs)
    apply_penalties(logits, specs, tracked)


def banned_tokens(specs: list[SampleSpec], tracked: TrackedTokens) -> tuple[list[int], list[int]]:
    """(rows, token ids) that may not be drawn: bad words' last tokens where the tokens generated
    so far end with the rest of the word, and stop ids before min_tokens are generated."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, spec in enumerate(specs):
        params = spec.sampling_params
        if not params.tracks_tokens or not (params.bad_words or spec.output_index < params.min_tokens):
            continue
        tokens = tracked.get(spec)
        banned = bad_word_bans(tokens.bad_words_token_ids, tokens.output_token_ids)
        if spec.output_index < params.min_tokens:
            banned.extend(tokens.stop_token_ids)
        rows.extend([row] * len(banned))
        token_ids.extend(banned)
    return rows, token_ids


def bad_word_bans(bad_words_token_ids: tuple[tuple[int, ...], ...], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens are the last ones generated (vLLM's
    rule: only generated tokens count, never the prompt's)."""
    banned = []
    num_output = len(output_token_ids)
    for word_token_ids in bad_words_token_ids:
        prefix_len = len(word_token_ids) - 1
        if prefix_len > num_output:
            continue
        if prefix_len == 0 or output_token_ids[num_output - prefix_len :] == list(word_token_ids[:-1]):
            banned.append(word_token_ids[-1])
    return banned


def apply_bans(logits: torch.Tensor, bans: tuple[list[int], list[int]]) -> None:
    rows, token_ids = bans
    if not rows:
        return
    index = torch.tensor([rows, token_ids], dtype=torch.long, device=logits.device)
    logits.index_put_((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, specs: list[SampleSpec]) -> None:
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, spec in enumerate(specs):
        logit_bias = spec.sampling_params.logit_bias
        if logit_bias:
            rows.extend([row] * len(logit_bias))
            token_ids.extend(logit_bias.keys())
            biases.extend(logit_bias.values())
    if not rows:
        return
    index = torch.tensor([rows, token_ids], dtype=torch.long, device=logits.device)
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    # Keys of one row are distinct, so no pair repeats: accumulate adds each bias once.
    logits.index_put_((index[0], index[1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, specs: list[SampleSpec], tracked: TrackedTokens) -> None:
    """Repetition (over prompt and generated tokens), then frequency and presence (over generated
    tokens), on the rows with any of them, each op skipped when no row uses it."""
    rows: list[int] = []
    slots: list[int] = []
    penalties: list[tuple[float, float, float]] = []
    for row, spec in enumerate(specs):
        params = spec.sampling_params
        if params.tracks_tokens and params.has_penalties:
            rows.append(row)
            slots.append(tracked.get(spec).slot)
            penalties.append((params.repetition_penalty, params.frequency_penalty, params.presence_penalty))
    if not rows:
        return
    device = logits.device
    index = torch.tensor([rows, slots], dtype=torch.long, device=device)
    repetition, frequency, presence = torch.tensor(penalties, dtype=logits.dtype, device=device).T[:, :, None]
    counts = tracked.counts.output_counts.index_select(0, index[1])  # [n, V]
    generated = counts > 0
    values = logits.index_select(0, index[0])  # [n, V]
    if any(penalty[0] != 1 for penalty in penalties):
        seen = generated | tracked.counts.prompt_mask.index_select(0, index[1])
        scale = torch.where(seen, repetition, 1.0)  # [n, V]
        values = torch.where(values > 0, values / scale, values * scale)
    if any(penalty[1] != 0 for penalty in penalties):
        values = values - frequency * counts
    if any(penalty[2] != 0 for penalty in penalties):
        values = values - presence * generated
    logits.index_copy_(0, index[0], values)
