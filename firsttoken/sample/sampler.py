"""Batched sampling: logits processors, greedy, temperature, min-p, top-k, top-p, per-request
seeds, logprobs.

Rows whose parameters have logits processors (penalties, logit_bias, bad words, min_tokens; see
logits_processors.py) have their logits processed first; logprobs are those of the raw logits,
as vLLM's default. Greedy rows take the argmax of their (processed) logits: on CPU, the native
kernels' one vectorized pass per row (`RowKernels.argmax_rows`, torch.argmax's index, in
0.12-0.17x its time for 1 to 48 rows of 49152 logits: `python benchmarks/native_kernels.py`).
Every other row is drawn by tensor ops over all such rows at once; the only Python loops are over
a step's specs (building parameter lists) and over its few candidate widths (see below).

Filtering. Min-p, top-k and top-p are floors on a row's scaled logits (logits / temperature):
min-p keeps the tokens whose probability is at least min_p times the likeliest token's, that is
whose scaled logit is at least the largest plus log(min_p); top-k keeps the tokens at or above
the k-th largest logit; top-p keeps the smallest prefix of the tokens left by the other two,
likeliest first, whose probability reaches top_p, the crossing token included (and the
likeliest token always), so its floor is the crossing token's logit (vLLM's order: min-p and
top-k, then top-p). Being floors on the value, they treat tied tokens alike. `filter_logits` is
the plain per-row reference.

Candidates. A row with a top-k needs only its largest logits: `torch.topk` of `candidate_width`
of them (a power of two above k, 64 at least), divided by the temperature after the selection,
where the old per-row loop divided and sorted the whole vocabulary. When tokens tied with the
k-th largest run past the candidates, the row is drawn again over a full sort. A row with top-p
but no top-k sorts its whole row; a row with neither keeps its row in vocabulary order.

Drawing. A row draws one uniform u in (0, 1] and takes the first kept token whose cumulative
probability (over its candidates in order) reaches u times the kept mass: inverse transform
sampling, so a token is drawn with its probability renormalised over the kept tokens (to the
resolution of float32 sums, about 6e-8 of the kept mass, which is also u's). A seeded row's u
is a pure function of (seed, output index): splitmix64's finaliser over `step_seed`, in Python
integers, top 24 bits (what a float32 holds exactly). Unseeded rows take theirs from the
engine's generator, one call per step.

Batch invariance (a seeded row's token depends only on its own logits, parameters, seed and
output index, never on its neighbours, preemption or chunking):
- its u comes from its seed and output index alone;
- the shape of its work (its candidate width) comes from its own top_k and top_p, and rows are
  grouped by width, so a row's softmax and cumulative sums always run over the same length;
- every op on its data is row-wise (topk, sort, softmax, cumsum, searchsorted, gather) or an
  exactly rounded element-wise op (division, comparison, masked fill). No element-wise exp or
  log runs over a flattened batch: on CPU the vectorised body and the scalar tail of such a
  loop may round differently, which would tie a value to its row's position in the batch.
That is why the draw is one uniform per row rather than a Gumbel-max or exponential race, which
needs a log of a noise value per token; it also keeps the draw within the candidates instead of
touching the whole vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from firsttoken.core.batch import SampleSpec, SchedulerOutput
from firsttoken.ops.native import NativeKernels
from firsttoken.outputs import SampledToken, TokenLogprob
from firsttoken.sample.logits_processors import TrackedTokens, apply_logits_processors

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 24
# A floor on candidate widths: small top-k values share one width, so a step has fewer groups.
_MIN_CANDIDATE_WIDTH = 64


def step_seed(seed: int, output_index: int) -> int:
    return (seed * _GOLDEN + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK63


def seeded_uniform(seed: int, output_index: int) -> float:
    """u in (0, 1] for a seeded row's draw of output token `output_index`.

    step_seed is linear in its inputs; the finaliser makes neighbouring output indices
    independent draws."""
    mixed = step_seed(seed, output_index)
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK64
    mixed ^= mixed >> 31
    return ((mixed >> (64 - _UNIFORM_BITS)) + 1) / (1 << _UNIFORM_BITS)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Logits [V] with every token below min-p, outside the top-k or outside the top-p nucleus
    set to -inf; the plain per-row reference of `find_nucleus`.

    The filters are floors on the value (the largest logit plus log(min_p); the k-th largest
    logit; the logit of the token whose cumulative probability crosses top_p), so tokens with
    equal logits share one fate."""
    vocab_size = logits.shape[-1]
    if min_p > 0:
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if 0 < top_k < vocab_size:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits = torch.sort(logits, descending=True).values
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # The smallest prefix whose mass reaches top_p, the crossing token included, ends at the
        # first token whose cumulative mass reaches top_p. With a tiny top_p (0 in float32) that
        # is the likeliest token, so one token always stays.
        crossing = min(int((cumulative < top_p).sum()), vocab_size - 1)
        logits = logits.masked_fill(logits < sorted_logits[crossing], float("-inf"))
    return logits


