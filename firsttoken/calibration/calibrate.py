"""W8A8 calibration (`firsttoken quantize`, quantize_command.py): the float model runs a calibration text in
prefills, and one of two methods keeps what W8A8 needs from it:

- `--method smoothing` (the default) records each layer projection's per-channel input maxima;
  an engine with `quantization="w8a8"` and `w8a8_activation_stats=FILE` smooths its projections
  with them (SmoothQuant).
- `--method gptq` turns the model as `w8a8_rotation` does, records each projection's input
  second moments and rounds its weights to int8 by GPTQ (`firsttoken.ops.gptq`); an engine with
  `quantization="w8a8"`, `w8a8_rotation` and `w8a8_weights=FILE` multiplies those levels.

    firsttoken quantize --calibration-text notes.txt --output smolm2.w8a8.safetensors
    firsttoken generate "Hello" --quantization w8a8 --w8a8-activation-stats smolm2.w8a8.safetensors

    firsttoken quantize --method gptq --calibration-text notes.txt --output smolm2.gptq.safetensors
    firsttoken generate "Hello" --quantization w8a8 --w8a8-rotation --w8a8-weights smolm2.gptq.safetensors
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from firsttoken.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

    from firsttoken.engine.llm import LLM
    from firsttoken.ops.w8a8 import Int8Weight

CALIBRATION_WINDOW_TOKENS = 1024
DEFAULT_CALIBRATION_TOKENS = 2048
METHODS = ("smoothing", "gptq")
# The second moments recorded in one pass over the calibration text (float64 [in, in] per
# projection): SmolLM2-135M's 30 layers take 0.8 GiB and one pass; an 8B Llama's take 2 GiB
# each, one pass per layer (each pass runs the whole model; rounding one down_proj holds about
# four more matrices of its size, 6.5 GB there).
MOMENTS_BYTES_PER_PASS = 2 << 30


def calibration_windows(token_ids: list[int], num_tokens: int) -> list[list[int]]:
    """The first `num_tokens` of a text's token ids in prompts of up to CALIBRATION_WINDOW_TOKENS."""
    kept = token_ids[:num_tokens]
    return [
        kept[start : start + CALIBRATION_WINDOW_TOKENS]
        for start in range(0, len(kept), CALIBRATION_WINDOW_TOKENS)
    ]


def calibration_prompts(llm: LLM, text: str, num_tokens: int, chat_template: bool) -> list[list[int]]:
    """The text's first `num_tokens` in windows, each the user message of a chat prompt where
    `chat_template`: the template's special tokens drive some channels far past plain text's
    (calibrated on plain text only, smoothing broke chat answers: SmolLM2 answered "What is
    the capital of France?" with French gibberish)."""
    windows = calibration_windows(llm.tokenizer.encode(text), num_tokens)
    if not chat_template:
        return windows
    return [
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template([{"role": "user", "content": llm.tokenizer.decode(window)}])
        )
        for window in windows
    ]


def record_activation_maxima(llm: LLM, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each layer projection's per-channel input maxima while `llm` (float weights, one rank,
    the prompt cache off: a cached prefix is not run) prefills the windows."""
    from firsttoken.sampling_params import SamplingParams
    from firsttoken.worker.activation_stats import ActivationMaxima

    recorder = ActivationMaxima(llm.core.single_rank_model().layers)
    try:
        llm.generate(prompt_token_ids=windows, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        maxima = recorder.detach()
    return maxima


def moments_passes(layers: torch.nn.ModuleList) -> list[set[str]]:
    """The layer projections' names in groups of whole layers whose second moments fit
    MOMENTS_BYTES_PER_PASS (a layer at least), one calibration pass each."""
    from firsttoken.worker.w8a8_weights import multiplied_projections

    passes: list[set[str]] = []
    layer_bytes: dict[int, int] = {}
    layer_names: dict[int, set[str]] = {}
    for name, module in multiplied_projections(layers):
        index = int(name.split(".")[1])
        layer_bytes[index] = layer_bytes.get(index, 0) + module.weight.shape[1] ** 2 * 8
        layer_names.setdefault(index, set()).add(name)
    group: set[str] = set()
    group_bytes = 0
    for index in sorted(layer_names):
        if group and group_bytes + layer_bytes[index] > MOMENTS_BYTES_PER_PASS:
            passes.append(group)
            group, group_bytes = set(), 0
        group |= layer_names[index]
        group_bytes += layer_bytes[index]
    passes.append(group)
    return passes


def gptq_weights(llm: LLM, windows: list[list[int]]) -> dict[str, Int8Weight]:
    """Turns `llm`'s model (float weights, one rank, the prompt cache off) as `w8a8_rotation`
    does and rounds each layer projection's turned weight by GPTQ, on the second moments of its
    turned inputs while the model prefills the windows (some layers per pass, see
    `moments_passes`)."""
    from firsttoken.models.rotation import rotate_model, rotation_unsupported_reason
    from firsttoken.ops.gptq import gptq_int8
    from firsttoken.sampling_params import SamplingParams
    from firsttoken.worker.w8a8_weights import InputMoments, multiplied_projections

    model = llm.core.single_rank_model()
    reason = rotation_unsupported_reason(model)
    if reason is not None:
        raise InvalidInputError("model", f"GPTQ rounds the model turned by w8a8_rotation, and {reason}")
    rotate_model(model)
    modules = dict(multiplied_projections(model.layers))
    weights: dict[str, Int8Weight] = {}
    for names in moments_passes(model.layers):
        recorder = InputMoments(model.layers, names)
        try:
            llm.generate(
                prompt_token_ids=windows, sampling_params=SamplingParams(temperature=0, max_tokens=1)
            )
        finally:
            moments = recorder.detach()
        for name in sorted(names):
            weights[name] = gptq_int8(modules[name].weight, moments.pop(name))
    return weights


def calibrate(
    model: str | None,
    text: str,
    num_tokens: int,
    output: str,
    chat_template: bool = True,
    method: str = "smoothing",
) -> int:
    """Runs the float32 model over `text` (in chat prompts where `chat_template`) and writes
    what `method` keeps to `output` (see the module docstring); returns how many tokens it saw."""
    # Imported here: the command line's other verbs start without torch.
    from firsttoken.engine.llm import LLM
    from firsttoken.worker.activation_stats import save_activation_maxima
    from firsttoken.worker.w8a8_weights import save_w8a8_weights

    if method not in METHODS:
        raise InvalidInputError("method", f"must be one of {METHODS}, got {method!r}")
    # A batch job on every core: no step-cost model to measure at start for adapting threads.
    # Not batch invariant: its projections stay plain float Linears, which GPTQ turns and reads.
    # On the CPU, where W8A8 runs.
    llm = LLM(
        model, dtype="float32", device="cpu", enable_prompt_cache=False, chunk_size=CALIBRATION_WINDOW_TOKENS,
        max_num_batched_tokens=CALIBRATION_WINDOW_TOKENS, adaptive_threads=False, batch_invariant=False,
    )
    try:
        inspection = llm.inspect()
        if inspection.checkpoint_quantization is not None:
            raise InvalidInputError(
                "model", f"{inspection.model_path} is quantized already: calibrate its float checkpoint"
            )
        windows = calibration_prompts(llm, text, num_tokens, chat_template)
        if not windows:
            raise InvalidInputError("calibration_text", "holds no tokens")
        seen = sum(len(window) for window in windows)
        if method == "gptq":
            save_w8a8_weights(output, gptq_weights(llm, windows), method, seen)
        else:
            save_activation_maxima(output, record_activation_maxima(llm, windows))
    finally:
        llm.shutdown()
    return seen
