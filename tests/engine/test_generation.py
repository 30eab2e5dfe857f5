"""The engine's own equivalences: batching, preemption, streaming, sampling and stopping."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from firsttoken import LLM, SamplingParams
from firsttoken.ops.linear_choice import DecodeQuantizedLinear
from firsttoken.ops.native_abi import INT4_GROUP_SIZE
from firsttoken.ops.quantized_linear import Int8Linear, PortableInt4Linear, dequantize_int4, unpack_int4
from tests.conftest import FIXED_THREADS, cpu_has_bf16_instructions
from tests.engine_state import all_blocks_free
from tests.prompts import CHAT_CONVERSATION, SHORT_PROMPTS, long_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# A prompt of ~660 tokens: a full 512-row chunk (the compiled ops' size) and a shorter second one.
CHUNKED_PROMPT_REPEATS = 7


def _mixed_prompts(llm: LLM, count: int) -> list[list[int]]:
    texts = SHORT_PROMPTS + [long_prompt(2), long_prompt(5), "Hi", "Once upon a time"]
    prompts = []
    for index in range(count):
        ids = llm.tokenizer.encode(texts[index % len(texts)])
        prompts.append(ids[: max(1, len(ids) - index)])  # vary lengths, including 1-token prompts
    return prompts


# The batching logic on the 2-layer model of the embedded model's shapes (each prompt also runs
# alone: 16 took a minute on the embedded model on a 2-core CPU).
@pytest.mark.parametrize("batch_size", [8, 16])
def test_a_batch_equals_each_prompt_alone(engine_for, two_layer_model_path, batch_size):
    llm = engine_for(
        model=two_layer_model_path,
        dtype="float32",
        kv_cache_memory_bytes=256 << 20,
        chunk_size=64,
        enable_prompt_cache=False,
    )
    prompts = _mixed_prompts(llm, batch_size)
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    for prompt, output in zip(prompts, batched):
        (alone,) = llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY)
        assert output.token_ids == alone.token_ids
    assert all_blocks_free(llm)


def test_tiny_kv_budget_preempts_yet_gives_the_same_tokens(two_layer_model_path, engine_for):
    options = dict(model=two_layer_model_path, dtype="float32", chunk_size=64)
    prompts_llm = engine_for(**options, kv_cache_memory_bytes=256 << 20)
    prompts = _mixed_prompts(prompts_llm, 8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in prompts_llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    # 40 blocks of 16 tokens: far less than the 8 requests need together.
    num_layers = prompts_llm.core.worker.checkpoint.arch.num_layers
    block_bytes = 2 * num_layers * 16 * 3 * 64 * 4
    small = LLM(**options, kv_cache_memory_bytes=40 * block_bytes, max_num_seqs=8, **FIXED_THREADS)
    outputs = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outputs] == expected
    assert small.stats().num_preemptions > 0
    assert all_blocks_free(small)


def test_prompt_dicts_as_vllm_takes_them_give_the_text_and_token_replies(llm):
    """{"prompt": text} and {"prompt_token_ids": ids}, alone or mixed in a list with plain text."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = SHORT_PROMPTS[0]
    ids = llm.tokenizer.encode(SHORT_PROMPTS[1])
    expected_text = llm.generate([text], params)[0].token_ids
    expected_ids = llm.generate(prompt_token_ids=[ids], sampling_params=params)[0].token_ids
    (alone,) = llm.generate({"prompt_token_ids": ids}, params)
    assert alone.token_ids == expected_ids and alone.prompt_token_ids == ids
    mixed = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, text], params)
    assert [output.token_ids for output in mixed] == [expected_text, expected_ids, expected_text]
    assert mixed[0].prompt == text and mixed[1].prompt is None


