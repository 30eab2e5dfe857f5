"""What n-gram speculative decoding buys: decode speed and TTFT with and without it.

    python benchmarks/speculative.py [--max-tokens 96] [--batches 1 4] [--repeats 5] [--dtype auto]

Three engines on the same model and dtype, timed in turns in one process: n-gram speculation, a
draft model (the embedded model drafting for itself: a correctness check, acceptance ~100%,
not a speed-up) and none. The prompts ask the model to restate or edit text it was given
(code with comments, a list again), the work prompt lookup exists for; free chat and random
token prompts show what it costs where little matches. Prints per-request generation time,
tokens/s, TTFT and the acceptance rate; the JSON goes to bench_results/.
`--dtype auto` (the default) is what an engine picks on the device: bf16 on a GPU and on CPUs
that multiply bf16 natively, float32 on other CPUs (where bf16 arithmetic is emulated).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_medians, print_table, random_prompt, save_result, timed

from firsttoken import LLM, SamplingParams
from firsttoken.models.registry import default_model_path
from firsttoken.outputs import EngineStats

CODE = '''def merge(left, right):
    result = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            result.append(left[i])
            i += 1
        else:
            result.append(right[j])
            j += 1
    result.extend(left[i:])
    result.extend(right[j:])
    return result
'''
WORKLOADS = {
    "edit code": [
        [{"role": "user", "content": f"Add a comment above each line of this function:\n\n{CODE}"}],
        [
            {
                "role": "user",
                "content": f"Rename `result` to `merged` in this function and print it whole:\n\n{CODE}",
            }
        ],
    ],
    "free chat": [
        [{"role": "user", "content": "Tell me about the history of tea, in a few sentences."}],
        [{"role": "user", "content": "Why do cats purr? Answer briefly."}],
    ],
    "restate list": [
        [
            {
                "role": "user",
                "content": "Repeat exactly: red, orange, yellow, green, blue, indigo, violet, "
                "white, black, grey, brown, pink, purple, gold, silver.",
            }
        ],
    ],
}


def chat_run(llm: LLM, conversations: list, params: SamplingParams, batch: int):
    def run(index: int) -> float:
        if batch == 1:
            return timed(lambda: llm.chat(conversations[index % len(conversations)], params))
        return timed(lambda: llm.chat((conversations * batch)[:batch], params))

    return run


def random_run(llm: LLM, params: SamplingParams, batch: int):
    def run(index: int) -> float:
        prompts = [random_prompt(64, seed=100 * index + offset) for offset in range(batch)]
        return timed(lambda: llm.generate(prompt_token_ids=prompts, sampling_params=params))

    return run


def acceptance(before: EngineStats, after: EngineStats) -> float:
    proposed = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return accepted / proposed if proposed else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    options = {"dtype": args.dtype, "enable_prompt_cache": False, "kv_cache_memory_bytes": 512 << 20}
    speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    engines = {
        "ngram": LLM(**options, speculative_config=speculative),
        "draft": LLM(**options, speculative_config={"method": "draft", "model": default_model_path(),
                                                    "num_speculative_tokens": args.num_speculative_tokens}),
        "plain": LLM(**options),
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, payload = [], {}
    for batch in args.batches:
        cases = {
            name: {engine: chat_run(llm, conversations, params, batch) for engine, llm in engines.items()}
            for name, conversations in WORKLOADS.items()
        }
        cases["random tokens"] = {engine: random_run(llm, params, batch) for engine, llm in engines.items()}
        for name, runs in cases.items():
            before = {engine: engines[engine].stats() for engine in ("ngram", "draft")}
            medians = interleaved_medians(runs, args.repeats)
            rates = {engine: acceptance(before[engine], engines[engine].stats()) for engine in before}
            tokens = batch * args.max_tokens
            rows.append([f"{name}, batch {batch}", tokens / medians["ngram"], tokens / medians["draft"],
                         tokens / medians["plain"], medians["plain"] / medians["ngram"], rates["ngram"],
                         rates["draft"]])
            payload[f"{name} batch {batch}"] = {"seconds": medians, "acceptance_rate": rates}
    print_table(["workload", "ngram tok/s", "draft tok/s", "plain tok/s", "ngram speed-up", "ngram accepted",
                 "draft accepted"], rows)
    first_token = SamplingParams(temperature=0, max_tokens=1)
    ttft = interleaved_medians(
        {name: chat_run(llm, WORKLOADS["edit code"], first_token, 1) for name, llm in engines.items()},
        args.repeats,
    )
    print(
        f"TTFT (edit code, alone): ngram {ttft['ngram'] * 1000:.1f} ms, plain {ttft['plain'] * 1000:.1f} ms, "
        f"ratio {ttft['ngram'] / ttft['plain']:.3f}"
    )
    payload["ttft_s"] = ttft
    print(f"saved {save_result('speculative', payload)}")


if __name__ == "__main__":
    main()