def candidate_width(top_k: int, top_p: float, vocab_size: int) -> int | None:
    """How many of a row's largest logits its filter needs to see; None when it keeps every token."""
    if 0 < top_k < vocab_size:
        # One slot past k at least: a candidate past the k-th that ties with it shows that ties
        # may run beyond the candidates.
        return min(vocab_size, max(_MIN_CANDIDATE_WIDTH, 1 << top_k.bit_length()))
    return vocab_size if top_p < 1.0 else None


@dataclass(frozen=True)
class Nucleus:
    """The tokens some rows keep: the first `num_kept` of each row's candidates."""

    token_ids: torch.Tensor | None  # [n, W] vocabulary ids of the candidates; None: the vocabulary in order
    cumulative: torch.Tensor  # [n, W] running probability over the candidates, after top-k
    num_kept: torch.Tensor  # [n, 1] int64
    complete: torch.Tensor  # [n] bool; False: tokens tied with the k-th largest lie past the candidates


def find_nucleus(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    width: int | None,
    log_min_p: torch.Tensor | None = None,
) -> Nucleus:
    """The nucleus of each row of logits [n, V] at its temperature [n, 1], from its `width`
    largest logits. top_k [n, 1] int64 (V when off) must be below `width` unless `width` is V;
    top_p [n, 1]; log_min_p [n, 1] (-inf when off), None when no row has a min-p."""
    num_rows, vocab_size = logits.shape
    all_complete = torch.ones(num_rows, dtype=torch.bool, device=logits.device)
    if width is None:
        num_kept = torch.full((num_rows, 1), vocab_size, device=logits.device)
        values = logits / temperature
        if log_min_p is not None:
            min_p_floor = values.amax(-1, keepdim=True) + log_min_p
            values = values.masked_fill(values < min_p_floor, float("-inf"))
        # Tokens below the floor have no probability: the draw never lands on one.
        return Nucleus(None, values.softmax(-1).cumsum(-1), num_kept, all_complete)
    if width == vocab_size:
        largest, token_ids = torch.sort(logits, dim=-1, descending=True)  # [n, V]
    else:
        largest, token_ids = torch.topk(logits, width, dim=-1)  # [n, W], largest first
    # A positive temperature keeps the order: the largest scaled logits are the largest, scaled,
    # and only the candidates need dividing.
    values = largest / temperature
    kth_largest = values.gather(1, top_k - 1)  # [n, 1]
    floor = kth_largest if log_min_p is None else torch.maximum(kth_largest, values[:, :1] + log_min_p)
    cumulative = values.masked_fill(values < floor, float("-inf")).softmax(-1).cumsum(-1)
    crossing = (cumulative < top_p).sum(-1, keepdim=True).clamp(max=width - 1)  # [n, 1]
    nucleus_floor = torch.where(top_p < 1.0, values.gather(1, crossing), float("-inf"))
    # At least the largest: a NaN row keeps nothing above its floor otherwise (see `draw`).
    num_kept = (values >= torch.maximum(floor, nucleus_floor)).sum(-1, keepdim=True).clamp_(min=1)
    complete = all_complete if width == vocab_size else values[:, -1] < kth_largest[:, 0]
    return Nucleus(token_ids, cumulative, num_kept, complete)


