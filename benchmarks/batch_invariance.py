"""What batch invariance costs: TTFT and decode speed with `batch_invariant` on and off.

    python benchmarks/batch_invariance.py [--device cpu|cuda] [--input-lens 128 512 2048] \\
        [--decode-batches 1 8] [--repeats 7] [--dtype auto]

Two engines on the same model and dtype, one with `batch_invariant=True` (on the CPU
one-row matmuls run as two rows, on CUDA every projection runs on the row-invariant Triton
matmul and every attention row on the chunk kernel's tiles), one without (oneDNN's one-row
kernel; on CUDA cuBLAS and SDPA prefills), timed in turns in one process so that drift in this
machine's speed hits both alike. TTFT: one fresh prompt alone (prefill, LM head, sampling).
Decode: tokens per second of a batch of streams with 256-token prompts, 32 steps each.
Prints medians and invariant / plain; the JSON goes to bench_results/.
`--dtype auto` (the default) is what an engine picks on the device: bf16 on a GPU, and on a CPU
the dtype it measures faster at start (bf16 only where oneDNN has bf16 kernels). An engine's own
default, `batch_invariant="auto"`, weighs these same costs (`benchmarks/compute_forms.py`).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import engine_dtype_name, interleaved_medians, print_table, random_prompt, save_result, timed  # noqa: E402

from firsttoken import LLM, SamplingParams  # noqa: E402

FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
DECODE_STEPS = 32


def ttft_run(llm: LLM, input_len: int):
    def run(index: int) -> float:
        return timed(
            lambda: llm.generate(
                prompt_token_ids=[random_prompt(input_len, seed=index)], sampling_params=FIRST_TOKEN
            )
        )

    return run


def decode_run(llm: LLM, batch: int):
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)

    def run(index: int) -> float:
        core = llm.core
        ids = [core.new_req_id() for _ in range(batch)]
        for offset, req_id in enumerate(ids):
            core.add_request(req_id, random_prompt(256, seed=1000 * index + offset), params)
        while any(core.scheduler.requests[req_id].num_output_tokens == 0 for req_id in ids):
            core.step()
        seconds = timed(lambda: [core.step() for _ in range(DECODE_STEPS)])
        while core.has_unfinished_requests():
            core.step()
        return batch * DECODE_STEPS / seconds

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args()
    options = dict(
        device=args.device, dtype=args.dtype, enable_prompt_cache=False, kv_cache_memory_bytes=512 << 20
    )
    engines = {
        "invariant": LLM(**options, batch_invariant=True),
        "plain": LLM(**options, batch_invariant=False),
    }
    invariant = engines["invariant"]
    in_effect = invariant.inspect().batch_invariant
    print(f"{engine_dtype_name(invariant)}, batch invariance in effect: {in_effect}")
    rows, payload = [], {}
    for input_len in args.input_lens:
        medians = interleaved_medians(
            {name: ttft_run(llm, input_len) for name, llm in engines.items()}, args.repeats
        )
        rows.append([f"TTFT {input_len} tokens (ms)", medians["invariant"] * 1000, medians["plain"] * 1000,
                     medians["invariant"] / medians["plain"]])
        payload[f"ttft_{input_len}_s"] = medians
    for batch in args.decode_batches:
        medians = interleaved_medians(
            {name: decode_run(llm, batch) for name, llm in engines.items()}, args.repeats
        )
        rows.append([f"decode batch {batch} (tokens/s)", medians["invariant"], medians["plain"],
                     medians["plain"] / medians["invariant"]])
        payload[f"decode_batch_{batch}_tokens_per_s"] = medians
    print_table(["measure", "invariant", "plain", "cost (invariant / plain time)"], rows)
    print(f"saved {save_result('batch_invariance', payload)}")


if __name__ == "__main__":
    main()
