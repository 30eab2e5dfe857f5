"""On-disk cache of what converting a GGUF file produces: metadata, tokenizer, fused weights.

Parsing a GGUF file's vocabulary takes seconds in pure Python and dequantizing its weights
about a second per 100M parameters; both happen once per file, after which a start reads a
small JSON, a tokenizer.json and a safetensors file. Every entry is keyed by the file's
content fingerprint and a format version, and written atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from typing import Callable, ContextManager

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from firsttoken.cache_lock import building
from firsttoken.models.arch import ModelArch
from firsttoken.models.loaders.checkpoint import Checkpoint, NamedTensors
from firsttoken.ops.rotary import RopeScaling
from firsttoken.tokenizer import Tokenizer, read_tokenizer_file

logger = logging.getLogger(__name__)

# Bump when the converted layout changes, so stale entries are never read.
FORMAT_VERSION = 2


def default_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "firsttoken")


class ConversionCache:
    """One folder per converted model file."""

    def __init__(self, cache_dir: str | None, fingerprint: str) -> None:
        root = cache_dir or default_cache_dir()
        entry = f"{fingerprint}-v{FORMAT_VERSION}"
        self.folder = os.path.join(root, "converted", entry)
        self.lock_file = os.path.join(root, "locks", f"converted-{entry}.lock")

    def converting(self) -> ContextManager[None]:
        """Hold while checking for and writing this file's entries: one process converts, any
        other started beside it waits and then reads the result."""
        return building(self.lock_file, f"the conversion of {os.path.basename(self.folder)}")

    def weights_file(self, dtype: torch.dtype) -> str:
        return os.path.join(self.folder, f"weights-{str(dtype).removeprefix('torch.')}.safetensors")

    def load_checkpoint(self, source: str, read_weights: Callable[[], NamedTensors]) -> Checkpoint | None:
        """The cached metadata and tokenizer of `source`, or None if absent or unreadable."""
        meta_file = os.path.join(self.folder, "meta.json")
        tokenizer_file = os.path.join(self.folder, "tokenizer.json")
        if not (os.path.isfile(meta_file) and os.path.isfile(tokenizer_file)):
            return None
        try:
            with open(meta_file, encoding="utf-8") as handle:
                meta = json.load(handle)
            arch_fields = dict(meta["arch"])
            if arch_fields.get("rope_scaling") is not None:
                arch_fields["rope_scaling"] = RopeScaling(**arch_fields["rope_scaling"])
            divisors = meta.get("rope_frequency_divisors")
            return Checkpoint(
                source=source,
                format=meta["format"],
                arch=ModelArch(**arch_fields),
                tokenizer=Tokenizer(
                    read_tokenizer_file(tokenizer_file),
                    eos_token_ids=meta["eos_token_ids"],
                    bos_token_id=meta["bos_token_id"],
                    chat_template=meta["chat_template"],
                ),
                fingerprint=meta["fingerprint"],
                num_tensors=meta["num_tensors"],
                read_weights=read_weights,
                rope_frequency_divisors=torch.tensor(divisors) if divisors is not None else None,
            )
        except Exception as error:  # any damage means: convert again
            logger.warning("ignoring unreadable conversion cache %s (%s)", self.folder, error)
            return None

    def save_checkpoint(self, checkpoint: Checkpoint) -> None:
        tokenizer = checkpoint.tokenizer
        divisors = checkpoint.rope_frequency_divisors
        meta = {
            "format": checkpoint.format,
            "fingerprint": checkpoint.fingerprint,
            "num_tensors": checkpoint.num_tensors,
            "arch": dataclasses.asdict(checkpoint.arch),
            "eos_token_ids": sorted(tokenizer.eos_token_ids),
            "bos_token_id": tokenizer.bos_token_id,
            "chat_template": tokenizer.chat_template.source if tokenizer.chat_template else None,
            "rope_frequency_divisors": divisors.tolist() if divisors is not None else None,
        }
        self._write_atomically("tokenizer.json", lambda path: tokenizer.backend.save(path))
        self._write_atomically("meta.json", lambda path: _write_json(path, meta))

    def load_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        path = self.weights_file(dtype)
        if not os.path.isfile(path):
            return None
        try:
            return load_file(path)
        except Exception as error:  # a damaged file is rebuilt, never trusted
            logger.warning("ignoring unreadable converted weights %s (%s)", path, error)
            return None

    def save_weights(self, dtype: torch.dtype, tensors: dict[str, torch.Tensor]) -> None:
        name = os.path.basename(self.weights_file(dtype))
        self._write_atomically(name, lambda path: save_file(tensors, path))

    def _write_atomically(self, name: str, write: Callable[[str], None]) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
            os.close(handle)
            try:
                write(temporary)
                os.replace(temporary, os.path.join(self.folder, name))
            finally:
                if os.path.exists(temporary):
                    os.remove(temporary)
        # safetensors reports a full disk as its own error, not an OSError: a cache left unwritten
        # costs the next start the work again, never this one.
        except (OSError, SafetensorError) as error:
            logger.warning("could not write %s to the conversion cache %s (%s)", name, self.folder, error)


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle)