def draw(nucleus: Nucleus, uniform: torch.Tensor) -> torch.Tensor:
    """Token ids [n]: for each row the first kept candidate whose cumulative probability reaches
    uniform [n, 1] (in (0, 1]) times the kept mass."""
    kept_mass = nucleus.cumulative.gather(1, nucleus.num_kept - 1)  # [n, 1]
    # The first index at or above a target in (0, kept mass] is a kept token of nonzero probability.
    # A row whose logits held a NaN has NaN sums, which every target lies past: clamped, it draws
    # a kept token instead of indexing past the row and stopping the engine.
    index = torch.searchsorted(nucleus.cumulative, uniform * kept_mass).clamp_(max=nucleus.num_kept - 1)
    token_ids = index if nucleus.token_ids is None else nucleus.token_ids.gather(1, index)
    return token_ids.squeeze(1)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of one step on the device, one row per row of logits."""

    temperature: torch.Tensor  # [R, 1] float32; 1 on greedy rows, which never divide
    top_k: torch.Tensor  # [R, 1] int64; the vocabulary size when off
    top_p: torch.Tensor  # [R, 1] float32
    log_min_p: torch.Tensor | None  # [R, 1] float32, -inf where off; None when no row has a min-p
    uniform: torch.Tensor  # [R, 1] float32 in (0, 1]: where each row's draw lands in its kept mass

    @classmethod
    def build(
        cls, specs: list[SampleSpec], vocab_size: int, generator: torch.Generator, device: torch.device
    ) -> SamplingTensors:
        rows = []
        any_min_p = False
        for spec in specs:
            params = spec.sampling_params
            any_min_p = any_min_p or params.min_p > 0
            top_k = params.top_k if 0 < params.top_k < vocab_size else vocab_size
            temperature = 1.0 if params.greedy else params.temperature
            seeded = params.seed is not None
            uniform = seeded_uniform(params.seed, spec.output_index) if seeded else 0.0
            log_min_p = math.log(params.min_p) if params.min_p > 0 else float("-inf")
            rows.append((temperature, top_k, params.top_p, log_min_p, uniform, float(seeded)))
        # One host-to-device copy; float64 holds every field exactly.
        packed = torch.tensor(rows, dtype=torch.float64, device=device)  # [R, 6]
        uniform = packed[:, 4:5].float()
        if not all(spec.sampling_params.seed is not None for spec in specs):
            # rand is in [0, 1); 1 - rand is in (0, 1], as the draw needs.
            unseeded = 1.0 - torch.rand(uniform.shape, generator=generator, device=device)
            uniform = torch.where(packed[:, 5:6].bool(), uniform, unseeded)
        log_min_p = packed[:, 3:4].float() if any_min_p else None
        return cls(packed[:, 0:1].float(), packed[:, 1:2].long(), packed[:, 2:3].float(), log_min_p, uniform)


class Sampler:
    """Picks one token per row of logits; owns the generator of unseeded requests and the token
    state of tracked requests (see logits_processors.py)."""

    def __init__(
        self, seed: int, device: torch.device, vocab_size: int, native_kernels: NativeKernels | None = None
    ) -> None:
        self.device = device
        # Greedy rows' argmax in one vectorized pass per row where these are given (CPU).
        self.native_kernels = native_kernels
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.tracked = TrackedTokens(vocab_size, device)

    def begin_step(self, scheduler_output: SchedulerOutput) -> None:
        """Start tracking the step's new tracked requests and count the generated tokens among
        its inputs; before the step's sample()."""
        if scheduler_output.new_tracked_requests:
            self.tracked.add(scheduler_output.new_tracked_requests)
        if self.tracked.requests:
            self.tracked.observe(scheduler_output.chunks)

    def release(self, req_ids: list[str]) -> None:
        """Forget finished tracked requests."""
        self.tracked.release(req_ids)

    def sample(self, logits: torch.Tensor, specs: list[SampleSpec]) -> list[SampledToken]:
        """logits: float32 [R, vocab], one row per spec; rows with logits processors are
        processed in place."""
        logprob_rows = [row for row, spec in enumerate(specs) if spec.sampling_params.logprobs is not None]
        # A copy taken before processing changes the rows: logprobs are the model's own.
        logprob_logits = None
        if logprob_rows:
            logprob_logits = torch.index_select(logits, 0, torch.tensor(logprob_rows, device=self.device))
        if any(spec.sampling_params.processes_logits for spec in specs):
            apply_logits_processors(logits, specs, self.tracked)
        token_ids = self._argmax(logits)
        groups = self._group_sampled_rows(specs, logits.shape[-1])
        if groups:
            params = SamplingTensors.build(specs, logits.shape[-1], self.generator, self.device)
            token_list = self._draw_into(token_ids, logits, params, groups, specs)
        else:
            token_list = token_ids.tolist()
        if logprob_logits is None:
            results = [SampledToken(token_id) for token_id in token_list]
        else:
            results = self._with_logprobs(logprob_logits, token_ids, token_list, specs, logprob_rows)
        if any(spec.sampling_params.structured_output is not None for spec in specs):
            return self._with_grammar_errors(results, specs)
        return results

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest logit, as `torch.argmax` picks it."""
        if (
            self.native_kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
            and logits.dim() == 2 and logits.shape[1] > 0 and logits.is_contiguous()
        ):
            return self.native_kernels.rows.argmax_rows(logits)
        return torch.argmax(logits, dim=-1)

    def _with_grammar_errors(
        self, results: list[SampledToken], specs: list[SampleSpec]
    ) -> list[SampledToken]:
        """Mark the draws of rows whose grammar failed, so their requests end with the error
        rather than with a silent stop."""
        for row, spec in enumerate(specs):
            if spec.sampling_params.structured_output is None:
                continue
            grammar = self.tracked.get(spec).grammar
            error = None if grammar is None else grammar.error()
            if error is not None:
                results[row] = dataclasses.replace(results[row], grammar_error=error)
        return results

    @staticmethod
    def _group_sampled_rows(specs: list[SampleSpec], vocab_size: int) -> dict[int | None, list[int]]:
        """The rows that do not take the argmax, by candidate width."""
        groups: dict[int | None, list[int]] = {}
        for row, spec in enumerate(specs):
            params = spec.sampling_params
            if not params.greedy:
                groups.setdefault(candidate_width(params.top_k, params.top_p, vocab_size), []).append(row)
        return groups

    def _draw_into(
        self,
        token_ids: torch.Tensor,
        logits: torch.Tensor,
        params: SamplingTensors,
        groups: dict[int | None, list[int]],
        specs: list[SampleSpec],
    ) -> list[int]:
        """Writes each sampled row's token into token_ids [R]; returns token_ids on the host."""
        incomplete = torch.zeros_like(token_ids, dtype=torch.bool)
        for width, rows in groups.items():
            index = torch.tensor(rows, device=self.device)
            nucleus = self._nucleus(logits, params, index, width, _log_min_p_of(params, specs, rows, index))
            token_ids[index] = draw(nucleus, params.uniform[index])
            incomplete[index] = ~nucleus.complete
        # Flags ride with the tokens: the step keeps its one synchronisation.
        token_list, incomplete_flags = torch.stack([token_ids, incomplete.long()]).tolist()
        full_sort_rows = [row for row, flag in enumerate(incomplete_flags) if flag]
        if not full_sort_rows:
            return token_list
        index = torch.tensor(full_sort_rows, device=self.device)
        log_min_p = _log_min_p_of(params, specs, full_sort_rows, index)
        nucleus = self._nucleus(logits, params, index, logits.shape[-1], log_min_p)
        token_ids[index] = draw(nucleus, params.uniform[index])
        return token_ids.tolist()

    @staticmethod
    def _nucleus(
        logits: torch.Tensor,
        params: SamplingTensors,
        index: torch.Tensor,
        width: int | None,
        log_min_p: torch.Tensor | None,
    ) -> Nucleus:
        rows = torch.index_select(logits, 0, index)  # [n, V]
        return find_nucleus(
            rows, params.temperature[index], params.top_k[index], params.top_p[index], width, log_min_p
        )

    @staticmethod
    def _with_logprobs(
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        token_list: list[int],
        specs: list[SampleSpec],
        rows: list[int],
    ) -> list[SampledToken]:
        """logits [n, V]: the raw logits of `rows`, the rows that want logprobs."""
        index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits, dim=-1)  # [n, V]
        chosen = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1).tolist()
        max_top = max(specs[row].sampling_params.logprobs for row in rows)
        top_values, top_ids = torch.topk(logprobs, max_top, dim=-1)  # [n, max_top]
        top_pairs = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        results = [SampledToken(token_id) for token_id in token_list]
        for position, row in enumerate(rows):
            num_top = specs[row].sampling_params.logprobs
            top = [TokenLogprob(token_id, value) for token_id, value in top_pairs[position][:num_top]]
            results[row] = SampledToken(token_list[row], chosen[position], top)
        return results


def _log_min_p_of(
    params: SamplingTensors, specs: list[SampleSpec], rows: list[int], index: torch.Tensor
) -> torch.Tensor | None:
    """The rows' log(min_p) [n, 1] when one of them has a min-p; None when none has (a floor of
    -inf changes nothing, so such a group skips it)."""
    if params.log_min_p is None or not any(specs[row].sampling_params.min_p > 0 for row in rows):
        return None
    return params.log_min_p[index]
