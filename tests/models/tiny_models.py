"""Tiny random Llama-family checkpoints, written as Hugging Face folders and GGUF files."""

from __future__ import annotations

import functools
import json
import math
import os

from typing import TYPE_CHECKING

import numpy as np
import torch

from firsttoken.models.loaders.conversion_cache import default_cache_dir
from firsttoken.models.registry import default_model_path, open_checkpoint

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

# Resolved at import (the test run's cache), before a test points XDG_CACHE_HOME elsewhere.
_RUN_CACHE_DIR = default_cache_dir()

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.25,
)


@functools.lru_cache(maxsize=1)
def _smollm_tokenizer_text() -> str:
    return open_checkpoint(default_model_path(), cache_dir=_RUN_CACHE_DIR).tokenizer.backend.to_str()


@functools.lru_cache(maxsize=1)
def _smollm_chat_template() -> str:
    return open_checkpoint(default_model_path(), cache_dir=_RUN_CACHE_DIR).tokenizer.chat_template.source


def smollm_tokenizer_json() -> dict:
    """The embedded model's tokenizer, as tokenizer.json content."""
    return json.loads(_smollm_tokenizer_text())


@functools.lru_cache(maxsize=1)
def smollm_vocab_size() -> int:
    """The size of the embedded model's vocabulary, without its added tokens."""
    return len(smollm_tokenizer_json()["model"]["vocab"])


def write_smollm_tokenizer(folder: str) -> None:
    """The embedded model's tokenizer.json in `folder`, as its text (parsing it takes ~0.1 s)."""
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as handle:
        handle.write(_smollm_tokenizer_text())


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    """A seeded random transformers model of `model_type` (llama, mistral, phi3, qwen2, qwen3)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab_size = smollm_vocab_size()
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model.eval()


def save_hf_folder(model, folder: str) -> str:
    model.save_pretrained(folder)
    write_smollm_tokenizer(folder)
    return folder


# The embedded SmolLM2-135M's shapes (hidden size, heads, KV heads, MLP width, vocabulary): its
# kernels' paths exactly, at a fraction of the compute with few layers.
SMOLLM2_SHAPES = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def write_smollm2_shaped_folder(folder: str, num_layers: int = 2, seed: int = 0) -> str:
    """A Hugging Face folder of a random-weight model of SmolLM2-135M's shapes with `num_layers`
    layers, its tokenizer and chat template (torch and safetensors only: no transformers import).
    Greedy replies of its weights vary from token to token (wider embeddings repeat one token).
    As in the embedded model's file, the projections hold Q4_1 blocks' values and the embedding
    Q8_0 ones (float32 engines' decode steps read them as levels there, their prefills as floats)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = SMOLLM2_SHAPES
    hidden, inter = shapes["hidden_size"], shapes["intermediate_size"]
    q_size = shapes["num_attention_heads"] * shapes["head_dim"]
    kv_size = shapes["num_key_value_heads"] * shapes["head_dim"]

    def random(*shape: int, std: float, levels: int = 16) -> torch.Tensor:
        """Random values on the grid of GGUF blocks of 32: Q4_1's (16 levels from each block's
        least value) or Q8_0's (255 levels around 0), with fp16 scales and offsets."""
        blocks = (torch.randn(*shape, generator=generator) * std).view(-1, 32)
        if levels == 16:
            offsets = blocks.amin(-1, keepdim=True).half().float()
            scales = ((blocks.amax(-1, keepdim=True) - offsets) / 15).half().float()
            grid = torch.round((blocks - offsets) / scales).clamp(0, 15) * scales + offsets
        else:
            scales = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
            grid = torch.round(blocks / scales).clamp(-127, 127) * scales
        return grid.view(*shape)

    tensors = {
        "model.embed_tokens.weight": random(shapes["vocab_size"], hidden, std=0.02, levels=255),
        "model.norm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
    }
    for layer in range(num_layers):
        prefix = f"model.layers.{layer}."
        tensors.update({
            prefix + "input_layernorm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
            prefix + "post_attention_layernorm.weight": 1 + torch.randn(hidden, generator=generator) * 0.1,
            prefix + "self_attn.q_proj.weight": random(q_size, hidden, std=hidden**-0.5),
            prefix + "self_attn.k_proj.weight": random(kv_size, hidden, std=hidden**-0.5),
            prefix + "self_attn.v_proj.weight": random(kv_size, hidden, std=hidden**-0.5),
            prefix + "self_attn.o_proj.weight": random(hidden, q_size, std=q_size**-0.5),
            prefix + "mlp.gate_proj.weight": random(inter, hidden, std=hidden**-0.5),
            prefix + "mlp.up_proj.weight": random(inter, hidden, std=hidden**-0.5),
            prefix + "mlp.down_proj.weight": random(hidden, inter, std=inter**-0.5),
        })
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump({**shapes, "num_hidden_layers": num_layers}, handle)
    write_smollm_tokenizer(folder)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"chat_template": _smollm_chat_template()}, handle)
    return folder


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter layout (the inverse of undo_rope_permutation)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}


