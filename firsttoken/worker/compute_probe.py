"""Times a compute form (dtype, batch invariance) on the model's own shapes, before the model
is loaded: a one-layer model of the checkpoint's architecture with random weights, built and
prepared as the engine would build it in that form (its projections' kernels, the LM head,
the attention backend), runs a prefill and a one-row decode through the model runner.

A step of the whole model is the measured one-layer step plus the layer's own time (read
between hooks on the layer) for each further layer. Each timed step starts with the caches
flushed: one layer's weights would stay in a cache that a whole model's stream through, and a
decode step, bound by reading them, would look faster than it is. Random weights hold no GGUF
levels, so a float32 decode that reads levels is measured at its float weights: the probe errs
against it.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from firsttoken.attention.selector import select_attention_backend
from firsttoken.config import AttentionConfig
from firsttoken.core.batch import SampleSpec, ScheduledChunk, SchedulerOutput
from firsttoken.models.arch import ModelArch
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.ops.kernels import Kernels
from firsttoken.ops.linear import onednn_packing_available
from firsttoken.ops.native import NativeKernels
from firsttoken.sample.sampler import Sampler
from firsttoken.sampling_params import SamplingParams
from firsttoken.worker.compute_choice import ComputeForm, FormTiming
from firsttoken.worker.kv_cache import allocate_kv_caches
from firsttoken.worker.model_runner import ModelRunner

# A probe prefill's floating-point work per layer is kept near this (a 135M model's layer takes
# 512 tokens, an 8B one's 16), so a large model's probe stays within a second or two.
PROBE_LAYER_FLOPS = 8e9
MAX_PROBE_TOKENS = 512
MIN_PROBE_TOKENS = 16
PREFILL_RUNS = 5
DECODE_RUNS = 9
# Written before each timed step: larger than the last-level caches of the CPUs this runs on.
CACHE_FLUSH_BYTES = 256 << 20
_BLOCK_SIZE = 16
_GREEDY = SamplingParams(temperature=0, max_tokens=1)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def probe_tokens(arch: ModelArch, max_tokens: int) -> int:
    """The probe prefill's length: a power of two near `PROBE_LAYER_FLOPS` of one layer's work,
    within `MIN_PROBE_TOKENS`..`MAX_PROBE_TOKENS` and `max_tokens`."""
    layer_parameters = arch.num_non_embedding_params / arch.num_layers
    tokens = MAX_PROBE_TOKENS
    while tokens > MIN_PROBE_TOKENS and 2 * layer_parameters * tokens > PROBE_LAYER_FLOPS:
        tokens //= 2
    return max(1, min(tokens, max_tokens))


def measure_forms(
    forms: list[ComputeForm],
    arch: ModelArch,
    rope_frequency_divisors: torch.Tensor | None,
    native_kernels: NativeKernels | None,
    attention: AttentionConfig,
    prefill_tokens: int,
) -> list[FormTiming]:
    """Each form's whole-model prefill of `prefill_tokens` tokens and one-row decode step after
    it. The forms' runs take turns, so a change in the machine's load (another process, a
    frequency step) falls on all of them alike instead of on whichever ran then."""
    random_weights: dict[str, torch.Tensor] = {}
    probes = [
        _ProbeModel(
            form, arch, rope_frequency_divisors, native_kernels, attention, prefill_tokens, random_weights
        )
        for form in forms
    ]
    cache_flush = torch.ones(CACHE_FLUSH_BYTES // 4, dtype=torch.float32)
    prefill_steps = [probe.prefill_step() for probe in probes]
    decode_steps = [probe.decode_step() for probe in probes]
    for probe, prefill, decode in zip(probes, prefill_steps, decode_steps, strict=True):
        probe.runner.execute(prefill)  # the untimed first runs: new shapes' set-up, fresh pages
        probe.runner.execute(decode)
    prefill_timings = [_Timings() for _ in probes]
    decode_timings = [_Timings() for _ in probes]
    runs = max(PREFILL_RUNS, DECODE_RUNS)
    with tqdm(total=runs, desc="Measuring compute forms", unit="round", delay=1.0, leave=False) as bar:
        for run in range(runs):
            for index, probe in enumerate(probes):
                if run < PREFILL_RUNS:
                    prefill_timings[index].add(probe.timed(prefill_steps[index], cache_flush))
                if run < DECODE_RUNS:
                    decode_timings[index].add(probe.timed(decode_steps[index], cache_flush))
            bar.update()
    return [
        FormTiming(
            probe.form,
            prefill.whole_model_seconds(probe.num_layers),
            decode.whole_model_seconds(probe.num_layers),
        )
        for probe, prefill, decode in zip(probes, prefill_timings, decode_timings, strict=True)
    ]


@dataclass
class _Timings:
    """A probe step's measured runs: the step's seconds and its one layer's."""

    step_seconds: list[float] = field(default_factory=list)
    layer_seconds: list[float] = field(default_factory=list)

    def add(self, run: tuple[float, float]) -> None:
        self.step_seconds.append(run[0])
        self.layer_seconds.append(run[1])

    def whole_model_seconds(self, num_layers: int) -> float:
        """The median step of the one-layer model, plus the median layer for each further layer."""
        return statistics.median(self.step_seconds) + (num_layers - 1) * statistics.median(self.layer_seconds)


