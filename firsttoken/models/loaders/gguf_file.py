"""GGUF loading: hyperparameters, tokenizer and dequantized weights of a llama.cpp model file."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from firsttoken.models.arch import SUPPORTED_ARCHITECTURES, ModelArch
from firsttoken.models.loaders.checkpoint import Checkpoint, NamedTensors
from firsttoken.models.loaders.file_identity import file_fingerprint
from firsttoken.models.loaders.gguf_tokenizer import GGUFVocab, build_tokenizer
from firsttoken.ops.rotary import RopeScaling
from firsttoken.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"
SUPPORTED_TENSOR_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}
# GGUF's own architecture names; Mistral files say "llama".
_ARCHITECTURES = {
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "llama": "llama",
    "mistral": "mistral",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
}
# llama.cpp's converter interleaves the rope halves of q/k rows for these architectures.
_PERMUTED_QK = {"llama", "mistral"}

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
}
# Gemma's sandwich: llama.cpp's ffn_norm is the norm before the MLP either way, which Hugging Face
# calls post_attention_layernorm in Llama and pre_feedforward_layernorm in Gemma.
_SANDWICH_NORM_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GEMMA = {"gemma2", "gemma3"}
# llama.cpp's Gemma layouts when the file names none: every 2nd (Gemma 2) or 6th (Gemma 3) layer
# global, the others local; Gemma 3's local layers rotate by base 10000.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0
# The block counts of the 27B models, whose queries llama.cpp scales by hidden / heads (their
# query_pre_attn_scalar), where the others scale by head_dim.
_GEMMA_27B_BLOCKS = {"gemma2": 46, "gemma3": 62}
# Phi-3 files hold gate and up fused in ffn_up (and no ffn_gate).
_FUSED_GATE_UP = {"phi3"}
# llama.cpp's Phi-3 LongRoPE factors (long, short), read into the arch, not the model's weights.
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf_file(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == GGUF_MAGIC


def load_gguf(path: str) -> Checkpoint:
    reader = _open_reader(path)
    fields = _read_fields(reader)
    gguf_arch = fields.get("general.architecture")
    if gguf_arch not in _ARCHITECTURES:
        raise ValueError(
            f"model: architecture {gguf_arch!r} of {path} is not supported "
            f"(supported in GGUF files: {', '.join(_ARCHITECTURES)}; {', '.join(SUPPORTED_ARCHITECTURES)} "
            "in Hugging Face folders)"
        )
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    _check_tensors(path, reader, tensors)
    arch = _arch_from_fields(fields, gguf_arch, tensors)
    tokenizer = _tokenizer_from_fields(fields)
    divisors = None
    if "rope_freqs.weight" in tensors:
        divisors = torch.from_numpy(_dequantized(tensors["rope_freqs.weight"]).copy())
    return Checkpoint(
        source=path,
        format="gguf",
        arch=arch,
        tokenizer=tokenizer,
        fingerprint=file_fingerprint(path),
        num_tensors=len(tensors),
        read_weights=lambda: _iter_weights(tensors, arch, gguf_arch),
        rope_frequency_divisors=divisors,
    )


class MappedGGUFReader(GGUFReader):
    """gguf's reader, taking each value it parses from a plain array view of its file map.

    The library slices its np.memmap once per value; memmap's bookkeeping on every slice made
    opening a file with a 49152-token vocabulary (about 250,000 values) take 2.3 s, 0.6 s this
    way. The same fields and tensors; `_get` is the library's own, on the view."""

    _mapped_bytes: np.ndarray | None = None

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        if self._mapped_bytes is None:
            self._mapped_bytes = self.data.view(np.ndarray)
        count = int(count)
        item = np.dtype(dtype)
        values = self._mapped_bytes[offset : offset + item.itemsize * count].view(item)[:count]
        byte_order = self.byte_order if override_order is None else override_order
        return values.view(values.dtype.newbyteorder(byte_order))


def _open_reader(path: str) -> GGUFReader:
    if not is_gguf_file(path):
        raise ValueError(f"model: {path} is not a GGUF file (its first bytes are not 'GGUF')")
    try:
        return MappedGGUFReader(path)
    except Exception as error:  # the reader raises many kinds on damaged files
        raise ValueError(f"model: {path} is a corrupt or truncated GGUF file ({error})") from error


def _read_fields(reader: GGUFReader) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name, gguf_field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        values[name] = gguf_field.contents()
    return values


