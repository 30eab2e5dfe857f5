"""Logits processors: what a request's parameters and its tokens so far do to its logits before
a token is drawn, batched over a step's rows.

The processors run in vLLM's order: bad words and min_tokens ban tokens, logit_bias adds to
logits, then the penalties (repetition, frequency, presence); the sampler then applies
temperature, min_p, top-k and top-p. A greedy row takes the argmax of the processed logits.

Batching: each processor is a few tensor ops over the rows that use it: an index_put over
(row, token) pairs for the bans and biases; for the penalties a gather of each row's seen
tokens (the distinct tokens it generated, and its prompt's with a repetition penalty), a few
element-wise ops and a scatter back, so their cost follows the tokens seen, not the vocabulary
(8 rows with a 500-token prompt and repetition_penalty: ~0.1 ms here where whole-row ops over
49152 tokens took ~5.7 ms). Rows that use none are not touched, and a step whose rows use none
runs nothing here. Every op on a row is a gather, a scatter or an exactly rounded element-wise
op (add, multiply, divide, compare), so a row's result does not depend on its neighbours.

Structured output (grammar.py) runs first: a constrained row's tokens outside its grammar get -inf.

Token state (`TrackedTokens`): a request with penalties, bad words, min_tokens or structured
output is tracked (its grammar's matcher advances with the tokens counted here). The
step that first schedules it sends a TrackedRequest (its prompt, its stop ids, its bad words'
tokens); from then on its generated tokens are counted as they come back as step inputs: a
chunk carries the tokens at positions [start, start + n), and the positions past the prompt not
counted yet are generated tokens. Counting inputs rather than draws keeps the counts equal to
the scheduler's tokens whatever it drops (a draw for a request preempted or aborted while its
step ran) and through recomputes, whose chunks resend tokens already counted. A token's KV is
written only when it is an input, so a cached prefix never holds a token not counted yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from firsttoken.core.batch import SampleSpec, ScheduledChunk, TrackedRequest
from firsttoken.sample.grammar import GrammarState, apply_bitmask, fill_bitmask

_INITIAL_SLOTS = 4
_INITIAL_SEEN_WIDTH = 64


@dataclass
class RequestTokens:
    """What the sampler knows of one tracked request's tokens."""

    num_counted_positions: int  # positions below this are the prompt or counted outputs
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...]
    slot: int | None  # its row of the penalty buffers; None without penalties
    # The distinct tokens its penalties touch: those generated, and the prompt's with a
    # repetition penalty (the host's copy of its row of PenaltyBuffers.seen_ids).
    seen_token_ids: set[int]
    # Where its output stands in its grammar (structured output); None without one.
    grammar: GrammarState | None = None


class PenaltyBuffers:
    """Per tracked request with penalties (a slot, reused after release): how often it generated
    each token, output_counts [slots, V], and the distinct tokens its penalties touch, in the
    order first seen: the first num_seen[slot] entries of seen_ids [slots, width]. Penalties
    read and write only those tokens, so their cost follows the tokens seen, not the vocabulary.
    Both grow by doubling; every update is one tensor op over all the step's slots."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.seen_ids = torch.zeros(0, _INITIAL_SEEN_WIDTH, dtype=torch.long, device=device)
        self.num_seen: list[int] = []
        self._free_slots: list[int] = []

    def assign(self) -> int:
        """A slot with no counts and no seen tokens."""
        if not self._free_slots:
            self._add_slots()
        slot = self._free_slots.pop()
        self.output_counts[slot].zero_()
        self.num_seen[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    def count(self, slots: list[int], token_ids: list[int]) -> None:
        """Add one to each (slot, token) pair's count; pairs may repeat."""
        index = torch.tensor([slots, token_ids], dtype=torch.long, device=self.device)
        ones = torch.ones(len(slots), dtype=torch.float32, device=self.device)
        self.output_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def add_seen(self, slots: list[int], token_ids: list[int]) -> None:
        """Append each token to its slot's seen tokens (tokens new to their slot, in order)."""
        positions = []
        for slot in slots:
            positions.append(self.num_seen[slot])
            self.num_seen[slot] += 1
        width = self.seen_ids.shape[1]
        needed = max(self.num_seen[slot] for slot in slots)
        if needed > width:
            self.seen_ids = _resized(self.seen_ids, self.seen_ids.shape[0], max(needed, 2 * width))
        index = torch.tensor([slots, positions, token_ids], dtype=torch.long, device=self.device)
        self.seen_ids.index_put_((index[0], index[1]), index[2])

    def _add_slots(self) -> None:
        num_slots = self.output_counts.shape[0]
        new_num_slots = max(_INITIAL_SLOTS, 2 * num_slots)
        self.output_counts = _resized(self.output_counts, new_num_slots, self.output_counts.shape[1])
        self.seen_ids = _resized(self.seen_ids, new_num_slots, self.seen_ids.shape[1])
        self.num_seen.extend([0] * (new_num_slots - num_slots))
        self._free_slots.extend(reversed(range(num_slots, new_num_slots)))


def _resized(buffer: torch.Tensor, num_rows: int, num_columns: int) -> torch.Tensor:
    """A zeroed buffer of the new size holding `buffer` in its top-left corner."""
    resized = torch.zeros(num_rows, num_columns, dtype=buffer.dtype, device=buffer.device)
    resized[: buffer.shape[0], : buffer.shape[1]] = buffer
    return resized


