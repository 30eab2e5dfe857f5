"""CudaModelRunner: ModelRunner's execute() for an accelerator, with no host synchronisation
inside a step until the sampled ids are converted to Python.

Step inputs are built as host arrays and staged through pinned memory (one non-blocking copy);
decode-only steps that fit the graph ladder replay a captured graph, every other step runs
eagerly. The model, attention backend and sampler are those of the wrapped ModelRunner.
"""

from __future__ import annotations

import torch

from firsttoken.attention.cuda_backend import CudaAttentionBackend
from firsttoken.core.batch import ModelOutput, SchedulerOutput
from firsttoken.worker.cuda_graphs import CudaGraphCapture, DecodeGraphs, GraphCapture, graph_batch_sizes
from firsttoken.worker.host_buffers import HostStep, StagingBuffer, build_host_step
from firsttoken.worker.model_runner import ModelRunner


class CudaModelRunner:
    """Runs scheduled steps on the device; owns the input staging buffer and the decode graphs."""

    def __init__(self, runner: ModelRunner, graphs: DecodeGraphs | None) -> None:
        self.runner = runner
        self.graphs = graphs
        self.staging = StagingBuffer(runner.device, torch.int32)

    @classmethod
    def build(
        cls,
        runner: ModelRunner,
        max_num_seqs: int,
        max_model_len: int,
        scratch_block_id: int | None,
        capture: GraphCapture | None = None,
    ) -> CudaModelRunner:
        """Capture decode graphs up to `max_num_seqs` rows when given a scratch block for their
        padding rows; without one, every step runs eagerly."""
        if scratch_block_id is None:
            return cls(runner, None)
        if not isinstance(runner.backend, CudaAttentionBackend):
            raise ValueError("cuda graphs: the attention backend must be the CUDA one")
        with torch.inference_mode():
            graphs = DecodeGraphs(
                runner.model,
                runner.backend,
                capture or CudaGraphCapture(runner.device),
                graph_batch_sizes(max_num_seqs),
                max_blocks_per_seq=-(-max_model_len // runner.block_size),
                scratch_block_id=scratch_block_id,
                block_size=runner.block_size,
                device=runner.device,
            )
        return cls(runner, graphs)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        if scheduler_output.is_empty:
            return ModelOutput(sampled={})
        step = build_host_step(scheduler_output.chunks, self.runner.block_size)
        hidden = self.forward_sampled_rows(step)
        sampling_chunks = [chunk for chunk in step.chunks if chunk.sample is not None]
        if not sampling_chunks:
            return ModelOutput(sampled={})
        logits = self.runner.model.compute_logits(hidden)
        # The step's one synchronisation: the sampler hands the ids to Python.
        sampled = self.runner.sampler.sample(logits, [chunk.sample for chunk in sampling_chunks])
        return ModelOutput(sampled={chunk.req_id: token for chunk, token in zip(sampling_chunks, sampled)})

    def forward_sampled_rows(self, step: HostStep) -> torch.Tensor:
        """Run the step; hidden states [R, hidden] of the rows that sample, still on the device."""
        size = self.graphs.padded_size(step) if self.graphs is not None else None
        if size is not None:
            hidden = self.graphs.run(step, size)
            if step.samples_every_row:
                return hidden
            (sample_rows,) = self.staging.stage([step.sample_rows])
            return hidden[sample_rows]
        input_ids, positions, slot_mapping, sample_rows = self.staging.stage(
            [step.input_ids, step.positions, step.slot_mapping, step.sample_rows]
        )
        metadata = self.runner.backend.build_metadata(step.layout, slot_mapping)
        hidden = self.runner.model(input_ids, positions, metadata)
        return hidden[sample_rows]
