"""Random-weight checkpoints of real architectures at their real shapes, in the files people run.

No model hub is reachable here, and weights do not change speed, so the model-size benchmarks
run on checkpoints made here: seeded random weights at the shapes of Llama-3.2-1B,
Qwen2.5-1.5B and Llama-3.1-8B (and tiny ones of the same architectures for tests), written

- as a transformers folder: bf16 safetensors in shards, config.json, and the embedded model's
  tokenizer (its 49152 tokens; the rest of the vocabulary is never produced by the tokenizer);
- as a bf16 GGUF laid out as llama.cpp's converter lays it out (Llama's q/k rows permuted for
  its rotary layout, norms in float32, Llama 3's `rope_freqs.weight`, the tokenizer padded with
  `[PADn]` tokens to the vocabulary), written with the `gguf` package a tensor at a time;
- as quantized GGUFs (Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K) made from that file by llama.cpp's own
  quantizer (`llama_model_quantize`, through llama-cpp-python installed in its own environment:
  `python3 -m venv ~/.cache/firsttoken-peers/llamacpp && ~/.cache/firsttoken-peers/llamacpp/bin/pip
  install llama-cpp-python` builds it from source in a few minutes).

Every tensor is drawn from its own generator seeded by the seed and its name, so each file of a
model holds the same weights and a rerun rewrites nothing: files already in the cache folder are
kept.

    python benchmarks/make_checkpoint.py llama-3.2-1b --formats hf gguf-bf16 Q4_K_M \
        --llama-cpp-python ~/.cache/firsttoken-peers/llamacpp/bin/python
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "firsttoken-checkpoints")
WEIGHT_STD = 0.02
SHARD_BYTES = 2 << 30
PAD_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED
# llama.cpp's llama_ftype values of the quantized files this script makes.
QUANTIZED_FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
FLOAT_FORMATS = ("hf", "gguf-bf16")
GGUF_BF16_FTYPE = 32


@dataclass(frozen=True)
class Shape:
    """An architecture's shape, as its transformers config.json names it."""

    family: str  # "llama" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    llama3_rope_factor: float | None = None  # Llama 3.1/3.2's "llama3" rope scaling

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    "llama-3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 500000.0, 131072, True, 1e-5, 32.0),
    "qwen2.5-1.5b": Shape("qwen2", 151936, 1536, 8960, 28, 12, 2, 1000000.0, 32768, True, 1e-6),
    "llama-3.1-8b": Shape("llama", 128256, 4096, 14336, 32, 32, 8, 500000.0, 131072, False, 1e-5, 8.0),
    # Tests' shapes: every piece of the real layouts, at a size a test writes in a second.
    "tiny-llama3": Shape("llama", 49152, 64, 128, 2, 4, 2, 500000.0, 4096, True, 1e-5, 8.0),
    "tiny-qwen2": Shape("qwen2", 49152, 64, 160, 2, 4, 2, 1000000.0, 4096, True, 1e-6),
    "tiny-llama-untied": Shape("llama", 49152, 64, 128, 2, 4, 4, 10000.0, 4096, False, 1e-5),
}


def hf_tensors(shape: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each weight's transformers name and shape, in the order the files hold them."""
    yield "model.embed_tokens.weight", (shape.vocab_size, shape.hidden_size)
    kv_size = shape.num_kv_heads * shape.head_dim
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", (shape.hidden_size,)
        for name, rows in (("q_proj", shape.hidden_size), ("k_proj", kv_size), ("v_proj", kv_size)):
            yield f"{prefix}.self_attn.{name}.weight", (rows, shape.hidden_size)
            if shape.family == "qwen2":
                yield f"{prefix}.self_attn.{name}.bias", (rows,)
        yield f"{prefix}.self_attn.o_proj.weight", (shape.hidden_size, shape.hidden_size)
        yield f"{prefix}.post_attention_layernorm.weight", (shape.hidden_size,)
        yield f"{prefix}.mlp.gate_proj.weight", (shape.intermediate_size, shape.hidden_size)
        yield f"{prefix}.mlp.up_proj.weight", (shape.intermediate_size, shape.hidden_size)
        yield f"{prefix}.mlp.down_proj.weight", (shape.hidden_size, shape.intermediate_size)
    yield "model.norm.weight", (shape.hidden_size,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (shape.vocab_size, shape.hidden_size)


def seeded_weight(name: str, dims: tuple[int, ...], seed: int) -> torch.Tensor:
    """The bf16 weight `name` of every file of this seed: norms are ones, the rest normal."""
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(dims, generator=generator) * WEIGHT_STD).to(torch.bfloat16)


def hf_config(shape: Shape) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM" if shape.family == "llama" else "Qwen2ForCausalLM"],
        "model_type": shape.family,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tie_word_embeddings,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": shape.family == "qwen2",
        "use_cache": True,
    }
    if shape.llama3_rope_factor is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": shape.llama3_rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    if shape.family == "qwen2":
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=shape.num_layers)
    return config