@dataclass
class _PenaltyUpdates:
    """A step's additions to the penalty buffers, applied in one op each."""

    count_slots: list[int] = field(default_factory=list)
    count_token_ids: list[int] = field(default_factory=list)
    seen_slots: list[int] = field(default_factory=list)
    seen_token_ids: list[int] = field(default_factory=list)

    def add_seen(self, tokens: RequestTokens, token_ids: list[int]) -> None:
        """Record the tokens new to a request's seen set (each once, in order)."""
        assert tokens.slot is not None
        for token_id in token_ids:
            if token_id not in tokens.seen_token_ids:
                tokens.seen_token_ids.add(token_id)
                self.seen_slots.append(tokens.slot)
                self.seen_token_ids.append(token_id)

    def apply(self, buffers: PenaltyBuffers) -> None:
        if self.count_slots:
            buffers.count(self.count_slots, self.count_token_ids)
        if self.seen_slots:
            buffers.add_seen(self.seen_slots, self.seen_token_ids)


class TrackedTokens:
    """Owns the token state of every tracked request, by request id, and its penalty buffers."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.requests: dict[str, RequestTokens] = {}
        self.penalties = PenaltyBuffers(vocab_size, device)

    def add(self, tracked: list[TrackedRequest]) -> None:
        updates = _PenaltyUpdates()
        for request in tracked:
            params = request.sampling_params
            tokens = RequestTokens(
                num_counted_positions=len(request.prompt_token_ids),
                output_token_ids=[],
                stop_token_ids=request.stop_token_ids,
                bad_words_token_ids=request.bad_words_token_ids,
                slot=self.penalties.assign() if params.has_penalties else None,
                seen_token_ids=set(),
                grammar=None if request.grammar is None else request.grammar.new_state(),
            )
            if params.repetition_penalty != 1:
                updates.add_seen(tokens, request.prompt_token_ids)
            self.requests[request.req_id] = tokens
        updates.apply(self.penalties)

    def release(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            tokens = self.requests.pop(req_id, None)
            if tokens is not None and tokens.slot is not None:
                self.penalties.release(tokens.slot)

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """Count the generated tokens among the step's inputs that were not counted yet."""
        updates = _PenaltyUpdates()
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
            if tokens.grammar is not None:
                tokens.grammar.advance(new_token_ids)
            if tokens.slot is not None:
                updates.count_slots.extend([tokens.slot] * len(new_token_ids))
                updates.count_token_ids.extend(new_token_ids)
                updates.add_seen(tokens, new_token_ids)
        updates.apply(self.penalties)

    def get(self, spec: SampleSpec) -> RequestTokens:
        tokens = self.requests.get(spec.req_id)
        if tokens is None:
            raise KeyError(f"{spec.req_id}: its parameters need token state, but it is not tracked")
        return tokens


def apply_logits_processors(logits: torch.Tensor, specs: list[SampleSpec], tracked: TrackedTokens) -> None:
    """Process logits [R, V] in place, one row per spec."""
    apply_grammars(logits, specs, tracked)
    apply_bans(logits, banned_tokens(specs, tracked))
    apply_logit_bias(logits, specs)
    apply_penalties(logits, specs, tracked)


def apply_grammars(logits: torch.Tensor, specs: list[SampleSpec], tracked: TrackedTokens) -> None:
    """Mask each structured-output row to the tokens its grammar allows next."""
    rows = [row for row, spec in enumerate(specs) if spec.sampling_params.structured_output is not None]
    if not rows:
        return
    bitmask = fill_bitmask([tracked.get(specs[row]).grammar for row in rows], logits.shape[1])
    apply_bitmask(logits, rows, bitmask)


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
    tokens), on each penalty row's seen tokens: gathered as [n, L] (L: the most any of the rows
    has seen), processed and scattered back."""
    rows: list[int] = []
    slots: list[int] = []
    penalties: list[tuple[float, float, float, float]] = []
    for row, spec in enumerate(specs):
        params = spec.sampling_params
        if not (params.tracks_tokens and params.has_penalties):
            continue
        slot = tracked.get(spec).slot
        num_seen = tracked.penalties.num_seen[slot]
        if num_seen:  # nothing seen yet: nothing to penalize
            rows.append(row)
            slots.append(slot)
            penalty = (params.repetition_penalty, params.frequency_penalty, params.presence_penalty)
            penalties.append((*penalty, num_seen))
    if not rows:
        return
    device = logits.device
    index = torch.tensor([rows, slots], dtype=torch.long, device=device)
    packed = torch.tensor(penalties, dtype=torch.float64, device=device)  # [n, 4]; exact for the counts
    repetition, frequency, presence = packed[:, :3].to(logits.dtype).T[:, :, None]  # each [n, 1]
    num_seen = packed[:, 3:].long()  # [n, 1]
    width = max(penalty[3] for penalty in penalties)
    token_ids = tracked.penalties.seen_ids.index_select(0, index[1])[:, : int(width)]  # [n, L]
    # A row's entries past its own count repeat its first token: scattering a token's new value
    # twice writes the same value, so the padding changes nothing.
    is_seen = torch.arange(token_ids.shape[1], device=device) < num_seen
    token_ids = torch.where(is_seen, token_ids, token_ids[:, :1])
    row_index = index[0][:, None].expand_as(token_ids)
    values = logits[row_index, token_ids]  # [n, L]
    counts = tracked.penalties.output_counts[index[1][:, None].expand_as(token_ids), token_ids]  # [n, L]
    if any(penalty[0] != 1 for penalty in penalties):
        values = torch.where(values > 0, values / repetition, values * repetition)
    if any(penalty[1] != 0 for penalty in penalties):
        values = values - frequency * counts
    if any(penalty[2] != 0 for penalty in penalties):
        values = values - presence * (counts > 0)
    logits.index_put_((row_index, token_ids), values)
