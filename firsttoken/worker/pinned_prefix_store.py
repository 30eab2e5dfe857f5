"""Pinned prefixes on disk: their KV, tokens and the identity of the engine that computed them.

One safetensors file per pinned prefix. A file is loaded only into an engine with the same
model content, dtype, projections, block size and KV shape, and only if the block hashes recomputed from
its tokens equal the stored ones; anything else is refused with a message naming why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from firsttoken.errors import InvalidInputError
from firsttoken.models.loaders.file_identity import file_fingerprint

if TYPE_CHECKING:
    from firsttoken.config import ModelConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = "1"
_PIN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


@dataclass(frozen=True)
class KVIdentity:
    """What makes KV computed by one engine valid in another."""

    model_fingerprint: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # How the projections computing the KV are held (`projections_form`): quantized weights give
    # other values, a rotated model's values are in another basis. Files written before it was
    # recorded were float.
    projections: str = "float"


def projections_form(model_config: ModelConfig) -> str:
    """"float", or the quantization, with ", rotated" for a model turned by `w8a8_rotation` and
    the content identity of each calibration file that smooths or rounds its weights."""
    form = model_config.quantization or "float"
    if model_config.w8a8_rotation:
        form += ", rotated"
    for calibration in (model_config.w8a8_activation_stats, model_config.w8a8_weights):
        if calibration is not None:
            form += f", calibrated {calibration_identity(calibration)}"
    return form


def calibration_identity(path: str) -> str:
    """The file's content identity as a model file's is taken (its size, head and tail); an
    unreadable file's loading refuses it, here it is named by its path."""
    try:
        return file_fingerprint(path)[:16]
    except OSError:
        return path


@dataclass(frozen=True)
class StoredPrefix:
    pin_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    kv: torch.Tensor  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]


def validate_pin_id(pin_id: str) -> None:
    if not _PIN_ID.match(pin_id):
        raise InvalidInputError("pin_id", f"must be 1-128 letters, digits, '_', '.' or '-', got {pin_id!r}")


class PinnedPrefixStore:
    """Reads and writes the pinned-prefix files of one folder for one KV identity."""

    def __init__(self, folder: str, identity: KVIdentity) -> None:
        self.folder = folder
        self.identity = identity

    def path(self, pin_id: str) -> str:
        return os.path.join(self.folder, f"{pin_id}.safetensors")

    def save(self, pin_id: str, token_ids: list[int], block_hashes: list[bytes], kv: torch.Tensor) -> None:
        os.makedirs(self.folder, exist_ok=True)
        metadata = {
            "format_version": FORMAT_VERSION,
            "identity": json.dumps(asdict(self.identity)),
            "pin_id": pin_id,
            "token_ids": json.dumps(token_ids),
            "block_hashes": json.dumps([block_hash.hex() for block_hash in block_hashes]),
        }
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        os.close(handle)
        try:
            save_file({"kv": kv.contiguous().cpu()}, temporary, metadata=metadata)
            os.replace(temporary, self.path(pin_id))
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    def delete(self, pin_id: str) -> None:
        if os.path.exists(self.path(pin_id)):
            os.remove(self.path(pin_id))

    def load_all(self) -> list[StoredPrefix]:
        """Every valid file of the folder; invalid ones are logged and left alone."""
        if not os.path.isdir(self.folder):
            return []
        prefixes = []
        for name in sorted(os.listdir(self.folder)):
            if not name.endswith(".safetensors"):
                continue
            try:
                prefixes.append(self.load(os.path.join(self.folder, name)))
            except ValueError as error:
                logger.warning("prompt cache: refusing %s: %s", name, error)
        return prefixes

    def load(self, path: str) -> StoredPrefix:
        """One file, checked against this store's identity; ValueError says what is wrong."""
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                kv = handle.get_tensor("kv")
        except Exception as error:  # safetensors raises several kinds on damaged files
            raise ValueError(f"unreadable or corrupt file ({error})") from error
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {metadata.get('format_version')!r}, expected {FORMAT_VERSION}")
        try:
            stored_identity = KVIdentity(**json.loads(metadata["identity"]))
            token_ids = [int(token) for token in json.loads(metadata["token_ids"])]
            block_hashes = [bytes.fromhex(value) for value in json.loads(metadata["block_hashes"])]
            pin_id = metadata["pin_id"]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed metadata ({error})") from error
        self._check_identity(stored_identity)
        expected_shape = (
            self.identity.num_layers, 2, len(block_hashes), self.identity.block_size,
            self.identity.num_kv_heads, self.identity.head_dim,
        )
        if tuple(kv.shape) != expected_shape or str(kv.dtype).removeprefix("torch.") != self.identity.dtype:
            raise ValueError(
                f"KV tensor {tuple(kv.shape)} {kv.dtype} does not match {expected_shape} "
                f"{self.identity.dtype}"
            )
        validate_pin_id(pin_id)
        return StoredPrefix(pin_id, token_ids, block_hashes, kv)

    def _check_identity(self, stored: KVIdentity) -> None:
        for field_name, ours in asdict(self.identity).items():
            theirs = getattr(stored, field_name)
            if theirs != ours:
                raise ValueError(
                    f"written for {field_name}={theirs!r}, this engine has {field_name}={ours!r}"
                )
