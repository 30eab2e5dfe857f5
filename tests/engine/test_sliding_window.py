"""Sliding-window models past their window: transformers' tokens (every layer windowed, the upper
ones only, Gemma 2's and 3's local and global layers), and KV memory bounded by the window."""

from __future__ import annotations

import pytest
import torch

from firsttoken import LLM, SamplingParams
from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.models.loaders.gguf_file import gemma_local_layers
from firsttoken.models.loaders.hf_folder import arch_from_config, gemma3_text_config
from firsttoken.ops.kernels import Kernels
from firsttoken.outputs import WHOLE_STEP_INT4_DECODE
from firsttoken.worker.model_loading import max_model_len
from tests.conftest import FIXED_THREADS, may_claim_batch_invariance
from tests.engine_state import all_blocks_free, most_blocks_held
from tests.models.reference import assert_logprobs_close, hf_greedy
from tests.models.tiny_models import save_hf_folder, tiny_hf_model, write_gguf

WINDOW = 16
BLOCK_SIZE = 8
PROMPT_IDS = [(7 * index + 3) % 4000 + 30 for index in range(90)]
NUM_TOKENS = 24

WINDOWED_MODELS = {
    "mistral": ("mistral", dict(tie_word_embeddings=False)),
    "phi3": ("phi3", dict(tie_word_embeddings=False)),
    # Qwen2 windows the layers from max_window_layers on.
    "qwen2-upper-layers": (
        "qwen2",
        dict(tie_word_embeddings=True, use_sliding_window=True, max_window_layers=1),
    ),
    # Gemma 3: local (windowed, their own rotary base) and global layers, sandwich norms, GeGLU,
    # scaled embeddings, a query scale other than head_dim's, soft-capped logits.
    "gemma3": (
        "gemma3_text",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=2.0,
            # Smaller weights than the other families': Gemma scales its embeddings by
            # sqrt(hidden), and larger ones make this tiny model repeat one token.
            initializer_range=0.05,
        ),
    ),
    # Gemma 2: every other layer windowed, attention scores soft-capped (at 1.0, which these
    # weights' scores reach: the cap changes the greedy tokens).
    "gemma2": (
        "gemma2",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
            initializer_range=0.1,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(WINDOWED_MODELS))
def windowed_model(request, tmp_path_factory):
    """A tiny model with a 16-token window, as transformers runs it and as a folder."""
    model_type, overrides = WINDOWED_MODELS[request.param]
    hf_model = tiny_hf_model(model_type, sliding_window=WINDOW, **overrides)
    return request.param, hf_model, save_hf_folder(hf_model, str(tmp_path_factory.mktemp(request.param)))


def _engine(path: str, **options) -> LLM:
    settings = dict(
        dtype="float32",
        kv_cache_memory_bytes=4 << 20,
        block_size=BLOCK_SIZE,
        chunk_size=32,
        cache_dir=default_cache_dir(),
        **FIXED_THREADS,
    )
    return LLM(path, **{**settings, **options})


GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=8)
# float32 against float32: summation order apart, the same numbers.
LOGPROB_TOLERANCE = 1e-3


def test_the_window_changes_what_transformers_says(windowed_model):
    """The prompt runs far enough past the window that full attention would answer otherwise."""
    name, hf_model, _ = windowed_model
    model_type, overrides = WINDOWED_MODELS[name]
    # The same model and rotary bases, its window past every sequence here.
    full = tiny_hf_model(model_type, sliding_window=4096, **overrides)
    assert hf_greedy(full, PROMPT_IDS, NUM_TOKENS)[0] != hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)[0]


