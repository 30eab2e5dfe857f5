"""Hugging Face folder loading: config.json, *.safetensors and tokenizer.json."""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as RustTokenizer

from firsttoken.models.arch import SUPPORTED_ARCHITECTURES, ModelArch
from firsttoken.models.loaders.checkpoint import Checkpoint, NamedTensors
from firsttoken.models.loaders.compressed_tensors import checkpoint_quantization
from firsttoken.ops.rotary import RopeScaling
from firsttoken.tokenizer import Tokenizer, read_tokenizer_file


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


# Gemma 3's text model as transformers' Gemma3TextConfig defines what a multimodal checkpoint's
# text_config may leave out (Gemma 3 4B, 12B and 27B ship as image-text models).
_GEMMA3_TEXT_DEFAULTS = {
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "max_position_embeddings": 131_072,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "hidden_activation": "gelu_pytorch_tanh",
}
# The tensors of a multimodal checkpoint's text model, under either naming transformers has
# saved them by; the vision tower's and the projector's are not read.
_LANGUAGE_MODEL_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def load_hf_folder(path: str) -> Checkpoint:
    config = _read_json(os.path.join(path, "config.json"))
    quantization = checkpoint_quantization(config, path)
    multimodal = config.get("model_type") == "gemma3" and "text_config" in config
    if multimodal:
        config = gemma3_text_config(config)
    arch = arch_from_config(config, path)
    weight_files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not weight_files:
        raise ValueError(f"model: {path} holds no *.safetensors weights")
    num_tensors = 0
    for weight_file in weight_files:
        with safe_open(weight_file, framework="pt") as handle:
            num_tensors += sum(1 for name in handle.keys() if not name.startswith(_VISION_PREFIXES))
    return Checkpoint(
        source=path,
        format="hf",
        arch=arch,
        tokenizer=_load_tokenizer(path, config),
        fingerprint=_folder_fingerprint(path, weight_files),
        num_tensors=num_tensors,
        read_weights=lambda: _read_weights(weight_files, multimodal),
        quantization=quantization,
    )


def _read_weights(weight_files: list[str], multimodal: bool) -> NamedTensors:
    weights = _iter_weights(weight_files)
    return _language_model_weights(weights) if multimodal else weights


def gemma3_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a Gemma 3 image-text checkpoint, its defaults filled in."""
    text_config = config["text_config"]
    tie_word_embeddings = text_config.get("tie_word_embeddings", config.get("tie_word_embeddings", True))
    return {
        **_GEMMA3_TEXT_DEFAULTS,
        **text_config,
        "model_type": "gemma3_text",
        "tie_word_embeddings": tie_word_embeddings,
    }


def _language_model_weights(weights: NamedTensors) -> NamedTensors:
    """A multimodal checkpoint's text-model tensors, named as a text-only checkpoint names them."""
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((prefix for prefix in _LANGUAGE_MODEL_PREFIXES if name.startswith(prefix)), None)
        if prefix is None:
            raise ValueError(f"model: unexpected tensor {name} in an image-text checkpoint")
        yield _LANGUAGE_MODEL_PREFIXES[prefix] + name[len(prefix) :], tensor


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"model: cannot read {path} ({error})") from error