def _check_tensors(path: str, reader: GGUFReader, tensors: dict[str, Any]) -> None:
    file_size = os.path.getsize(path)
    for tensor in tensors.values():
        if tensor.data_offset + tensor.n_bytes > file_size or tensor.data.nbytes != tensor.n_bytes:
            raise ValueError(
                f"model: {path} is truncated: tensor {tensor.name} needs bytes up to "
                f"{tensor.data_offset + tensor.n_bytes}, the file has {file_size}"
            )
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"model: tensor {tensor.name} of {path} has type {tensor.tensor_type.name}, "
                "which is not supported"
            )
    if "token_embd.weight" not in tensors:
        raise ValueError(f"model: {path} has no token_embd.weight tensor")


def _arch_from_fields(fields: dict[str, Any], gguf_arch: str, tensors: dict[str, Any]) -> ModelArch:
    def get(key: str, default: Any = None) -> Any:
        value = fields.get(f"{gguf_arch}.{key}", default)
        if value is None:
            raise ValueError(f"model: GGUF metadata {gguf_arch}.{key} is missing")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    head_dim = int(fields.get(f"{gguf_arch}.attention.key_length", hidden_size // num_heads))
    rope_dim = int(fields.get(f"{gguf_arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim and gguf_arch in _PERMUTED_QK:
        # Its converter interleaves whole heads' rows; which of them rotate is not recorded.
        raise ValueError(
            f"model: GGUF metadata {gguf_arch}.rope.dimension_count {rope_dim} (partial rotary of "
            f"{head_dim} dims) is not supported for {gguf_arch} files"
        )
    vocab_size = int(
        fields.get(f"{gguf_arch}.vocab_size", len(fields.get("tokenizer.ggml.tokens", [])))
    )
    return ModelArch(
        architecture=_ARCHITECTURES[gguf_arch],
        vocab_size=vocab_size or int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden_size,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(fields.get(f"{gguf_arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(fields.get(f"{gguf_arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        attention_output_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        rope_scaling=_rope_scaling(fields, gguf_arch, tensors),
        rotary_dim=rope_dim if rope_dim != head_dim else None,
        sliding_window=fields.get(f"{gguf_arch}.attention.sliding_window"),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **(_gemma_fields(fields, gguf_arch, num_heads, head_dim) if gguf_arch in _GEMMA else {}),
    )


def _gemma_fields(fields: dict[str, Any], gguf_arch: str, num_heads: int, head_dim: int) -> dict[str, Any]:
    """How Gemma 2's and 3's layers differ from Llama's, as llama.cpp reads them from a file its
    converter wrote: norms already hold 1 + weight (no offset), the local/global layout and Gemma
    3's local rotary base from the file or llama.cpp's defaults, the query scale by model size."""
    num_layers = int(fields[f"{gguf_arch}.block_count"])
    hidden_size = int(fields[f"{gguf_arch}.embedding_length"])
    query_scalar = hidden_size / num_heads if num_layers == _GEMMA_27B_BLOCKS[gguf_arch] else head_dim
    local_rope_theta = fields.get(f"{gguf_arch}.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA)
    return dict(
        sliding_window_layers=gemma_local_layers(fields, gguf_arch, num_layers),
        local_rope_theta=float(local_rope_theta) if gguf_arch == "gemma3" else None,
        embedding_multiplier=hidden_size**0.5,
        sandwich_norms=True,
        hidden_activation="gelu_tanh",
        attention_scale=query_scalar**-0.5,
        final_logit_softcap=fields.get(f"{gguf_arch}.final_logit_softcapping"),
        attention_logit_softcap=fields.get(f"{gguf_arch}.attn_logit_softcapping"),
    )


def gemma_local_layers(fields: dict[str, Any], gguf_arch: str, num_layers: int) -> tuple[int, ...]:
    """The sliding-window layers: `attention.sliding_window_pattern` as a flag per layer or as
    "every n-th layer global", else llama.cpp's default for the architecture."""
    pattern = fields.get(f"{gguf_arch}.attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[gguf_arch])
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(
                f"model: GGUF metadata {gguf_arch}.attention.sliding_window_pattern has "
                f"{len(pattern)} flags for {num_layers} layers"
            )
        return tuple(index for index, local in enumerate(pattern) if local)
    every = int(pattern)
    return tuple(index for index in range(num_layers) if every == 0 or index % every < every - 1)


def _rope_scaling(fields: dict[str, Any], gguf_arch: str, tensors: dict[str, Any]) -> RopeScaling | None:
    if _LONGROPE_TENSORS[0] in tensors or _LONGROPE_TENSORS[1] in tensors:
        return _longrope_scaling(fields, gguf_arch, tensors)
    scaling_type = fields.get(f"{gguf_arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    factor = float(fields.get(f"{gguf_arch}.rope.scaling.factor", 1.0))
    return RopeScaling(rope_type=scaling_type, factor=factor)


def _longrope_scaling(fields: dict[str, Any], gguf_arch: str, tensors: dict[str, Any]) -> RopeScaling:
    """llama.cpp's Phi-3 LongRoPE: the factors as tensors, the original context length and the
    attention factor (which its converter computed as transformers does) as metadata."""
    missing = [name for name in _LONGROPE_TENSORS if name not in tensors]
    original_key = f"{gguf_arch}.rope.scaling.original_context_length"
    if missing or original_key not in fields:
        raise ValueError(
            f"model: LongRoPE in a GGUF file needs {', '.join(_LONGROPE_TENSORS)} and {original_key}; "
            f"missing {', '.join(missing + ([original_key] if original_key not in fields else []))}"
        )
    long_factor, short_factor = (
        _dequantized(tensors[name]).reshape(-1).tolist() for name in _LONGROPE_TENSORS
    )
    return RopeScaling(
        rope_type="longrope",
        original_max_position_embeddings=int(fields[original_key]),
        short_factor=tuple(short_factor),
        long_factor=tuple(long_factor),
        attention_factor=float(fields.get(f"{gguf_arch}.rope.scaling.attn_factor", 1.0)),
    )


def _tokenizer_from_fields(fields: dict[str, Any]) -> Tokenizer:
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError("model: the GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    model = fields.get("tokenizer.ggml.model", "gpt2")
    tokens = list(fields["tokenizer.ggml.tokens"])
    token_types = list(fields.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    bos_token_id = fields.get("tokenizer.ggml.bos_token_id")
    vocab = GGUFVocab(
        model=model,
        pre=fields.get("tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=token_types,
        merges=list(fields.get("tokenizer.ggml.merges", [])),
        scores=list(fields.get("tokenizer.ggml.scores", [0.0] * len(tokens))),
        bos_token_id=bos_token_id,
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", model == "llama")),
    )
    eos_ids = [
        int(fields[key])
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if key in fields
    ]
    return Tokenizer(
        backend=build_tokenizer(vocab),
        eos_token_ids=eos_ids,
        bos_token_id=bos_token_id,
        chat_template=fields.get("tokenizer.chat_template"),
    )


def _dequantized(tensor: Any) -> np.ndarray:
    """float32 array in row-major [rows, cols] (GGUF lists dimensions innermost first)."""
    array = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    return np.array(array, dtype=np.float32).reshape(shape)  # a writable copy, not the file map


def undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp stores each head's rows as interleaved (even, odd) rope pairs; transformers
    stores the two halves one after the other. Undo the converter's reordering."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
    )


def _iter_weights(tensors: dict[str, Any], arch: ModelArch, gguf_arch: str) -> NamedTensors:
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight" or name in _LONGROPE_TENSORS:
            continue
        hf_name = _hf_name(name, gguf_arch)
        if hf_name is None:
            raise ValueError(f"model: unexpected GGUF tensor {name}")
        weight = torch.from_numpy(_dequantized(tensor))
        if gguf_arch in _PERMUTED_QK and ".q_proj." in hf_name:
            weight = undo_rope_permutation(weight, arch.num_heads)
        elif gguf_arch in _PERMUTED_QK and ".k_proj." in hf_name:
            weight = undo_rope_permutation(weight, arch.num_kv_heads)
        yield hf_name, weight


def gguf_tensor_name(hf_name: str, gguf_arch: str) -> str:
    """llama.cpp's name of a Hugging Face weight, as its converter writes it (`_hf_name`'s
    inverse; a KeyError for a weight it has no name for)."""
    by_hf_name = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
    if hf_name in by_hf_name:
        return by_hf_name[hf_name]
    layer_names = _LAYER_NAMES | _SANDWICH_NORM_NAMES if gguf_arch in _GEMMA else _LAYER_NAMES
    by_local_name = {local: part for part, local in layer_names.items()}
    _, _, layer, rest = hf_name.split(".", 3)
    local, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{by_local_name[local]}.{kind}"


def _hf_name(gguf_name: str, gguf_arch: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    layer_names = _LAYER_NAMES | _SANDWICH_NORM_NAMES if gguf_arch in _GEMMA else _LAYER_NAMES
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        return None
    layer, part, kind = match.groups()
    local = "mlp.gate_up_proj" if part == "ffn_up" and gguf_arch in _FUSED_GATE_UP else layer_names[part]
    return f"model.layers.{layer}.{local}.{kind}"
