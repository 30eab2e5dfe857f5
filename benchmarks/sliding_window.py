"""Sliding-window attention and StreamingLLM against full attention as the context grows: decode
cost per token, TTFT of the context's prefill and of the conversation's next turn, and the KV
blocks a sequence holds.

Two random-weight 2-layer Mistral folders of SmolLM2-135M's layer shapes (hidden 576, 9 query
and 3 KV heads of 64), one with a window of `--window` keys and one without, are written to a
temporary folder (transformers builds them: a dev dependency); StreamingLLM runs the one without,
with `--sink-tokens` sinks and the same window. For each context length, one
request prefills that many random tokens and decodes `--decode-tokens` more; the decode cost is
the mean time between its tokens after the first. Then the next turn: the context, its reply and
`--turn-tokens` new tokens, whose TTFT is a prefix-cache hit on what the conversation left
cached. float32. The KV cache holds the longest context under full attention, and
`--windowed-kv-blocks` blocks (far fewer) with a window, so a long conversation's blocks between
the sinks and the window are evicted by its next turn.

    python benchmarks/sliding_window.py --contexts 1024 8192 32768
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, random_prompt, save_result  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402


def write_model(folder: str, window: int | None, max_context: int) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    tokenizer = open_checkpoint(default_model_path()).tokenizer.backend
    config = MistralConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=max_context,
        sliding_window=window,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(folder)
    tokenizer.save(f"{folder}/tokenizer.json")
    return folder


def measure(llm: LLM, context: int, decode_tokens: int, turn_tokens: int, seed: int) -> dict[str, float]:
    """TTFT, mean seconds per decoded token after the first, the most KV blocks held (during the
    prefill: the window plus a chunk) and those held at the last token; then the next turn's TTFT
    and the tokens of it the prefix cache held."""
    params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
    prompt = random_prompt(context, seed)
    reply: list[int] = []
    start = time.perf_counter()
    token_times = []
    most_held = held = 0
    for delta in llm.stream(prompt, params):
        token_times.append(time.perf_counter())
        reply += delta.token_ids
        if delta.finished:  # its blocks are free by now
            break
        stats = llm.stats()
        held = stats.num_kv_blocks - stats.num_free_kv_blocks
        most_held = max(most_held, held)
    gaps = [later - earlier for earlier, later in zip(token_times, token_times[1:])]
    next_turn = prompt + reply + random_prompt(turn_tokens, seed + 1)
    turn_start = time.perf_counter()
    one_token = SamplingParams(temperature=0, max_tokens=1)
    (answer,) = llm.generate(prompt_token_ids=[next_turn], sampling_params=one_token)
    return {
        "ttft_s": token_times[0] - start,
        "decode_s_per_token": statistics.mean(gaps),
        "most_blocks_held": most_held,
        "blocks_held_decoding": held,
        "next_turn_ttft_s": time.perf_counter() - turn_start,
        "next_turn_cached_tokens": answer.num_cached_tokens,
    }


# Each system: its model folder (with the window or without) and its engine options.
SYSTEMS = ("window", "full", "streaming")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--windowed-kv-blocks", type=int, default=256)
    args = parser.parse_args()
    max_context = max(args.contexts) + args.decode_tokens + 1 + args.turn_tokens + 1
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as folder:
        folders = {
            "window": write_model(f"{folder}/window", args.window, max_context),
            "full": write_model(f"{folder}/full", None, max_context),
        }
        options = {
            "window": ("window", {}),
            "full": ("full", {}),
            "streaming": (
                "full",
                {"streaming_llm": {"window": args.window, "sink_tokens": args.sink_tokens}},
            ),
        }
        bytes_per_token = 2 * 2 * 3 * 64 * 4  # 2 layers of K and V, 3 heads of 64, float32
        kv_tokens = {
            "window": args.windowed_kv_blocks * args.block_size,
            "full": max_context * 5 // 4,
            "streaming": args.windowed_kv_blocks * args.block_size,
        }
        for name in SYSTEMS:
            model, extra = options[name]
            llm = LLM(
                folders[model],
                dtype="float32",
                block_size=args.block_size,
                kv_cache_memory_bytes=kv_tokens[name] * bytes_per_token,
                **extra,
            )
            measure(llm, 256, 4, args.turn_tokens, seed=1)  # warm-up
            results[name] = {
                context: measure(llm, context, args.decode_tokens, args.turn_tokens, seed=context)
                for context in args.contexts
            }
            del llm
    first = args.contexts[0]
    rows = []
    for context in args.contexts:
        row: list[object] = [context]
        for name in SYSTEMS:
            result = results[name][context]
            row += [
                result["decode_s_per_token"] * 1e3,
                result["decode_s_per_token"] / results[name][first]["decode_s_per_token"],
                result["ttft_s"],
                result["next_turn_ttft_s"],
                result["next_turn_cached_tokens"],
                f"{result['blocks_held_decoding']} / {result['most_blocks_held']}",
            ]
        rows.append(row)
    threads = torch.get_num_threads()
    print(
        f"window {args.window} keys (streaming: {args.sink_tokens} sinks too), blocks of {args.block_size} "
        f"tokens, KV cache of {args.windowed_kv_blocks} blocks with a window, float32, {threads} threads; "
        f"next turn: {args.turn_tokens} new tokens"
    )
    headers = ["context"]
    for name in SYSTEMS:
        headers += [f"{name}: decode ms", f"vs {first}", "TTFT s", "next turn TTFT s", "cached"]
        headers.append("blocks decoding / peak")
    print_table(headers, rows)
    print("saved", save_result("sliding_window", {"args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
