"""OutputProcessor: turns a step's sampled tokens into per-request text deltas, applying stop strings."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.core.scheduler import RequestProgress
from firsttoken.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from firsttoken.outputs import RequestDelta, RequestMetrics, SampledToken
from firsttoken.request import Request
from firsttoken.tokenizer import Tokenizer


@dataclass
class _StreamState:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    stopped_text_len: int | None = None
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    """Owns each live request's detokenizer and stop-string state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _StreamState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        self._streams[request.req_id] = _StreamState(
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens),
            StopStringMatcher(params.stop, params.include_stop_str_in_output),
        )

    def remove(self, req_id: str) -> None:
        self._streams.pop(req_id, None)

    def detokenize(self, progress: RequestProgress) -> str | None:
        """Add the step's tokens to the request's text, one at a time; at the first that
        completes a stop string, drop the rest (from the request and the progress) and return
        that stop string. The token that ended the request (its last allowed one) is checked
        too: a stop string it completes is the reason the text ends there."""
        request = progress.request
        state = self._streams[request.req_id]
        for index, token in enumerate(progress.sampled):
            new_text = state.detokenizer.add_token(token.token_id)
            match = state.stop_matcher.find(state.detokenizer.text, len(new_text))
            if match is None:
                continue
            stop_string, state.stopped_text_len = match
            request.discard_output_tokens(len(progress.sampled) - index - 1)
            del progress.sampled[index + 1 :]
            return stop_string
        return None

    def delta(self, progress: RequestProgress) -> RequestDelta:
        """The request's new tokens and text since its previous delta."""
        request = progress.request
        state = self._streams[request.req_id]
        text = state.detokenizer.text
        if state.stopped_text_len is not None:
            end = state.stopped_text_len
        elif request.is_finished:
            end = len(text)
        else:
            end = max(state.num_emitted_chars, len(text) - state.stop_matcher.hold_back)
        new_text = text[state.num_emitted_chars : end]
        state.num_emitted_chars = max(state.num_emitted_chars, end)
        new_tokens = request.output_token_ids[state.num_emitted_tokens :]
        state.num_emitted_tokens = request.num_output_tokens
        if request.is_finished:
            self.remove(request.req_id)
        wants_logprobs = request.sampling_params.logprobs is not None
        return RequestDelta(
            req_id=request.req_id,
            token_ids=new_tokens,
            text=new_text,
            logprobs=list(progress.sampled) if wants_logprobs else None,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request_metrics(request),
            prompt_logprobs=self._unsent_prompt_logprobs(request, state),
        )

    @staticmethod
    def _unsent_prompt_logprobs(request: Request, state: _StreamState) -> list[SampledToken | None] | None:
        """The prompt's scores, with the first delta of a request that asks for them."""
        if request.sampling_params.prompt_logprobs is None or state.sent_prompt_logprobs:
            return None
        state.sent_prompt_logprobs = True
        return [None, *request.prompt_logprobs]

    def closing_delta(self, request: Request) -> RequestDelta:
        """The token-less last delta of a request ended outside a step (aborted)."""
        self._streams.pop(request.req_id, None)
        return RequestDelta(
            req_id=request.req_id,
            token_ids=[],
            text="",
            logprobs=None,
            finished=True,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            metrics=request_metrics(request),
        )


def request_metrics(request: Request) -> RequestMetrics:
    return RequestMetrics.from_timestamps(
        request.timestamps,
        num_prompt_tokens=request.num_prompt_tokens,
        num_generation_tokens=request.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_preemptions=request.num_preemptions,
        ttft_slo_s=request.ttft_slo_s,
        predicted_ttft_s=request.predicted_ttft_s,
    )