class _ProbeModel:
    """A one-layer model of `arch` in `form`, its KV cache and runner, and a clock on its layer."""

    def __init__(
        self,
        form: ComputeForm,
        arch: ModelArch,
        rope_frequency_divisors: torch.Tensor | None,
        native_kernels: NativeKernels | None,
        attention: AttentionConfig,
        prefill_tokens: int,
        random_weights: dict[str, torch.Tensor],
    ) -> None:
        device = torch.device("cpu")
        dtype = _DTYPES[form.dtype]
        self.num_layers = arch.num_layers
        one_layer = dataclasses.replace(arch, num_layers=1)
        max_positions = prefill_tokens + 1
        backend = select_attention_backend(
            attention,
            device,
            arch.num_heads,
            arch.num_kv_heads,
            native_kernels,
            batch_invariant=form.batch_invariant,
        )
        kernels = Kernels(fused=True, native_kernels=native_kernels)
        self.model = LlamaForCausalLM(
            one_layer, backend, kernels, dtype, max_positions, rope_frequency_divisors
        )
        _fill_random(self.model, random_weights)
        self.model.prepare_projections(
            None, False, onednn_packing_available(dtype, device), batch_invariant=form.batch_invariant
        )
        num_blocks = -(-max_positions // _BLOCK_SIZE)
        self.model.bind_kv_caches(allocate_kv_caches(one_layer, num_blocks, _BLOCK_SIZE, dtype, device))
        sampler = Sampler(0, device, arch.vocab_size, native_kernels)
        self.runner = ModelRunner(self.model, backend, sampler, _BLOCK_SIZE, device)
        self.block_table = list(range(num_blocks))
        self.prefill_tokens = prefill_tokens
        self.vocab_size = arch.vocab_size
        self.form = form
        self._layer_seconds = 0.0
        layer = self.model.layers[0]
        layer.register_forward_pre_hook(self._layer_starts)
        layer.register_forward_hook(self._layer_ends)
        self._layer_started = 0.0

    def prefill_step(self) -> SchedulerOutput:
        token_ids = [(7919 * index) % self.vocab_size for index in range(self.prefill_tokens)]
        return self._step(token_ids, 0)

    def decode_step(self) -> SchedulerOutput:
        return self._step([1], self.prefill_tokens)

    def timed(self, step: SchedulerOutput, cache_flush: torch.Tensor) -> tuple[float, float]:
        """The step's seconds and its layer's, the caches flushed before it (read, not written:
        written lines would be written back during the step)."""
        cache_flush.sum()
        started = time.perf_counter()
        self.runner.execute(step)
        return time.perf_counter() - started, self._layer_seconds

    def _step(self, token_ids: list[int], start_position: int) -> SchedulerOutput:
        chunk = ScheduledChunk(
            req_id="compute-probe",
            token_ids=token_ids,
            start_position=start_position,
            block_table=self.block_table,
            sample=SampleSpec(_GREEDY, 0, "compute-probe"),
        )
        return SchedulerOutput(chunks=[chunk])

    def _layer_starts(self, module, args) -> None:
        self._layer_started = time.perf_counter()

    def _layer_ends(self, module, args, output) -> None:
        self._layer_seconds = time.perf_counter() - self._layer_started


def _fill_random(model: LlamaForCausalLM, random_weights: dict[str, torch.Tensor]) -> None:
    """Weights of a trained model's scale: norms of one; projections and embedding uniform with
    a standard deviation of 0.02, drawn once per name for every probe (`random_weights`)."""
    generator = torch.Generator().manual_seed(0)
    bound = 0.02 * 3**0.5
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)
                continue
            if name not in random_weights:
                random_weights[name] = torch.empty(parameter.shape).uniform_(
                    -bound, bound, generator=generator
                )
            parameter.copy_(random_weights[name])