def write_hf_folder(shape: Shape, seed: int, folder: str) -> None:
    """bf16 safetensors shards with their index, config.json and the embedded model's tokenizer."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    names = list(hf_tensors(shape))
    shards = shard_names(names)
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        file_name = shard_file_name(number, len(shards))
        tensors = {name: seeded_weight(name, dims, seed) for name, dims in shard}
        save_file(tensors, os.path.join(folder, file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name, _ in shard})
        print(f"  safetensors: shard {number}/{len(shards)}", file=sys.stderr, flush=True)
    total_bytes = sum(math.prod(dims) * 2 for _, dims in names)
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, handle, indent=2)
    _save_tokenizer(folder)
    # config.json last: its presence marks a finished folder.
    with open(os.path.join(folder, "config.json"), "w") as handle:
        json.dump(hf_config(shape), handle, indent=2)


def shard_names(names: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The weights in file order, cut into shards of at most SHARD_BYTES of bf16 (or one weight)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    shard_bytes = 0
    for name, dims in names:
        num_bytes = math.prod(dims) * 2
        if shards[-1] and shard_bytes + num_bytes > SHARD_BYTES:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, dims))
        shard_bytes += num_bytes
    return shards


def shard_file_name(number: int, count: int) -> str:
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def _save_tokenizer(folder: str) -> None:
    """The embedded model's tokenizer files, converted by transformers once per cache folder."""
    import shutil

    converted = os.path.join(os.path.dirname(os.path.dirname(folder)), "tokenizer")
    if not os.path.exists(os.path.join(converted, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        from firsttoken.models.registry import default_model_path

        gguf_folder, file_name = os.path.split(default_model_path())
        AutoTokenizer.from_pretrained(gguf_folder, gguf_file=file_name).save_pretrained(converted + ".tmp")
        shutil.rmtree(converted, ignore_errors=True)
        os.replace(converted + ".tmp", converted)
    for name in os.listdir(converted):
        shutil.copy(os.path.join(converted, name), folder)


def rope_permuted(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter's order of a Llama q or k projection's rows: each head's rotary pairs
    interleaved instead of split in halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_weight(hf_name: str, weight: torch.Tensor, shape: Shape) -> np.ndarray:
    """The tensor as the GGUF file holds it: norms and biases float32, the rest bf16 bits."""
    if shape.family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = shape.num_heads if "q_proj" in hf_name else shape.num_kv_heads
        weight = rope_permuted(weight, heads)
    if weight.dim() == 1:
        return weight.float().numpy()
    return weight.contiguous().view(torch.int16).numpy().view(np.uint16)


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """Llama 3's per-frequency divisors, as llama.cpp's converter writes `rope_freqs.weight`."""
    factor = shape.llama3_rope_factor
    low_freq_factor, high_freq_factor, original_context = 1.0, 4.0, 8192
    frequencies = 1.0 / (
        shape.rope_theta ** (np.arange(0, shape.head_dim, 2, dtype=np.float64) / shape.head_dim)
    )
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < original_context / high_freq_factor:
            divisors.append(1.0)
        elif wavelength > original_context / low_freq_factor:
            divisors.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def write_gguf_bf16(shape: Shape, seed: int, path: str) -> None:
    """The checkpoint as llama.cpp's converter writes a bf16 GGUF, a tensor at a time."""
    import gguf

    from firsttoken.models.loaders.gguf_file import gguf_tensor_name
    from firsttoken.models.registry import default_model_path

    writer = gguf.GGUFWriter(path + ".tmp", shape.family)
    _add_model_fields(writer, shape)
    _add_tokenizer_fields(writer, gguf.GGUFReader(default_model_path()), shape.vocab_size)
    names = list(hf_tensors(shape))
    for hf_name, dims in names:
        name = gguf_tensor_name(hf_name, shape.family)
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), math.prod(dims) * 4)
        else:
            writer.add_tensor_info(
                name, dims, np.dtype(np.uint16), math.prod(dims) * 2, gguf.GGMLQuantizationType.BF16
            )
    factors = llama3_rope_factors(shape) if shape.llama3_rope_factor is not None else None
    if factors is not None:
        writer.add_tensor_info("rope_freqs.weight", factors.shape, factors.dtype, factors.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf_name, dims in progress(names, "gguf bf16"):
        writer.write_tensor_data(gguf_weight(hf_name, seeded_weight(hf_name, dims, seed), shape))
    if factors is not None:
        writer.write_tensor_data(factors)
    writer.close()
    os.replace(path + ".tmp", path)


def _add_model_fields(writer, shape: Shape) -> None:
    writer.add_name(f"firsttoken random {shape.family}")
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_file_type(GGUF_BF16_FTYPE)
    if shape.family == "llama":
        writer.add_vocab_size(shape.vocab_size)
        writer.add_rope_dimension_count(shape.head_dim)


def _add_tokenizer_fields(writer, source, vocab_size: int) -> None:
    """The embedded model's tokenizer, its token list padded to the vocabulary as llama.cpp's
    converter pads a tokenizer smaller than the embedding."""
    fields = {
        name: field.contents() for name, field in source.fields.items() if name.startswith("tokenizer.")
    }
    tokens = list(fields.pop("tokenizer.ggml.tokens"))
    token_types = list(fields.pop("tokenizer.ggml.token_type"))
    if len(tokens) > vocab_size:
        raise SystemExit(f"the tokenizer's {len(tokens)} tokens do not fit a vocabulary of {vocab_size}")
    tokens += [f"[PAD{index}]" for index in range(len(tokens), vocab_size)]
    token_types += [PAD_TOKEN_TYPE] * (vocab_size - len(token_types))
    writer.add_tokenizer_model(fields.pop("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(fields.pop("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(list(fields.pop("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(fields.pop("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(fields.pop("tokenizer.ggml.eos_token_id")))
    writer.add_unk_token_id(int(fields.pop("tokenizer.ggml.unknown_token_id")))
    writer.add_pad_token_id(int(fields.pop("tokenizer.ggml.padding_token_id")))
    writer.add_add_bos_token(bool(fields.pop("tokenizer.ggml.add_bos_token")))
    writer.add_add_space_prefix(bool(fields.pop("tokenizer.ggml.add_space_prefix")))
    writer.add_chat_template(fields.pop("tokenizer.chat_template"))


def quantize(llama_cpp_python: str, source: str, path: str, file_type: str) -> None:
    """`path` from the bf16 `source` by llama.cpp's quantizer, in its own environment."""
    program = (
        "import sys, llama_cpp\n"
        "params = llama_cpp.llama_model_quantize_default_params()\n"
        f"params.ftype = {QUANTIZED_FTYPES[file_type]}\n"
        f"params.nthread = {os.cpu_count()}\n"
        "status = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)\n"
        "sys.exit(status)\n"
    )
    finished = subprocess.run(
        [llama_cpp_python, "-c", program, source, path + ".tmp"], capture_output=True, text=True, check=False
    )
    if finished.returncode != 0:
        raise SystemExit(
            f"llama.cpp's quantizer failed on {file_type} (exit {finished.returncode}):\n"
            f"{finished.stderr[-3000:]}"
        )
    os.replace(path + ".tmp", path)


def progress(items: list, what: str) -> Iterator:
    """Each item, with a line on stderr every tenth of the way."""
    start = time.perf_counter()
    step = max(1, len(items) // 10)
    for index, item in enumerate(items):
        yield item
        if (index + 1) % step == 0 or index + 1 == len(items):
            elapsed = time.perf_counter() - start
            print(f"  {what}: {index + 1}/{len(items)} tensors, {elapsed:.0f} s", file=sys.stderr, flush=True)


def checkpoint_folder(cache: str, model: str, seed: int) -> str:
    return os.path.join(cache, f"{model}-seed{seed}")


def checkpoint_path(cache: str, model: str, seed: int, file_format: str) -> str:
    """Where `make` puts (or found) the model's file of this format."""
    folder = checkpoint_folder(cache, model, seed)
    if file_format == "hf":
        return os.path.join(folder, "hf")
    suffix = "BF16" if file_format == "gguf-bf16" else file_format
    return os.path.join(folder, f"{model}-{suffix}.gguf")


def make(
    model: str,
    formats: list[str],
    seed: int = 0,
    cache: str = DEFAULT_CACHE,
    llama_cpp_python: str | None = None,
) -> dict[str, str]:
    """The checkpoint's files of `formats`, written where missing; each format's path."""
    shape = SHAPES[model]
    wanted_quantized = [name for name in formats if name in QUANTIZED_FTYPES]
    if wanted_quantized and llama_cpp_python is None:
        raise SystemExit(f"{', '.join(wanted_quantized)} need llama.cpp's quantizer: pass --llama-cpp-python")
    paths = {}
    for file_format in formats:
        path = checkpoint_path(cache, model, seed, file_format)
        paths[file_format] = path
        done = (
            os.path.exists(os.path.join(path, "config.json")) if file_format == "hf" else os.path.exists(path)
        )
        if done:
            continue
        os.makedirs(checkpoint_folder(cache, model, seed), exist_ok=True)
        print(f"writing {path}", file=sys.stderr, flush=True)
        if file_format == "hf":
            write_hf_folder(shape, seed, path)
        elif file_format == "gguf-bf16":
            write_gguf_bf16(shape, seed, path)
        else:
            source = make(model, ["gguf-bf16"], seed, cache)["gguf-bf16"]
            quantize(llama_cpp_python, source, path, file_format)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", choices=sorted(SHAPES))
    parser.add_argument(
        "--formats", nargs="+", default=["hf", "gguf-bf16"], choices=[*FLOAT_FORMATS, *QUANTIZED_FTYPES]
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    parser.add_argument("--llama-cpp-python", help="the Python of an environment with llama-cpp-python")
    args = parser.parse_args()
    paths = make(args.model, args.formats, args.seed, args.cache_dir, args.llama_cpp_python)
    for file_format, path in paths.items():
        print(f"{file_format}\t{path}")


if __name__ == "__main__":
    main()
