"""Where benchmark output goes: a git-ignored `bench_results/` unless the user names a folder."""

from __future__ import annotations

import json
import os
import time
from typing import Any

DEFAULT_RESULTS_DIR = "bench_results"


def result_stem(directory: str | None, name: str) -> str:
    """`<directory>/<name>-<local time>`: the path of a run's files without their suffix."""
    folder = directory or DEFAULT_RESULTS_DIR
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def write_json(path: str, payload: dict[str, Any]) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=2)
    return path
