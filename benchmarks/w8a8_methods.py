"""Which W8A8 quantization method keeps SmolLM2's answers: quality of several methods, emulated.

    python benchmarks/w8a8_methods.py [--text /usr/share/common-licenses/GPL-3] [--windows 4]
                                      [--methods rtn-smoothed gptq-smoothed rotated rotated-gptq]

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
- gptq-smoothed: the same, with GPTQ's rounding (Frantar et al., 2022): column by column, each
  weight column's rounding error is compensated in the columns not yet rounded, weighted by the
  calibration inputs' second moments.
- rotated: what `w8a8_rotation` runs: the model turned by QuaRot's rotations
  (`firsttoken.models.rotation`), weights rounded to the nearest level.
- rotated-gptq: the turned model's weights rounded by GPTQ, on the turned inputs' moments.
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
from firsttoken.ops.hadamard import HadamardInputs  # noqa: E402
from firsttoken.ops.w8a8 import INT8_LEVELS, SMOOTHING_ALPHA, smoothing_factors  # noqa: E402
from firsttoken.quantize import DEFAULT_CALIBRATION_TOKENS, calibration_prompts  # noqa: E402

REFERENCE = "float32"
# GPTQ's dampening: this share of the mean diagonal is added to the second moments, which keeps
# their inverse defined where an input channel barely varies (the paper's 1%).
GPTQ_DAMPENING = 0.01
GPTQ_BLOCK_COLUMNS = 128


@dataclass
class InputStatistics:
    """One projection's calibration inputs: per-channel maxima [in] and second moments
    X^T X [in, in] (float64)."""

    maxima: torch.Tensor
    second_moments: torch.Tensor


def round_per_row(values: torch.Tensor) -> torch.Tensor:
    """Each row rounded to its symmetric int8 levels (scale: the row's largest magnitude / 127),
    back in float."""
    scales = values.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT8_LEVELS
    return torch.round(values / scales).clamp(-INT8_LEVELS, INT8_LEVELS) * scales


def gptq_round(weight: torch.Tensor, second_moments: torch.Tensor) -> torch.Tensor:
    """GPTQ: `weight` [out, in] on the symmetric per-output-channel int8 levels of its own scales,
    each column's rounding error spread over the later columns through the inverse of the
    inputs' second moments [in, in], so the product with those inputs errs least. float64."""
    weight = weight.double().clone()
    scales = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / INT8_LEVELS
    moments = second_moments.clone()
    unused = torch.diagonal(moments) == 0
    moments[unused, unused] = 1
    weight[:, unused] = 0
    moments += GPTQ_DAMPENING * torch.diagonal(moments).mean() * torch.eye(len(moments), dtype=moments.dtype)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(moments)), upper=True)
    rounded = torch.zeros_like(weight)
    for start in range(0, weight.shape[1], GPTQ_BLOCK_COLUMNS):
        end = min(start + GPTQ_BLOCK_COLUMNS, weight.shape[1])
        block, block_inverse = weight[:, start:end].clone(), inverse[start:end, start:end]
        errors = torch.zeros_like(block)
        for column in range(end - start):
            levels = torch.round(block[:, column] / scales[:, 0]).clamp(-INT8_LEVELS, INT8_LEVELS)
            rounded[:, start + column] = levels * scales[:, 0]
            error = block[:, column] - rounded[:, start + column]
            errors[:, column] = error / block_inverse[column, column]
            block[:, column:] -= errors[:, column : column + 1] * block_inverse[column : column + 1, column:]
        weight[:, end:] -= errors @ inverse[start:end, end:]
    return rounded


class EmulatedW8A8(nn.Module):
    """y = round(x / s) round(W s)^T in float32: inputs divided by the smoothing factors `s`
    (ones for a turned model), then rounded per row; `weight` is W s, already rounded."""

    def __init__(self, weight: torch.Tensor, input_divisors: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight.float()
        self.input_divisors = input_divisors.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float() / self.input_divisors
        return (round_per_row(rows) @ self.weight.t()).to(x.dtype).reshape(*x.shape[:-1], -1)


@dataclass(frozen=True)
class Method:
    rotated: bool
    gptq: bool


METHOD_OPTIONS = {
    "rtn-smoothed": Method(rotated=False, gptq=False),
    "gptq-smoothed": Method(rotated=False, gptq=True),
    "rotated": Method(rotated=True, gptq=False),
    "rotated-gptq": Method(rotated=True, gptq=True),
}
METHODS = list(METHOD_OPTIONS)


def emulated_projection(weight: torch.Tensor, statistics: InputStatistics, method: Method) -> EmulatedW8A8:
    """One projection under `method`: smoothed unless the model is turned, its weight rounded
    to nearest or by GPTQ on its (smoothed) inputs' moments."""
    weight = weight.double()
    if method.rotated:
        factors = torch.ones(weight.shape[1], dtype=torch.float64)
    else:
        factors = smoothing_factors(statistics.maxima, weight, SMOOTHING_ALPHA).double()
    weight = weight * factors
    if method.gptq:
        moments = statistics.second_moments / factors[:, None] / factors[None, :]
        rounded = gptq_round(weight, moments)
    else:
        rounded = round_per_row(weight)
    return EmulatedW8A8(rounded, factors)


def projection_slots(llm: LLM) -> dict[str, tuple[nn.Module, str]]:
    """Where each layer projection's float module sits: a turned model's down_proj is the
    projection behind its Hadamard transform."""
    slots = {}
    for name, owner, attribute in layer_projections(llm.core.worker.model.layers):
        module = getattr(owner, attribute)
        slots[name] = (module, "projection") if isinstance(module, HadamardInputs) else (owner, attribute)
    return slots


def record_input_statistics(llm: LLM, prompts: list[list[int]]) -> dict[str, InputStatistics]:
    """Each layer projection's InputStatistics while `llm` prefills the prompts."""
    statistics: dict[str, InputStatistics] = {}

    def recorder(name: str):
        def record(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            rows = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            maxima, moments = rows.abs().amax(dim=0), rows.t() @ rows
            seen = statistics.get(name)
            if seen is not None:
                maxima, moments = torch.maximum(seen.maxima, maxima), seen.second_moments + moments
            statistics[name] = InputStatistics(maxima, moments)

        return record

    hooks = [
        getattr(owner, attribute).register_forward_pre_hook(recorder(name))
        for name, (owner, attribute) in projection_slots(llm).items()
    ]
    try:
        llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        for hook in hooks:
            hook.remove()
    return statistics


class EmulatedMethods:
    """Installs each method's emulated projections in `llm`, from its float ones and their
    calibration statistics (turning the model, once, before the first rotated method)."""

    def __init__(self, llm: LLM, calibration: list[list[int]]) -> None:
        self.llm, self.calibration = llm, calibration
        self.rotated = False
        self._capture()

    def _capture(self) -> None:
        self.slots = projection_slots(self.llm)
        self.originals = {name: getattr(owner, attribute) for name, (owner, attribute) in self.slots.items()}
        self.statistics = record_input_statistics(self.llm, self.calibration)

    def install(self, method: Method) -> None:
        if method.rotated and not self.rotated:
            self._restore()
            rotate_model(self.llm.core.worker.model)
            self.rotated = True
            self._capture()
        for name, (owner, attribute) in self.slots.items():
            weight = self.originals[name].weight.detach()
            setattr(owner, attribute, emulated_projection(weight, self.statistics[name], method))

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
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
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
        print(f"{name}: weights rounded in {time.perf_counter() - start:.1f} s", flush=True)
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