# Gemma's sandwich norms, as llama.cpp names them.
_SANDWICH_NORM_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_GEMMA = ("gemma2", "gemma3")


def _gguf_name(hf_name: str, gguf_arch: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    parts = hf_name.split(".")
    layer, local, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    names = _LAYER_NAMES | _SANDWICH_NORM_NAMES if gguf_arch in _GEMMA else _LAYER_NAMES
    return f"blk.{layer}.{names[local]}.{kind}"


def write_gguf(model, path: str, gguf_arch: str, qtypes: dict[str, GGMLQuantizationType]) -> str:
    """Write `model` as llama.cpp's converter would: permuted q/k rows (llama), Gemma's norms
as 1 + weight with its window, local layers and soft-caps, quantized matrices.

    qtypes maps a substring of the GGUF tensor name to its type; 1-D tensors stay F32.
    """
    # Imported here: the GPU image runs tests/cuda, which use this module, without the gguf package.
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    config = model.config
    tokenizer = smollm_tokenizer_json()
    vocab = tokenizer["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {entry["id"] for entry in tokenizer["added_tokens"] if entry["special"]}
    writer = gguf.GGUFWriter(path, gguf_arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    # Gemma 3 holds a set of rope parameters per kind of layer; the file, the global layers'.
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":
        _add_longrope(writer, config, rope)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if index in special else 1 for index in range(len(tokens))])
    writer.add_token_merges(
        [" ".join(merge) if isinstance(merge, list) else merge for merge in tokenizer["model"]["merges"]]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if gguf_arch in _GEMMA:
        _add_gemma_fields(writer, config)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        name = _gguf_name(hf_name, gguf_arch)
        array = tensor.float().numpy()
        if gguf_arch in _GEMMA and hf_name.endswith("norm.weight"):
            array = array + 1.0
        if gguf_arch == "llama" and ".attn_q." in name:
            array = _permute_for_gguf(array, config.num_attention_heads)
        elif gguf_arch == "llama" and ".attn_k." in name:
            array = _permute_for_gguf(array, config.num_key_value_heads)
        qtype = next((kind for key, kind in qtypes.items() if key in name), GGMLQuantizationType.F32)
        if array.ndim == 1 or qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, array.astype(np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path



def _add_longrope(writer, config, rope: dict) -> None:
    """As llama.cpp's Phi-3 converter writes LongRoPE: the factors as tensors, the original
    context and the attention factor (from the context lengths' ratio) as metadata."""
    original = rope["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    attention_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
    writer.add_rope_scaling_attn_factors(attention_factor)
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _add_gemma_fields(writer, config) -> None:
    """The window, which layers have it (a flag per layer), and the soft-caps."""
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    if getattr(config, "attn_logit_softcapping", None) is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
