"""`firsttoken quantize`: calibrate W8A8 offline. The float model runs a calibration text in
prefills, each layer projection's per-channel input maxima are recorded and saved; an engine
with `quantization="w8a8"` and `w8a8_activation_stats=FILE` smooths its projections with them.

    firsttoken quantize --calibration-text notes.txt --output smolm2.w8a8.safetensors
    firsttoken generate "Hello" --quantization w8a8 --w8a8-activation-stats smolm2.w8a8.safetensors
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from firsttoken.engine_args import add_model_arg
from firsttoken.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

    from firsttoken.engine.llm import LLM

CALIBRATION_WINDOW_TOKENS = 1024
DEFAULT_CALIBRATION_TOKENS = 2048


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

    recorder = ActivationMaxima(llm.core.worker.model.layers)
    try:
        llm.generate(prompt_token_ids=windows, sampling_params=SamplingParams(temperature=0, max_tokens=1))
    finally:
        maxima = recorder.detach()
    return maxima


def calibrate(model: str | None, text: str, num_tokens: int, output: str, chat_template: bool = True) -> int:
    """Runs the float32 model over `text` (in chat prompts where `chat_template`) and writes the
    maxima to `output`; returns how many tokens it saw."""
    # Imported here: the command line's other verbs start without torch.
    from firsttoken.engine.llm import LLM
    from firsttoken.worker.activation_stats import save_activation_maxima

    # A batch job on every core: no step-cost model to measure at start for adapting threads.
    llm = LLM(
        model, dtype="float32", enable_prompt_cache=False, chunk_size=CALIBRATION_WINDOW_TOKENS,
        max_num_batched_tokens=CALIBRATION_WINDOW_TOKENS, adaptive_threads=False,
    )
    try:
        windows = calibration_prompts(llm, text, num_tokens, chat_template)
        if not windows:
            raise InvalidInputError("calibration_text", "holds no tokens")
        save_activation_maxima(output, record_activation_maxima(llm, windows))
    finally:
        llm.shutdown()
    return sum(len(window) for window in windows)


def register_quantize_verb(verbs: argparse._SubParsersAction) -> None:
    quantize = verbs.add_parser(
        "quantize", help="calibrate W8A8: record the projections' input maxima over a text"
    )
    add_model_arg(quantize)
    quantize.add_argument(
        "--calibration-text", required=True, metavar="FILE",
        help="a UTF-8 text like what the model will serve",
    )
    quantize.add_argument(
        "--num-tokens", type=int, default=DEFAULT_CALIBRATION_TOKENS,
        help=f"tokens of the text to run (default: {DEFAULT_CALIBRATION_TOKENS})",
    )
    quantize.add_argument(
        "--no-chat-template", dest="chat_template", action="store_false",
        help="run the text as plain prompts (default: each window as a user message of a chat prompt)",
    )
    quantize.add_argument("--output", required=True, metavar="FILE", help="the .safetensors file to write")
    quantize.set_defaults(handler=run_quantize)


def run_quantize(args: argparse.Namespace) -> int:
    if args.num_tokens < 1:
        raise InvalidInputError("num_tokens", f"must be >= 1, got {args.num_tokens}")
    with open(args.calibration_text, encoding="utf-8") as handle:
        text = handle.read()
    seen = calibrate(args.model, text, args.num_tokens, args.output, args.chat_template)
    print(f"{args.output}: input maxima of every layer projection over {seen} tokens", file=sys.stderr)
    return 0