def arch_from_config(config: dict[str, Any], path: str) -> ModelArch:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: architecture {model_type!r} of {path} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden_size = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    # Gemma 3 (transformers 5): one set of rope parameters per kind of layer.
    local_rope = rope.get("sliding_attention") or {}
    rope = rope.get("full_attention", rope)
    rope_theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    scaling_source = config.get("rope_scaling") or rope
    head_dim = int(config.get("head_dim") or hidden_size // num_heads)
    partial_rotary_factor = float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
    if not 0.0 < partial_rotary_factor <= 1.0:
        raise ValueError(f"model: partial_rotary_factor {partial_rotary_factor} of {path} must be in (0, 1]")
    rotary_dim = int(head_dim * partial_rotary_factor)
    # Qwen2/3 configs say whether their window applies; Mistral's, Phi-3's and Gemma's always does.
    use_sliding_window = config.get(
        "use_sliding_window", model_type in ("mistral", "phi3", "gemma2", "gemma3_text")
    )
    return ModelArch(
        architecture=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        **_bias_fields(config, model_type),
        rope_scaling=_rope_scaling(scaling_source, config, model_type),
        rotary_dim=rotary_dim if rotary_dim < head_dim else None,
        sliding_window=config.get("sliding_window") if use_sliding_window else None,
        sliding_window_layers=_sliding_window_layers(config, model_type),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        **(_gemma_fields(config, model_type, local_rope, path) if model_type.startswith("gemma") else {}),
    )


def _gemma_fields(
    config: dict[str, Any], model_type: str, local_rope: dict[str, Any], path: str
) -> dict[str, Any]:
    """How Gemma 2's and 3's layers differ from Llama's (see ModelArch): Gemma 3's local layers
    rotate by their own base; Gemma 2 soft-caps attention scores."""
    if config.get("use_bidirectional_attention"):
        raise ValueError(f"model: use_bidirectional_attention of {path} is not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(
            f"model: hidden_activation {activation!r} of {path} is not supported (gelu_pytorch_tanh)"
        )
    local_rope_theta = local_rope.get("rope_theta", config.get("rope_local_base_freq", 10000.0))
    return dict(
        local_rope_theta=float(local_rope_theta) if model_type == "gemma3_text" else None,
        embedding_multiplier=float(config["hidden_size"]) ** 0.5,
        norm_weight_offset=1.0,
        sandwich_norms=True,
        hidden_activation="gelu_tanh",
        attention_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=config.get("final_logit_softcapping"),
        attention_logit_softcap=config.get("attn_logit_softcapping"),
    )


def _sliding_window_layers(config: dict[str, Any], model_type: str) -> tuple[int, ...] | None:
    """The layers a window applies to: as `layer_types` lists them, or in older configs those
    from `max_window_layers` on (Qwen2/3), every other one from the first (Gemma 2), all but
    every `sliding_window_pattern`-th (Gemma 3, 6 by default); None (every layer) for Mistral
    and Phi-3."""
    layer_types = config.get("layer_types")
    num_layers = int(config["num_hidden_layers"])
    if layer_types is not None:
        return tuple(index for index, kind in enumerate(layer_types) if kind == "sliding_attention")
    if model_type in ("qwen2", "qwen3") and "max_window_layers" in config:
        return tuple(range(int(config["max_window_layers"]), num_layers))
    if model_type in ("gemma2", "gemma3_text"):
        every = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern", 6))
        return tuple(index for index in range(num_layers) if (index + 1) % every != 0)
    return None


def _bias_fields(config: dict[str, Any], model_type: str) -> dict[str, bool]:
    """Which projections have biases, as transformers builds each family: Qwen2 always q/k/v's
    alone; Llama, Qwen3 and Gemma q/k/v's and o_proj's with attention_bias; Llama the MLP's with
    mlp_bias; Mistral and Phi-3 none."""
    attention_bias = model_type in _ATTENTION_BIAS_FAMILIES and bool(config.get("attention_bias", False))
    return dict(
        attention_bias=model_type == "qwen2" or attention_bias,
        attention_output_bias=attention_bias,
        mlp_bias=model_type == "llama" and bool(config.get("mlp_bias", False)),
    )


_ATTENTION_BIAS_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3_text")


def _rope_scaling(source: dict[str, Any], config: dict[str, Any], model_type: str) -> RopeScaling | None:
    rope_type = source.get("rope_type", source.get("type"))
    if rope_type in (None, "default"):
        return None
    # transformers reads Phi-3's older names for LongRoPE as it.
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"
    if rope_type == "longrope":
        return _longrope_scaling(source, config)
    return RopeScaling(
        rope_type=rope_type,
        factor=float(source.get("factor", 1.0)),
        low_freq_factor=float(source.get("low_freq_factor", 1.0)),
        high_freq_factor=float(source.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(source.get("original_max_position_embeddings", 8192)),
    )


def _longrope_scaling(source: dict[str, Any], config: dict[str, Any]) -> RopeScaling:
    """LongRoPE as transformers' `_compute_longrope_parameters` reads it: Phi-3's top-level
    original_max_position_embeddings first; attention_factor, when the config has none,
    sqrt(1 + ln(factor) / ln(original)), factor being max / original positions unless given."""
    max_positions = int(config.get("max_position_embeddings", 4096))
    original = int(
        config.get("original_max_position_embeddings")
        or source.get("original_max_position_embeddings")
        or max_positions
    )
    factor = float(source.get("factor") or max_positions / original)
    attention_factor = source.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    for name in ("short_factor", "long_factor"):
        if not isinstance(source.get(name), list):
            raise ValueError(f"model: rope_scaling.{name} of a longrope config must be a list of numbers")
    return RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=original,
        short_factor=tuple(source["short_factor"]),
        long_factor=tuple(source["long_factor"]),
        attention_factor=float(attention_factor),
    )


def _load_tokenizer(path: str, config: dict[str, Any]) -> Tokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise ValueError(f"model: {path} has no tokenizer.json")
    backend = read_tokenizer_file(tokenizer_file)
    tokenizer_config_file = os.path.join(path, "tokenizer_config.json")
    tokenizer_config = _read_json(tokenizer_config_file) if os.path.isfile(tokenizer_config_file) else {}
    generation_config_file = os.path.join(path, "generation_config.json")
    generation_config = _read_json(generation_config_file) if os.path.isfile(generation_config_file) else {}
    return Tokenizer(
        backend=backend,
        eos_token_ids=_eos_token_ids(backend, config, tokenizer_config, generation_config),
        bos_token_id=config.get("bos_token_id"),
        chat_template=_chat_template(path, tokenizer_config),
    )


def _eos_token_ids(
    backend: RustTokenizer,
    config: dict[str, Any],
    tokenizer_config: dict[str, Any],
    generation_config: dict[str, Any],
) -> list[int]:
    for source in (generation_config, config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [int(eos)]
    eos_token = tokenizer_config.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    eos_id = backend.token_to_id(eos_token) if isinstance(eos_token, str) else None
    return [eos_id] if eos_id is not None else []


def _chat_template(path: str, tokenizer_config: dict[str, Any]) -> str | None:
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file, encoding="utf-8") as handle:
            return handle.read()
    template = tokenizer_config.get("chat_template")
    return template if isinstance(template, str) else None


def _folder_fingerprint(path: str, weight_files: list[str]) -> str:
    digest = hashlib.sha256()
    for name in ["config.json", *map(os.path.basename, weight_files)]:
        stat = os.stat(os.path.join(path, name))
        digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def _iter_weights(weight_files: list[str]) -> NamedTensors:
    for weight_file in weight_files:
        with safe_open(weight_file, framework="pt") as handle:
            for name in handle.keys():
                tensor: torch.Tensor = handle.get_tensor(name)
                yield name, tensor
