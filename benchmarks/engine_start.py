"""Engine start-up benchmark: how long an engine takes to start, and whether its first request
is as fast as the ones after it, for warm-up prefills of several lengths in the same run.

    python benchmarks/engine_start.py [--warm-up-tokens 32 512] [--prompt-len 512] [--repeats 3]

Per warm-up length, taking turns: the engine's start (model already converted and kernels
already built: what every start but a machine's first pays), the TTFT of its first request and
the median TTFT of three later ones (fresh prompts each, prompt cache off). A warm-up that pays
every one-time cost shows a first/later ratio near 1.

Then an engine's start alone against its start beside a live engine of the same form in the
same process, which lends it its prepared weights (firsttoken/worker/shared_weights.py).

Last, one part of a float32 start on native kernels: the search for the GGUF levels of every
projection weight (`MatmulKernels.find_levels`, which decode-sized steps then read), on one
thread, against a copy of the same weights (the least a pass over them costs).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402
from firsttoken.models.loaders.conversion_cache import default_cache_dir  # noqa: E402
from firsttoken.models.registry import default_model_path, open_checkpoint  # noqa: E402
from firsttoken.ops.native import load_native_kernels  # noqa: E402
from firsttoken.worker import startup  # noqa: E402

GREEDY_ONE = SamplingParams(temperature=0, max_tokens=1)
LATER_REQUESTS = 3


def one_start(model: str, warm_up_tokens: int, prompt_len: int, seed: int, dtype: str) -> dict[str, float]:
    """Start an engine whose warm-up prefill has `warm_up_tokens` tokens; its start and TTFTs."""
    startup.WARM_UP_PREFILL_TOKENS = warm_up_tokens
    holder: list[LLM] = []
    start_s = timed(
        lambda: holder.append(
            LLM(model, dtype=dtype, chunk_size=prompt_len, enable_prompt_cache=False, adaptive_threads=False)
        )
    )
    (llm,) = holder

    def ttft(offset: int) -> float:
        prompt = random_prompt(prompt_len, seed=seed * 100 + offset)
        return timed(lambda: llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY_ONE))

    first_s = ttft(0)
    later_s = statistics.median(ttft(offset) for offset in range(1, LATER_REQUESTS + 1))
    return {"start_s": start_s, "first_ttft_s": first_s, "later_ttft_s": later_s}


def start_alone_and_beside(model: str, dtype: str, repeats: int) -> tuple[float, float]:
    """Median starts of an engine with no other alive, and beside a live one of the same form."""
    options = dict(dtype=dtype, chunk_size=512, adaptive_threads=False)
    alone = []
    for _ in range(repeats):
        alone.append(timed(lambda: LLM(model, **options)))
        gc.collect()
    live = LLM(model, **options)
    beside = []
    for _ in range(repeats):
        beside.append(timed(lambda: LLM(model, **options)))
        gc.collect()
    del live
    gc.collect()
    return statistics.median(alone), statistics.median(beside)


def levels_search_and_copy(model: str, repeats: int) -> tuple[float, float]:
    """Median seconds to find the levels of every 2-D weight of `model` in float32, and to copy
    them, on one thread, taking turns."""
    kernels = load_native_kernels(os.path.join(default_cache_dir(), "native"))
    if kernels is None:
        raise SystemExit("the levels search needs the native kernels, which could not be built here")
    weights = [
        tensor.float().contiguous()
        for name, tensor in open_checkpoint(model).read_weights()
        if tensor.dim() == 2 and "embed" not in name
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    search, copy = [], []
    for _ in range(repeats):
        search.append(timed(lambda: [kernels.matmul.find_levels(weight) for weight in weights]))
        copy.append(timed(lambda: [weight.clone() for weight in weights]))
    torch.set_num_threads(threads)
    return statistics.median(search), statistics.median(copy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-up-tokens", type=int, nargs="+", default=[32, 512])
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model = default_model_path()
    LLM(model, dtype=args.dtype, adaptive_threads=False)  # converts and builds once, outside the timings
    samples: dict[int, list[dict[str, float]]] = {tokens: [] for tokens in args.warm_up_tokens}
    for repeat in range(args.repeats):
        for tokens in args.warm_up_tokens:
            samples[tokens].append(one_start(model, tokens, args.prompt_len, repeat, args.dtype))
            gc.collect()  # the engine just measured goes before the next one starts
    baseline = args.warm_up_tokens[-1]
    medians = {
        tokens: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        for tokens, runs in samples.items()
    }
    rows = [
        [
            tokens,
            median["start_s"],
            median["start_s"] / medians[baseline]["start_s"],
            median["first_ttft_s"],
            median["later_ttft_s"],
            median["first_ttft_s"] / median["later_ttft_s"],
        ]
        for tokens, median in medians.items()
    ]
    print(f"prompt {args.prompt_len} tokens, {args.dtype}, medians of {args.repeats} starts each")
    print_table(
        ["warm-up tokens", "start s", f"start / {baseline}", "first TTFT s", "later TTFT s", "first / later"],
        rows,
    )
    alone_s, beside_s = start_alone_and_beside(model, args.dtype, args.repeats)
    print_table(
        ["start alone s", "beside a live engine s", "beside / alone"],
        [[alone_s, beside_s, beside_s / alone_s]],
    )
    search_s, copy_s = levels_search_and_copy(model, args.repeats)
    print_table(
        ["levels search s (1 thread)", "copy s", "search / copy"], [[search_s, copy_s, search_s / copy_s]]
    )
    save_result(
        "engine_start",
        {
            "args": vars(args),
            "medians": medians,
            "start_alone_s": alone_s,
            "start_beside_s": beside_s,
            "levels_search_s": search_s,
            "weights_copy_s": copy_s,
        },
    )


if __name__ == "__main__":
    main()
