"""Finds a model named by its Hugging Face repo id in the local Hugging Face cache, offline."""

from __future__ import annotations

import os
import re

# `org/name` or `org/name@revision`, as the hub spells repo ids (letters, digits, `-_.`).
_REPO_ID = re.compile(r"^(?P<repo_id>[\w.-]+/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


def looks_like_repo_id(model: str) -> bool:
    return _REPO_ID.match(model) is not None


def cached_model_path(model: str) -> str:
    """The snapshot folder of `model` (`org/name[@revision]`) in the local cache, or the one GGUF
    file in it when the snapshot has no config.json. Never reaches the network: a model that is
    not cached is an error naming the cache folder searched."""
    # Imported here: only a repo id needs the hub's cache layout.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    match = _REPO_ID.match(model)
    if match is None:
        raise ValueError(f"model: {model!r} is not a Hugging Face repo id (org/name[@revision])")
    try:
        snapshot = snapshot_download(match["repo_id"], revision=match["revision"], local_files_only=True)
    except LocalEntryNotFoundError as error:
        raise ValueError(
            f"model: {model} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}); "
            f"download it there first with `{download_command(match['repo_id'], match['revision'])}` "
            "(nothing is fetched at run time) or pass a file or folder"
        ) from error
    return _model_in_snapshot(model, snapshot)


def download_command(repo_id: str, revision: str | None) -> str:
    """The command of huggingface_hub's CLI (`hf`, installed with it) that puts the repo in the
    cache this module reads."""
    return f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")


def _model_in_snapshot(model: str, snapshot: str) -> str:
    if os.path.exists(os.path.join(snapshot, "config.json")):
        return snapshot
    gguf_files = sorted(name for name in os.listdir(snapshot) if name.endswith(".gguf"))
    if len(gguf_files) == 1:
        return os.path.join(snapshot, gguf_files[0])
    if gguf_files:
        raise ValueError(
            f"model: {model} holds {len(gguf_files)} GGUF files ({', '.join(gguf_files)}); "
            f"pass one of them as a path under {snapshot}"
        )
    raise ValueError(
        f"model: the cached snapshot of {model} ({snapshot}) has no config.json and no GGUF file"
    )
