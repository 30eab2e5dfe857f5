"""ModelRunner: execute(SchedulerOutput) -> ModelOutput.

The one place a scheduled batch runs, and the one place its path is chosen: its inputs are
built on the host (step_inputs.py), staged to the device in one copy, and run on the fastest
path that takes the step: on CUDA, a captured graph (decode-only steps by batch size, steps
with prefill rows by token count); on a CPU with int4 native kernels, the whole-step native
decode (whole_step_decode.py) for decode-only steps; for a bf16 W8A8 model on AVX512-BF16
kernels, the whole-step native W8A8 forward (whole_step_w8a8.py); else the model's forward. Logits are
computed only for the rows that sample, and for the prompt rows of a request that asks for
prompt logprobs (prompt_logprobs.py).
Nothing synchronises the host with the device before the sampler hands back the ids.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from firsttoken.arithmetic import ceil_div
from firsttoken.attention.backend import AttentionBackend
from firsttoken.attention.staging import StagingBuffer
from firsttoken.core.batch import ModelOutput, ScheduledChunk, SchedulerOutput
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.outputs import GraphCaptureReport, SampledToken
from firsttoken.sample.sampler import Sampler
from firsttoken.stage_observer import LM_HEAD, SAMPLING, StageObserver, observed
from firsttoken.worker.prompt_logprobs import PromptRows, find_prompt_rows, score_prompt_rows
from firsttoken.worker.step_inputs import HostStep, build_host_step
from firsttoken.worker.whole_step_decode import WholeStepDecode, build_whole_step_decode
from firsttoken.worker.whole_step_layers import whole_step_unsupported_reason
from firsttoken.worker.whole_step_w8a8 import WholeStepW8A8, build_whole_step_w8a8

if TYPE_CHECKING:
    from firsttoken.worker.cuda_graphs import DecodeGraphs, GraphCapture, StepGraphs


class ModelRunner:
    """Runs the model on a scheduled batch and samples; owns the model (its KV caches bound),
    attention backend and sampler, the staging buffer of step inputs, the whole-step native
    decode where the model has one, and the graphs once captured.

    Without a sampler (a tensor-parallel rank whose logits go to the driver's sampler) it runs
    its slice of each step and returns no tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        sampler: Sampler | None,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        # Set while a profiler times the step's stages (EngineCore.observing_stages).
        self.stage_observer: StageObserver | None = None
        self.block_size = block_size
        self.device = device
        self.index_dtype = np.dtype(str(backend.index_dtype).removeprefix("torch."))
        self.staging = StagingBuffer(device, backend.index_dtype)
        # Each whole step asks whole_step_unsupported_reason, then whether the weights are its form.
        self.whole_step_unsupported_reason = whole_step_unsupported_reason(model)
        self.whole_step_decode: WholeStepDecode | None = build_whole_step_decode(model)
        self.whole_step_w8a8: WholeStepW8A8 | None = build_whole_step_w8a8(model)
        self.decode_graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None

    def capture_graphs(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_graph_tokens: int,
        scratch_block_id: int,
        capture: GraphCapture | None = None,
    ) -> GraphCaptureReport:
        """Capture steps with prefill rows up to `max_graph_tokens` tokens (none when 0), then
        decode-only steps up to `max_num_seqs` rows; padding writes only `scratch_block_id`, a
        block the KV cache manager never hands out."""
        # Imported here: the graphs need the CUDA backend, which needs triton.
        from firsttoken.attention.cuda_backend import CudaAttentionBackend
        from firsttoken.worker.cuda_graphs import (
            CudaGraphCapture,
            DecodeGraphs,
            StepGraphs,
            device_memory_in_use,
            graph_batch_sizes,
            graph_token_sizes,
        )

        if not isinstance(self.backend, CudaAttentionBackend):
            raise ValueError("cuda graphs: the attention backend must be the CUDA one")
        capture = capture or CudaGraphCapture(self.device)
        batch_sizes = graph_batch_sizes(max_num_seqs)
        token_sizes = graph_token_sizes(max_graph_tokens) if max_graph_tokens else []
        max_blocks_per_seq = ceil_div(max_model_len, self.block_size)
        memory_before = device_memory_in_use(self.device)
        started = time.perf_counter()
        with torch.inference_mode():
            # The largest graphs first: the shared pool is sized once, by them.
            if token_sizes:
                self.step_graphs = StepGraphs(
                    self.model,
                    capture,
                    token_sizes,
                    max_num_seqs,
                    max_blocks_per_seq,
                    self.backend.chunk_tile_tokens,
                    scratch_block_id,
                    self.block_size,
                    self.device,
                )
            self.decode_graphs = DecodeGraphs(
                self.model,
                capture,
                batch_sizes,
                max_blocks_per_seq,
                scratch_block_id,
                self.block_size,
                self.device,
            )
        seconds = time.perf_counter() - started
        return GraphCaptureReport(
            tuple(batch_sizes), tuple(token_sizes), seconds, device_memory_in_use(self.device) - memory_before
        )

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if scheduler_output.is_empty:
            return ModelOutput(sampled={})
        if self.sampler is not None:
            self.sampler.begin_step(scheduler_output)
        step = build_host_step(scheduler_output.chunks, self.block_size, self.index_dtype)
        sampling_chunks = [chunk for chunk in step.chunks if chunk.sample is not None]
        hidden, prompt_logprobs = self.forward_and_score_prompts(step)
        if not sampling_chunks:
            return ModelOutput(sampled={}, prompt_logprobs=prompt_logprobs)
        with observed(self.stage_observer, LM_HEAD):
            logits = self.model.compute_logits(hidden)
        if self.sampler is None:  # its slice of the logits went to the driver's
            return ModelOutput(sampled={})
        assert logits is not None  # the driver holds the gathered logits
        # The step's one synchronisation: the sampler hands the ids to Python.
        with observed(self.stage_observer, SAMPLING):
            sampled = self.sampler.sample(
                logits, [spec for chunk in sampling_chunks for spec in chunk.sample_specs()]
            )
        return _model_output(sampling_chunks, sampled, prompt_logprobs)

    def forward_and_score_prompts(self, step: HostStep) -> tuple[torch.Tensor, dict[str, list[SampledToken]]]:
        """Hidden states [R, hidden] of the rows that sample, and the prompt logprobs of the
        chunks that ask for them (their LM head runs first, on every rank alike)."""
        prompt_rows = find_prompt_rows(step)
        if prompt_rows is None:
            return self.forward_sampled_rows(step), {}
        return self._forward_scoring(step, prompt_rows)

    def _forward_scoring(
        self, step: HostStep, prompt_rows: PromptRows
    ) -> tuple[torch.Tensor, dict[str, list[SampledToken]]]:
        hidden = self._replay(step)
        if hidden is None:
            staged = self.staging.stage([step.input_ids, step.positions, step.slot_mapping])
            hidden = self._forward_eagerly(step, *staged)
        scored = score_prompt_rows(self.model.compute_logits, hidden, prompt_rows)
        if step.samples_every_row:
            return hidden, scored
        (sample_rows,) = self.staging.stage([step.sample_rows])
        return hidden[sample_rows], scored

    def forward_sampled_rows(self, step: HostStep) -> torch.Tensor:
        """Run the step; hidden states [R, hidden] of the rows that sample, still on the device."""
        hidden = self._replay(step)
        if hidden is not None:
            if step.samples_every_row:
                return hidden
            (sample_rows,) = self.staging.stage([step.sample_rows])
            return hidden[sample_rows]
        input_ids, positions, slot_mapping, sample_rows = self.staging.stage(
            [step.input_ids, step.positions, step.slot_mapping, step.sample_rows]
        )
        hidden = self._forward_eagerly(step, input_ids, positions, slot_mapping)
        return hidden if step.samples_every_row else hidden[sample_rows]

    def _forward_eagerly(
        self, step: HostStep, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of a step no graph holds, from its staged inputs: the
        whole-step native decode or W8A8 forward where one serves the step, else the model's
        forward."""
        if self.whole_step_decode is not None and self.whole_step_decode.takes(step.layout):
            return self.whole_step_decode.run(input_ids, positions, slot_mapping, step.layout)
        if self.whole_step_w8a8 is not None and self.whole_step_w8a8.takes(step.layout):
            return self.whole_step_w8a8.run(input_ids, positions, slot_mapping, step.layout)
        metadata = self.backend.build_metadata(step.layout, slot_mapping)
        return self.model(input_ids, positions, metadata)

    def _replay(self, step: HostStep) -> torch.Tensor | None:
        """Hidden states [T, hidden] of the step from a captured graph; None when none holds it."""
        for graphs in (self.decode_graphs, self.step_graphs):
            size = graphs.padded_size(step) if graphs is not None else None
            if size is not None:
                return graphs.run(step, size)
        return None


def _model_output(
    sampling_chunks: list[ScheduledChunk],
    sampled: list[SampledToken],
    prompt_logprobs: dict[str, list[SampledToken]],
) -> ModelOutput:
    """Each chunk's first sampled row, and a verify chunk's further rows."""
    first, verified = {}, {}
    row = 0
    for chunk in sampling_chunks:
        first[chunk.req_id] = sampled[row]
        if chunk.num_draft_tokens:
            verified[chunk.req_id] = sampled[row + 1 : row + chunk.num_sampled_rows]
        row += chunk.num_sampled_rows
    return ModelOutput(sampled=first, verified=verified, prompt_logprobs=prompt_logprobs)