# sdpa: torch's attention and the reference ops (fuse_ops off: steps of 32 tokens never reach
# the compiled ops, which tests/ops/test_ops.py checks, so the engine need not compile them at start).
@pytest.mark.parametrize("options", [{}, {"fuse_ops": False}], ids=["native", "sdpa"])
def test_past_the_window_alone_batched_chunked_and_on_a_prefix_hit(windowed_model, options):
    _, hf_model, folder = windowed_model
    llm = _engine(folder, **options)
    expected, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    (alone,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    assert alone.token_ids == expected
    # Log-probs too: they see what greedy tokens cannot (Gemma's logit soft-cap keeps the order).
    assert_logprobs_close(alone.logprobs[0], expected_logprobs, LOGPROB_TOLERANCE)
    other_prompt = PROMPT_IDS[5:61]
    cached, beside = llm.generate(prompt_token_ids=[PROMPT_IDS, other_prompt], sampling_params=GREEDY)
    assert cached.num_cached_tokens > 0
    assert cached.token_ids == expected
    assert beside.token_ids == hf_greedy(hf_model, other_prompt, NUM_TOKENS)[0]
    assert all_blocks_free(llm)


def test_a_windowed_int4_model_decodes_in_whole_steps_with_the_per_op_bits(windowed_model):
    """Llama-layered windowed models (Mistral, Phi-3, Qwen2's upper layers) take the float32
    whole-step int4 decode, each layer within its own window, with the per-op path's log-probs to
    the bit; Gemma's layers are refused, and say why."""
    name, _, folder = windowed_model
    # No prompt cache: a hit would prefill the second run's last tokens in a smaller step, on the
    # int4 projections' decode form, where the first prefilled them on their prefill form.
    llm = _engine(folder, quantization="int4", enable_prompt_cache=False)
    inspection = llm.inspect()
    if inspection.native_isa is None:
        pytest.skip("no native kernels here: no whole step")
    if name.startswith("gemma"):
        assert inspection.whole_step_forwards == ()
        assert "not Llama's" in inspection.whole_step_unsupported_reason
        return
    assert inspection.whole_step_forwards == (WHOLE_STEP_INT4_DECODE,)
    # Past the window: the decode steps attend within it.
    (whole_step,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    with llm.core.forward_op_by_op():
        (op_by_op,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    assert whole_step.token_ids == op_by_op.token_ids
    assert whole_step.logprobs == op_by_op.logprobs
    assert all_blocks_free(llm)


def test_a_long_sequence_holds_about_its_windows_blocks(windowed_model):
    """Every layer windowed (Mistral): prefilled in chunks of 32 then decoded 200 tokens in a KV
    cache of 16 blocks, where full attention would need 37: never more blocks than the window and
    one step's tokens."""
    name, _, folder = windowed_model
    if name != "mistral":
        pytest.skip("a global layer keeps every block")
    llm = _engine(
        folder,
        enable_prompt_cache=False,
        kv_cache_memory_bytes=16 * BLOCK_SIZE * 512,
        max_num_batched_tokens=32,
        max_num_seqs=4,
    )
    assert llm.stats().num_kv_blocks == 16
    most_held = most_blocks_held(
        llm, PROMPT_IDS, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    )
    assert most_held <= -(-(WINDOW - 1 + 32) // BLOCK_SIZE) + 1
    assert all_blocks_free(llm)


def test_which_layers_have_the_window_and_that_none_caps_the_context():
    """Qwen2 windows the layers from max_window_layers on."""
    config = dict(
        model_type="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=100,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    upper_only = arch_from_config(config, "qwen2")
    assert [upper_only.layer_window(index, 512) for index in range(2)] == [None, WINDOW]
    # A layer over every key keeps every KV block: no window to give blocks back by.
    kernels = Kernels(fused=False)
    assert LlamaForCausalLM(upper_only, None, kernels, torch.float32, 512).kv_window is None
    assert max_model_len(upper_only, None) == 512
    everywhere = arch_from_config({**config, "max_window_layers": 0}, "qwen2")
    assert [everywhere.layer_window(index, 512) for index in range(2)] == [WINDOW, WINDOW]
    assert LlamaForCausalLM(everywhere, None, kernels, torch.float32, 512).kv_window == WINDOW
    # Every sequence within the window: full attention is exact, no window applied.
    assert [everywhere.layer_window(index, WINDOW) for index in range(2)] == [None, None]


# Gemma 3's GGUF layout is the slow tier's (its folders run by default; both share the GGUF reader).
@pytest.mark.parametrize("name", ["gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_a_gguf_file_in_llama_cpps_gemma_layout_gives_transformers_tokens(name, tmp_path):
    """Norms stored as 1 + weight, llama.cpp's tensor names for the sandwich norms, the local
    layers flagged in the file, the soft-caps; float32, so the file holds transformers' weights."""
    model_type, overrides = WINDOWED_MODELS[name]
    # llama.cpp scales queries by head_dim below 27B (its files carry no query_pre_attn_scalar).
    hf_model = tiny_hf_model(model_type, sliding_window=WINDOW, **{**overrides, "query_pre_attn_scalar": 32})
    path = write_gguf(hf_model, str(tmp_path / f"{name}.gguf"), name, {})
    llm = _engine(path)
    (output,) = llm.generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    expected, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert output.token_ids == expected
    assert_logprobs_close(output.logprobs[0], expected_logprobs, LOGPROB_TOLERANCE)


def test_gemma_gguf_files_without_a_layer_pattern_take_llama_cpps():
    """Gemma 2: every other layer local from the first; Gemma 3: five local layers, then a global."""
    assert gemma_local_layers({}, "gemma2", 5) == (0, 2, 4)
    assert gemma_local_layers({}, "gemma3", 13) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12)
    flags = {"gemma3.attention.sliding_window_pattern": [True, False, True]}
    assert gemma_local_layers(flags, "gemma3", 3) == (0, 2)
    with pytest.raises(ValueError, match="sliding_window_pattern has 3 flags for 4 layers"):
        gemma_local_layers(flags, "gemma3", 4)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_bf16_windowed_rows_keep_their_bits_alone_chunked_batched_and_on_a_hit(name, tmp_path):
    """Mistral's window, Gemma 2's local layers and soft-capped scores, in bfloat16 on the
    AVX512-BF16/AMX kernels (prefills from the block holding the window, decodes with the
    prefill's arithmetic): every token and log-prob the same bits alone, in chunks of 8, beside
    another prompt, after a prefix-cache hit past the window and on blocks decode steps wrote."""
    if not may_claim_batch_invariance("bfloat16"):
        pytest.skip("no bfloat16 batch invariance on this machine (needs AVX512-BF16 kernels)")
    model_type, overrides = WINDOWED_MODELS[name]
    # Heads of 32: the vector kernels take whole 32-dim tiles.
    hf_model = tiny_hf_model(model_type, sliding_window=WINDOW, **{**overrides, "head_dim": 32})
    folder = save_hf_folder(hf_model, str(tmp_path / name))

    def bits(llm, prompts):
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        return [(output.token_ids, [entry.logprob for entry in output.logprobs]) for output in outputs]

    options = dict(dtype="bfloat16", batch_invariant=True, block_size=16)
    llm = _engine(folder, enable_prompt_cache=False, **options)
    assert llm.core.worker.batch_invariant
    (alone,) = bits(llm, [PROMPT_IDS])
    assert bits(_engine(folder, enable_prompt_cache=False, chunk_size=8, **options), [PROMPT_IDS]) == [alone]
    assert bits(llm, [PROMPT_IDS, PROMPT_IDS[3:70]])[0] == alone
    cached = _engine(folder, **options)
    bits(cached, [PROMPT_IDS[:80]])
    assert bits(cached, [PROMPT_IDS]) == [alone]
    # A next turn hits blocks the decode steps wrote: they hold a prefill's bits.
    next_turn = PROMPT_IDS + alone[0] + [7, 8, 9]
    (answer,) = cached.generate(prompt_token_ids=[next_turn], sampling_params=GREEDY)
    assert answer.num_cached_tokens > len(PROMPT_IDS)
    assert bits(cached, [next_turn]) == bits(llm, [next_turn])
    assert all_blocks_free(cached)


def test_a_gemma3_image_text_folder_serves_its_text_model(tmp_path):
    """Gemma 3 4B and up ship as image-text checkpoints: the text model's config under
    text_config, its tensors under language_model.*; the vision tower's are never read. On text,
    transformers' tokens past the window."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    # No final soft-cap: Gemma 3 has none, and transformers' image-text model would not apply one.
    overrides = {**WINDOWED_MODELS["gemma3"][1], "final_logit_softcapping": None}
    text_model = tiny_hf_model("gemma3_text", sliding_window=WINDOW, **overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)  # fmt: skip
    text_config = text_model.config.to_dict()
    config = Gemma3Config(text_config=text_config, vision_config=vision, mm_tokens_per_image=4)
    hf_model = Gemma3ForConditionalGeneration(config).eval()
    hf_model.model.language_model.load_state_dict(text_model.model.state_dict())
    folder = save_hf_folder(hf_model, str(tmp_path / "gemma3-image-text"))
    (output,) = _engine(folder).generate(prompt_token_ids=[PROMPT_IDS], sampling_params=GREEDY)
    expected, expected_logprobs = hf_greedy(hf_model, PROMPT_IDS, NUM_TOKENS)
    assert output.token_ids == expected == hf_greedy(text_model, PROMPT_IDS, NUM_TOKENS)[0]
    assert_logprobs_close(output.logprobs[0], expected_logprobs, LOGPROB_TOLERANCE)


def test_gemma_configs_without_layer_types_take_transformers_layouts():
    """Older Gemma 2 configs window every other layer from the first; Gemma 3's text_config of an
    image-text checkpoint may leave out what Gemma3TextConfig defaults (heads, head size, bases,
    the layout: every 6th layer global)."""
    gemma2 = dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, vocab_size=100, sliding_window=16,
                  hidden_activation="gelu_pytorch_tanh")  # fmt: skip
    assert arch_from_config(gemma2, "gemma2").sliding_window_layers == (0, 2)
    image_text = dict(
        model_type="gemma3",
        text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                         vocab_size=262208, sliding_window=1024,
                         rope_scaling={"factor": 8.0, "rope_type": "linear"}),  # fmt: skip
    )
    arch = arch_from_config(gemma3_text_config(image_text), "gemma3")
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (8, 4, 256)
    assert (arch.rope_theta, arch.local_rope_theta, arch.attention_scale) == (1e6, 1e4, 256**-0.5)
    assert arch.rope_scaling.factor == 8.0 and arch.tie_word_embeddings
    assert arch.sliding_window_layers == tuple(index for index in range(34) if index % 6 != 5)