def test_stream_deltas_add_up_to_the_generated_text(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (expected,) = llm.generate(["Write a haiku about autumn:"], params)
    deltas = list(llm.stream("Write a haiku about autumn:", params))
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert sum(1 for d in deltas if d.finished) == 1


def test_closing_a_stream_early_aborts_and_frees_its_blocks(llm):
    stream = llm.stream("Tell me a long story about a dragon.", SamplingParams(temperature=0, max_tokens=200))
    next(stream)
    stream.close()
    assert all_blocks_free(llm)


def test_text_equals_decoding_the_tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for output in llm.generate(SHORT_PROMPTS, params):
        assert output.text == llm.tokenizer.decode(output.token_ids)


def test_same_seed_same_tokens_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    (alone,) = llm.generate(["The weather today is"], seeded)
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(
        ["Roses are red,", "The weather today is", "Numbers: 1, 2, 3,"], [unseeded, seeded, unseeded]
    )
    assert batch[1].token_ids == alone.token_ids
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    (different,) = llm.generate(["The weather today is"], other_seed)
    assert different.token_ids != alone.token_ids


def test_top_k_one_is_greedy(llm):
    (greedy,) = llm.generate(["The capital of Italy is"], GREEDY)
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=24, ignore_eos=True)
    (sampled,) = llm.generate(["The capital of Italy is"], top1)
    assert sampled.token_ids == greedy.token_ids


def test_stop_string_is_cut_from_text_and_ends_request(llm):
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    (full,) = llm.generate(["Count: one, two, three,"], base)
    stop_word = full.text.strip().split()[2]
    stop = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop_word])
    (stopped,) = llm.generate(["Count: one, two, three,"], stop)
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop_word
    assert stopped.text == full.text[: full.text.index(stop_word)]
    assert all_blocks_free(llm)
    streamed = "".join(d.text for d in llm.stream("Count: one, two, three,", stop))
    assert streamed == stopped.text


def _stop_string_ending_at_token(llm: LLM, prompt: str) -> tuple[int, str, str]:
    """(k, s, text): greedy token k's own text, stripped (s), appears first in the output where
    token k completes it; `text` is the output of k + 1 tokens."""
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for index in range(2, len(full.token_ids)):
        before = llm.tokenizer.decode(full.token_ids[:index])
        upto = llm.tokenizer.decode(full.token_ids[: index + 1])
        piece = upto[len(before) :].strip()
        if piece and piece not in before + upto[len(before) : -1]:
            return index, piece, upto
    raise AssertionError(f"no usable token in {full.text!r}")


@pytest.mark.parametrize("streamed", [False, True])
def test_stop_string_completed_by_the_last_allowed_token_finishes_with_stop(llm, streamed):
    index, stop_string, text = _stop_string_ending_at_token(llm, "The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=index + 1, ignore_eos=True, stop=[stop_string])
    if streamed:
        deltas = list(llm.stream("The capital of France is", params))
        output_text, finish = "".join(d.text for d in deltas), deltas[-1].finish_reason
        stop_reason = deltas[-1].stop_reason
    else:
        (output,) = llm.generate(["The capital of France is"], params)
        output_text, finish, stop_reason = output.text, output.finish_reason, output.stop_reason
    assert (finish, stop_reason) == ("stop", stop_string)
    assert output_text == text[: text.rindex(stop_string)]
    assert all_blocks_free(llm)


def test_stop_token_id_as_the_last_allowed_token_finishes_with_stop(llm):
    (full,) = llm.generate(["Count: one, two, three,"], GREEDY)
    last = full.token_ids[3]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[last])
    (stopped,) = llm.generate(["Count: one, two, three,"], params)
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(last) + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", last)


def test_stop_token_ids_and_eos(llm):
    (full,) = llm.generate(["Count: one, two, three,"], GREEDY)
    stop_token = full.token_ids[5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_token])
    (stopped,) = llm.generate(["Count: one, two, three,"], params)
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_token
    chat = llm.chat(
        [{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0, max_tokens=200)
    )
    assert chat.finish_reason == "stop"
    assert chat.token_ids[-1] in llm.tokenizer.eos_token_ids


def test_metrics_stages_sum_to_ttft(llm):
    (output,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    metrics = output.metrics
    assert metrics.tokenize_s >= 0 and metrics.queue_s >= 0 and metrics.prefill_s > 0
    assert metrics.tokenize_s + metrics.queue_s + metrics.prefill_s == pytest.approx(metrics.ttft_s)
    assert metrics.e2e_s >= metrics.ttft_s
    assert metrics.num_generation_tokens == len(output.token_ids)
    assert metrics.decode_tokens_per_s > 0


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=12))
    prompt = llm.tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>assistant\n")
    assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert "Paris" in output.text


