"""Which W8A8 quantization method keeps SmolLM2's answers: quality of several methods, emulated.

    python benchmarks/w8a8_methods.py [--text /usr/share/common-licenses/GPL-3] [--windows 4]
                                      [--methods rtn-smoothed gptq-smoothed rotated rotated-gptq]
    python benchmarks/w8a8_methods.py --methods rotated-gptq rotated-gptq-9-bit-inputs \
        rotated-gptq-float-qkv_proj-inputs rotated-gptq-float-o_proj-inputs \
        rotated-gptq-float-gate_up_proj-inputs rotated-gptq-float-down_proj-inputs

Every layer projection runs as a float32 module that rounds its weights and its inputs to the
int8 levels a W8A8 projection would multiply (weights symmetric per output channel, inputs
symmetric per token), so each row measures the method, not a kernel: the int32 sums of the real
kernels are exact, and "rtn-smoothed" and "rotated" here give the agreement of
benchmarks/w8a8.py's "w8a8 smoothed" and "w8a8 rotated" engines to within a few tokens in a
thousand. Quality is measured as there: the text in windows of 1024 tokens, perplexity, and
teacher-forced top-1 agreement with float32.

Methods (calibration: the 2048 tokens after the scored windows, in chat prompts, as
`firsttoken quantize` runs them):
- rtn-smoothed: what `quantization="w8a8"` with `w8a8_activation_stats` runs: SmoothQuant's
  migration (alpha 0.5) from the inputs' maxima, weights rounded to the nearest level.
- gptq-smoothed: the same, with GPTQ's rounding (Frantar et al., 2022; `firsttoken.ops.gptq`):
  column by column, each weight column's rounding error is compensated in the columns not yet
  rounded, weighted by the calibration inputs' second moments.
- rotated: what `w8a8_rotation` runs: the model turned by QuaRot's rotations
  (`firsttoken.models.rotation`), weights rounded to the nearest level.
- rotated-gptq: the turned model's weights rounded by GPTQ, on the turned inputs' moments (what
  `firsttoken quantize --method gptq` writes for `w8a8_weights`).

Where the rest of the error lies (not methods the engine runs; the default run leaves them out):
- rotated-gptq-9-bit-inputs: rotated-gptq with each input row rounded to 9-bit levels (-255..255)
  instead of int8's: what one more bit of activation would keep.
- rotated-gptq-float-<projection>-inputs: rotated-gptq with that projection's inputs (in every
  layer) left float, its weights still GPTQ's levels: how much of the loss that projection's
  input rounding makes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, save_result  # noqa: E402
from w8a8 import WINDOW_TOKENS, quality_rows, scored_positions, text_windows  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.llama import layer_projections  # noqa: E402
from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.models.rotation import rotate_model  # noqa: E402
from firsttoken.ops.gptq import gptq_int8  # noqa: E402
from firsttoken.ops.hadamard import HadamardInputs  # noqa: E402
from firsttoken.ops.w8a8 import INT8_LEVELS, SMOOTHING_ALPHA, smoothing_factors  # noqa: E402
from firsttoken.calibration.calibrate import DEFAULT_CALIBRATION_TOKENS, calibration_prompts  # noqa: E402
from firsttoken.worker.activation_stats import ActivationMaxima  # noqa: E402
from firsttoken.worker.w8a8_weights import InputMoments  # noqa: E402

REFERENCE = "float32"


@dataclass
class InputStatistics:
    """One projection's calibration inputs: per-channel maxima [in] and second moments
    X^T X [in, in] (float64)."""

    maxima: torch.Tensor
    second_moments: torch.Tensor


NINE_BIT_LEVELS = 255
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def round_per_row(values: torch.Tensor, levels: int = INT8_LEVELS) -> torch.Tensor:
    """Each row rounded to its symmetric levels -levels..levels (scale: the row's largest
    magnitude / levels; int8's by default), back in float."""
    scales = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / levels
    return torch.round(values / scales).clamp(-levels, levels) * scales


class EmulatedW8A8(nn.Module):
    """y = round(x / s) round(W s)^T in float32: inputs divided by the smoothing factors `s`
    (ones for a turned model), then rounded per row to `input_levels` (None: left float);
    `weight` is W s, already rounded."""

    def __init__(self, weight: torch.Tensor, input_divisors: torch.Tensor, input_levels: int | None) -> None:
        super().__init__()
        self.weight = weight.float()
        self.input_divisors = input_divisors.float()
        self.input_levels = input_levels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float() / self.input_divisors
        if self.input_levels is not None:
            rows = round_per_row(rows, self.input_levels)
        return (rows @ self.weight.t()).to(x.dtype).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Method:
    rotated: bool
    gptq: bool
    input_levels: int = INT8_LEVELS
    float_inputs: str | None = None  # a projection whose inputs stay float in every layer

    def input_levels_of(self, name: str) -> int | None:
        """The levels `name`'s (layers.<i>.<projection>) inputs round to; None: left float."""
        return None if name.rsplit(".", 1)[-1] == self.float_inputs else self.input_levels


METHOD_OPTIONS = {
    "rtn-smoothed": Method(rotated=False, gptq=False),
    "gptq-smoothed": Method(rotated=False, gptq=True),
    "rotated": Method(rotated=True, gptq=False),
    "rotated-gptq": Method(rotated=True, gptq=True),
}
DEFAULT_METHODS = list(METHOD_OPTIONS)
METHOD_OPTIONS["rotated-gptq-9-bit-inputs"] = Method(rotated=True, gptq=True, input_levels=NINE_BIT_LEVELS)
METHOD_OPTIONS |= {
    f"rotated-gptq-float-{projection}-inputs": Method(rotated=True, gptq=True, float_inputs=projection)
    for projection in PROJECTIONS
}


@dataclass
class RoundedWeight:
    """A projection's weight W s as a method rounds it, and the divisors s of its inputs."""

    weight: torch.Tensor
    input_divisors: torch.Tensor


def rounded_weight(weight: torch.Tensor, statistics: InputStatistics, method: Method) -> RoundedWeight:
    """One projection's weight under `method`: smoothed unless the model is turned, rounded to
    nearest or by GPTQ on its (smoothed) inputs' moments."""
    weight = weight.double()
    if method.rotated:
        factors = torch.ones(weight.shape[1], dtype=torch.float64)
    else:
        factors = smoothing_factors(statistics.maxima, weight, SMOOTHING_ALPHA).double()
    weight = weight * factors
    if method.gptq:
        moments = statistics.second_moments / factors[:, None] / factors[None, :]
        rounded = gptq_int8(weight, moments).dequantized()
    else:
        rounded = round_per_row(weight)
    return RoundedWeight(rounded.float(), factors.float())


def projection_slots(llm: LLM) -> dict[str, tuple[nn.Module, str]]:
    """Where each layer projection's float module sits: a turned model's down_proj is the
    projection behind its Hadamard transform."""
    slots = {}
    for name, owner, attribute in layer_projections(llm.core.single_rank_model().layers):
        module = getattr(owner, attribute)
        slots[name] = (module, "projection") if isinstance(module, HadamardInputs) else (owner, attribute)
    return slots


def record_input_statistics(llm: LLM, prompts: list[list[int]]) -> dict[str, InputStatistics]:
    """Each layer projection's InputStatistics while `llm` prefills the prompts (the maxima of an
    unturned model's inputs, which only smoothing reads; the moments of the inputs it multiplies)."""
    layers = llm.core.single_rank_model().layers
    names = {name for name, _, _ in layer_projections(layers)}
    maxima, moments = ActivationMaxima(layers), InputMoments(layers, names)
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        recorded_maxima, recorded_moments = maxima.detach(), moments.detach()
    return {name: InputStatistics(recorded_maxima[name], recorded_moments[name]) for name in names}


class EmulatedMethods:
    """Installs each method's emulated projections in `llm`, from its float ones and their
    calibration statistics (turning the model, once, before the first rotated method)."""

    def __init__(self, llm: LLM, calibration: list[list[int]]) -> None:
        self.llm, self.calibration = llm, calibration
        self.rotated = False
        # Methods that differ only in their inputs share one rounding of the weights (GPTQ's
        # takes a minute): by (rotated, gptq).
        self.rounded: dict[tuple[bool, bool], dict[str, RoundedWeight]] = {}
        self._capture()

    def _capture(self) -> None:
        self.slots = projection_slots(self.llm)
        self.originals = {name: getattr(owner, attribute) for name, (owner, attribute) in self.slots.items()}
        self.statistics = record_input_statistics(self.llm, self.calibration)

    def install(self, method: Method) -> None:
        if method.rotated and not self.rotated:
            self._restore()
            rotate_model(self.llm.core.single_rank_model())
            self.rotated = True
            self._capture()
        key = (method.rotated, method.gptq)
        if key not in self.rounded:
            self.rounded[key] = {
                name: rounded_weight(self.originals[name].weight.detach(), self.statistics[name], method)
                for name in self.slots
            }
        for name, (owner, attribute) in self.slots.items():
            rounded = self.rounded[key][name]
            emulated = EmulatedW8A8(rounded.weight, rounded.input_divisors, method.input_levels_of(name))
            setattr(owner, attribute, emulated)

    def _restore(self) -> None:
        for name, (owner, attribute) in self.slots.items():
            setattr(owner, attribute, self.originals[name])


def calibration_text_prompts(llm: LLM, path: str, skipped_tokens: int) -> list[list[int]]:
    with open(path, encoding="utf-8") as handle:
        after_scored = llm.tokenizer.decode(llm.tokenizer.encode(handle.read())[skipped_tokens:])
    return calibration_prompts(llm, after_scored, DEFAULT_CALIBRATION_TOKENS, chat_template=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--methods", nargs="+", choices=list(METHOD_OPTIONS), default=DEFAULT_METHODS)
    args = parser.parse_args()
    # Not batch invariant: its projections are plain float32 Linears, whose weights the methods read.
    llm = LLM(
        default_model_path(), dtype="float32", batch_invariant=False, enable_prompt_cache=False,
        chunk_size=WINDOW_TOKENS, max_num_batched_tokens=WINDOW_TOKENS, kv_cache_memory_bytes=512 << 20,
    )
    windows = text_windows(llm, args.text, args.windows)
    scores = {REFERENCE: scored_positions(llm, windows)}
    methods = EmulatedMethods(llm, calibration_text_prompts(llm, args.text, len(windows) * WINDOW_TOKENS))
    # Unturned methods first: the model turns once, for the rest.
    for name in sorted(args.methods, key=lambda name: METHOD_OPTIONS[name].rotated):
        start = time.perf_counter()
        methods.install(METHOD_OPTIONS[name])
        print(f"{name}: installed in {time.perf_counter() - start:.1f} s", flush=True)
        scores[name] = scored_positions(llm, windows)
    print(f"\nQuality: {len(windows)} windows of {WINDOW_TOKENS} tokens of {args.text}")
    quality = quality_rows(scores)
    print_table(
        ["method", "perplexity", f"ratio to {REFERENCE}", f"top-1 agreement with {REFERENCE}"], quality
    )
    path = save_result("w8a8_methods", {"quality": quality, "windows": len(windows), "text": args.text})
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
