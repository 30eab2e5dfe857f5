"""`firsttoken quantize`: the command line of W8A8 calibration (calibrate.py)."""

from __future__ import annotations

import argparse
import sys

from firsttoken.calibration.calibrate import DEFAULT_CALIBRATION_TOKENS, METHODS, calibrate
from firsttoken.engine_args import add_model_arg
from firsttoken.errors import InvalidInputError


def register_quantize_verb(verbs: argparse._SubParsersAction) -> None:
    quantize = verbs.add_parser(
        "quantize", help="calibrate W8A8 over a text: the projections' input maxima, or GPTQ-rounded weights"
    )
    add_model_arg(quantize)
    quantize.add_argument(
        "--calibration-text", required=True, metavar="FILE",
        help="a UTF-8 text like what the model will serve",
    )
    quantize.add_argument(
        "--method", choices=METHODS, default="smoothing",
        help="smoothing: record the input maxima, for --w8a8-activation-stats; gptq: round the turned "
        "model's weights by GPTQ, for --w8a8-rotation --w8a8-weights (default: smoothing)",
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
    seen = calibrate(args.model, text, args.num_tokens, args.output, args.chat_template, args.method)
    kept = "GPTQ-rounded int8 weights" if args.method == "gptq" else "input maxima"
    print(f"{args.output}: {kept} of every layer projection over {seen} tokens", file=sys.stderr)
    return 0