def test_fused_ops_give_the_plain_ops_tokens(llm, engine_for):
    """The fused path (compiled ops from 512 rows, native kernels below) against the plain
    torch ops in float32: prompts short and long, chunked, batched and decoding."""
    if llm.core.worker.kernels.native is None:
        pytest.skip("no native kernels on this machine")
    plain = engine_for(dtype="float32", kv_cache_memory_bytes=256 << 20, chunk_size=512, fuse_ops=False)
    assert plain.core.worker.kernels.native is None
    prompts = _mixed_prompts(llm, 6) + [llm.tokenizer.encode(long_prompt(CHUNKED_PROMPT_REPEATS))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    fused_outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    plain_outputs = plain.generate(prompt_token_ids=prompts, sampling_params=params)
    for fused, reference in zip(fused_outputs, plain_outputs):
        assert fused.token_ids == reference.token_ids
        for ours, theirs in zip(fused.logprobs, reference.logprobs):
            assert abs(ours.top_logprobs[0].logprob - theirs.top_logprobs[0].logprob) < 1e-4


def test_native_int4_decode_gives_the_per_op_tokens(model_path):
    """The whole-step native decode against the same int4 engine stepping op by op (the same
    int4 kernel; torch's SDPA instead of the native attention), batched and alone."""
    if not cpu_has_bf16_instructions():
        pytest.skip("no native bf16 int4 decode on this CPU (needs AVX512-BF16)")
    llm = LLM(
        model_path,
        dtype="bfloat16",
        quantization="int4",
        kv_cache_memory_bytes=256 << 20,
        chunk_size=512,
        **FIXED_THREADS,
    )
    runner = llm.core.worker.runner
    if runner.whole_step_decode is None:
        pytest.skip("no native int4 decode on this machine (needs a C compiler and AVX512-BF16)")
    prompts = _mixed_prompts(llm, 4) + [llm.tokenizer.encode(long_prompt(CHUNKED_PROMPT_REPEATS))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    native_outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    runner.whole_step_decode = None
    per_op_outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for native, per_op in zip(native_outputs, per_op_outputs):
        for ours, theirs in zip(native.logprobs, per_op.logprobs):
            # bf16 attention summed in another order: a flip only where the top two tie to within
            # two steps of the bf16 logits (0.125 apart at their usual size, 16 to 32).
            if ours.token_id != theirs.token_id:
                top, second = theirs.top_logprobs[:2]
                assert top.logprob - second.logprob <= 0.25
                break
            assert abs(ours.top_logprobs[0].logprob - theirs.top_logprobs[0].logprob) < 0.25


@pytest.fixture(scope="module")
def float32_int4_engine(model_path) -> LLM:
    """A float32 engine on the file's 4-bit weights, without a prompt cache (each pass prefills
    alike); a test that swaps a part of it puts the part back."""
    return LLM(
        model_path,
        dtype="float32",
        quantization="int4",
        enable_prompt_cache=False,
        kv_cache_memory_bytes=256 << 20,
        chunk_size=512,
        **FIXED_THREADS,
    )


def test_float32_int4_whole_step_decode_gives_the_per_op_bits(float32_int4_engine):
    """On every CPU with native kernels, a float32 int4 engine runs decode-only steps in one
    native call on the per-op path's own kernels: the same tokens and logprob bits as stepping
    op by op, batched and alone."""
    llm = float32_int4_engine
    runner = llm.core.worker.runner
    whole_step_decode = runner.whole_step_decode
    if whole_step_decode is None:
        pytest.skip("no native kernels on this machine (needs a C compiler)")
    prompts = _mixed_prompts(llm, 3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    passes = []
    try:
        for whole_step in (whole_step_decode, None):
            runner.whole_step_decode = whole_step
            passes.append(
                llm.generate(prompt_token_ids=prompts, sampling_params=params)
                + llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
            )
    finally:
        runner.whole_step_decode = whole_step_decode
    for whole, per_op in zip(*passes):
        assert whole.token_ids == per_op.token_ids
        assert [entry.top_logprobs for entry in whole.logprobs] == [
            entry.top_logprobs for entry in per_op.logprobs
        ]


def test_a_prefaulted_kv_cache_gives_the_same_tokens(model_path, engine_for, caplog):
    """prefault_kv_cache writes the cache's zeros at start; nothing a request sees changes."""
    prompts = ["The capital of France is", "List three colors:"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory_bytes=32 << 20, chunk_size=512)
    lazy = engine_for(**options)
    with caplog.at_level("INFO", logger="firsttoken.worker.kv_cache"):
        written = LLM(model_path, **options, **FIXED_THREADS, prefault_kv_cache=True)
    assert any("KV cache in" in record.getMessage() for record in caplog.records)
    for expected, actual in zip(lazy.generate(prompts, params), written.generate(prompts, params)):
        assert actual.token_ids == expected.token_ids


class _DequantizedLinear(nn.Module):
    """A quantized projection's plain reference: its own levels and scales as float32 weights."""

    def __init__(self, quantized: nn.Module) -> None:
        super().__init__()
        if isinstance(quantized, PortableInt4Linear):
            levels, scales_and_zeros = unpack_int4(quantized.levels, quantized.scales_zeros)
            self.weight = dequantize_int4(levels, scales_and_zeros, INT4_GROUP_SIZE)
        else:
            self.weight = quantized.weight.float() * quantized.scales.float()[:, None]
        self.bias = quantized.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# float32 sums in another order (the kernels' against F.linear's), grown over 30 layers and the
# decoded tokens: a top log-prob moves by up to ~6e-3 (measured), a token only at a near tie.
FLOAT32_REORDER_LOGPROB_TOLERANCE = 2e-2


def test_float32_int4_decode_gives_the_dequantized_weights_tokens(float32_int4_engine):
    """float32 + int4 on the portable kernels (int8 LM head) against the same engine with every
    quantized projection replaced by F.linear on its dequantized weights; the short parity
    prompts in one batch (decode steps of 7 rows) and one of them alone (steps of 1 row)."""
    llm = float32_int4_engine
    dispatches = [
        module for module in llm.core.worker.model.modules() if isinstance(module, DecodeQuantizedLinear)
    ]
    if not any(isinstance(dispatch.quantized, PortableInt4Linear) for dispatch in dispatches):
        pytest.skip("no native kernels on this machine (needs a C compiler)")
    assert all(isinstance(dispatch.quantized, (PortableInt4Linear, Int8Linear)) for dispatch in dispatches)
    texts = SHORT_PROMPTS + [llm.tokenizer.apply_chat_template(CHAT_CONVERSATION)]
    prompts = [llm.tokenizer.encode(text) for text in texts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def generate_batched_and_alone():
        alone = llm.generate(prompt_token_ids=prompts[:1], sampling_params=params)
        return llm.generate(prompt_token_ids=prompts, sampling_params=params) + alone

    quantized_outputs = generate_batched_and_alone()
    quantized_modules = [dispatch.quantized for dispatch in dispatches]
    try:
        for dispatch in dispatches:
            dispatch.quantized = _DequantizedLinear(dispatch.quantized)
        reference_outputs = generate_batched_and_alone()
    finally:
        for dispatch, quantized in zip(dispatches, quantized_modules):
            dispatch.quantized = quantized
    for ours, reference in zip(quantized_outputs, reference_outputs, strict=True):
        for mine, theirs in zip(ours.logprobs, reference.logprobs):
            if mine.token_id != theirs.token_id:
                top, second = theirs.top_logprobs[:2]
                assert top.logprob - second.logprob <= FLOAT32_REORDER_LOGPROB_TOLERANCE
                break
            difference = abs(mine.top_logprobs[0].logprob - theirs.top_logprobs[0].logprob)
            assert difference < FLOAT32_REORDER_LOGPROB_TOLERANCE
