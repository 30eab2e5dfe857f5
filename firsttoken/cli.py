"""`firsttoken generate | chat | serve | bench | profile | tune | quantize`: the command line."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from typing import Sequence

from firsttoken.bench.bench_commands import register_bench_verbs
from firsttoken.deploy.deploy_command import add_replica_args
from firsttoken.engine_args import (
    add_engine_args,
    add_model_arg,
    add_pin_system_prompt_arg,
    engine_kwargs,
    read_system_prompt,
)
from firsttoken.calibration.quantize_command import register_quantize_verb
from firsttoken.progress import add_no_progress_arg, announce_engine, announce_engine_start, progress_wanted
from firsttoken.server.serve_command import register_serve_verb


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, default=128, help="tokens to generate at most (default: 128)"
    )
    group.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default: 0.8)")
    group.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1] (default: 0.95)")
    group.add_argument("--top-k", type=int, default=40, help="-1 disables (default: 40)")
    group.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens below this fraction of the top one's probability",
    )
    group.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    group.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 0, over prompt and output tokens (1 is off)"
    )
    group.add_argument(
        "--logit-bias",
        type=_logit_bias,
        default=None,
        metavar="JSON",
        help='{"token id": bias in [-100, 100]}',
    )
    group.add_argument(
        "--min-tokens", type=int, default=0, help="tokens before end-of-sequence may end the reply"
    )
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument(
        "--stop-token-id", dest="stop_token_ids", type=int, action="append", default=[],
        help="token id that ends the reply (repeatable)",
    )
    group.add_argument(
        "--bad-word",
        dest="bad_words",
        action="append",
        default=[],
        help="a word never generated (repeatable)",
    )
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _logit_bias(value: str) -> dict[int, float]:
    try:
        bias = json.loads(value)
        return {int(token_id): float(amount) for token_id, amount in bias.items()}
    except (ValueError, TypeError, AttributeError) as error:
        raise argparse.ArgumentTypeError(
            f'not a JSON object of token ids to biases, e.g. {{"1234": -100}}: {value!r}'
        ) from error


def sampling_params_from(args: argparse.Namespace):
    from firsttoken.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logit_bias=args.logit_bias,
        min_tokens=args.min_tokens,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_ids),
        bad_words=tuple(args.bad_words),
        ignore_eos=args.ignore_eos,
    )


def package_version() -> str:
    """The installed distribution's version; a source tree on the path without an install has no
    metadata, so the package's own `__version__` stands in and says so."""
    try:
        return importlib.metadata.version("firsttoken")
    except importlib.metadata.PackageNotFoundError:
        from firsttoken import __version__

        return f"{__version__} (source tree, not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="firsttoken", description="LLM inference built for the shortest time to first token."
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (default: WARNING)")
    parser.add_argument("--version", action="version", version=f"firsttoken {package_version()}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    generate = verbs.add_parser("generate", help="generate from one prompt, streaming to stdout")
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    add_model_arg(generate)
    add_pin_system_prompt_arg(generate)
    add_sampling_args(generate)
    add_no_progress_arg(generate)
    add_engine_args(generate)
    generate.set_defaults(handler=run_generate)

    chat = verbs.add_parser("chat", help="an interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system prompt")
    add_model_arg(chat)
    add_pin_system_prompt_arg(chat)
    add_sampling_args(chat)
    add_no_progress_arg(chat)
    add_engine_args(chat)
    chat.set_defaults(handler=run_chat)

    add_replica_args(register_serve_verb(verbs))
    register_bench_verbs(verbs)
    register_quantize_verb(verbs)
    return parser


def _open_llm(args: argparse.Namespace, system_prompt: str | None):
    from firsttoken.engine.llm import LLM

    options = engine_kwargs(args)  # a bad option fails before the notice
    announce_engine_start(progress_wanted(args.no_progress))
    llm = LLM(args.model, **options)
    announce_engine(llm.inspect().description)
    if system_prompt is not None:
        llm.pin_system_prompt(system_prompt, pin_id="system-prompt")
    return llm


def _print_request_stats(delta_metrics, stream=sys.stderr) -> None:
    metrics = delta_metrics
    parts = []
    if metrics.ttft_s is not None:
        parts.append(f"TTFT {metrics.ttft_s * 1000:.1f} ms")
    if metrics.prefill_tokens_per_s is not None:
        parts.append(
            f"prefill {metrics.num_prompt_tokens - metrics.num_cached_tokens} tokens at "
            f"{metrics.prefill_tokens_per_s:.1f} tokens/s"
        )
    if metrics.num_cached_tokens:
        parts.append(f"{metrics.num_cached_tokens} prompt tokens from the prefix cache")
    if metrics.decode_tokens_per_s is not None:
        parts.append(
            f"decode {metrics.num_generation_tokens} tokens at {metrics.decode_tokens_per_s:.1f} tokens/s"
        )
    print("[" + ", ".join(parts) + "]", file=stream, flush=True)


def _stream_reply(llm, prompt: str, params) -> str:
    text = []
    metrics = None
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        text.append(delta.text)
        metrics = delta.metrics
    sys.stdout.write("\n")
    if metrics is not None:
        _print_request_stats(metrics)
    return "".join(text)


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params_from(args)
    system_prompt = read_system_prompt(args)
    llm = _open_llm(args, system_prompt)
    prompt = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        prompt = llm.tokenizer.apply_chat_template(messages + [{"role": "user", "content": prompt}])
    _stream_reply(llm, prompt, params)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params_from(args)
    system_prompt = read_system_prompt(args) or args.system
    llm = _open_llm(args, system_prompt if args.pin_system_prompt else None)
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    print("Type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user_text = input("> ")
        except EOFError:
            return 0
        if not user_text.strip():
            return 0
        messages.append({"role": "user", "content": user_text})
        reply = _stream_reply(llm, llm.tokenizer.apply_chat_template(messages), params)
        messages.append({"role": "assistant", "content": reply})


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.handler(args)
    except ValueError as error:
        print(f"firsttoken: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
