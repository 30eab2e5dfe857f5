"""ModelRunner: execute(SchedulerOutput) -> ModelOutput.

The one place a batch description becomes tensors: flat input ids, positions and slot
mapping (decodes first, then prefill chunks), attention metadata, and logits only for the
rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from firsttoken.attention.backend import AttentionBackend, BatchLayout, SequenceLayout
from firsttoken.core.batch import ModelOutput, ScheduledChunk, SchedulerOutput
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.sample.sampler import Sampler


@dataclass
class StepInputs:
    """Host-built tensors of one step, in batch order."""

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [T]
    sample_rows: torch.Tensor  # long [R]: last row of each chunk that samples
    layout: BatchLayout
    ordered_chunks: list[ScheduledChunk]


def order_decodes_first(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    decodes = [chunk for chunk in chunks if chunk.num_tokens == 1]
    prefills = [chunk for chunk in chunks if chunk.num_tokens > 1]
    return decodes + prefills


def build_step_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    ordered = order_decodes_first(chunks)
    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    sample_rows: list[int] = []
    sequences = []
    for chunk in ordered:
        chunk_positions = torch.arange(chunk.start_position, chunk.start_position + chunk.num_tokens)
        block_table = torch.tensor(chunk.block_table, dtype=torch.long)
        slots.append(block_table[chunk_positions // block_size] * block_size + chunk_positions % block_size)
        positions.append(chunk_positions)
        input_ids.extend(chunk.token_ids)
        if chunk.sample is not None:
            sample_rows.append(len(input_ids) - 1)
        sequences.append(SequenceLayout(chunk.num_tokens, chunk.start_position, chunk.block_table))
    num_decodes = sum(1 for chunk in ordered if chunk.num_tokens == 1)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device),
        slot_mapping=torch.cat(slots).to(device),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        layout=BatchLayout(sequences, num_decodes, block_size),
        ordered_chunks=ordered,
    )


class ModelRunner:
    """Runs the model on a scheduled batch and samples; holds the model, backend and sampler."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        sampler: Sampler,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if scheduler_output.is_empty:
            return ModelOutput(sampled={})
        inputs = build_step_inputs(scheduler_output.chunks, self.block_size, self.device)
        hidden = self.forward(inputs)
        sampling_chunks = [chunk for chunk in inputs.ordered_chunks if chunk.sample is not None]
        if not sampling_chunks:
            return ModelOutput(sampled={})
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        sampled = self.sampler.sample(logits, [chunk.sample for chunk in sampling_chunks])
        return ModelOutput(sampled={chunk.req_id: token for chunk, token in zip(sampling_chunks, sampled)})

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        metadata = self.backend.build_metadata(inputs.layout, inputs.slot_mapping)
        return self.model(inputs.input_ids, inputs.positions, metadata)
