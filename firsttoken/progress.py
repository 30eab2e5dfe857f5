"""Progress on stderr for commands that run for a while. Shown only to a person watching (stderr
a terminal, and no --no-progress): a pipe or a log file gets none, so what a command prints on
stdout, a table or JSON, reads the same either way."""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm


def add_no_progress_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress on stderr (none is shown unless a terminal)"
    )


def progress_wanted(no_progress: bool) -> bool:
    return not no_progress and sys.stderr.isatty()


def announce_engine(description: str) -> None:
    """The engine's one-line description (model, dtype, device, the native kernels' ISA), at any
    log level: which kernels run is the first thing to check when speed surprises."""
    print(f"firsttoken: engine: {description}", file=sys.stderr, flush=True)


def announce_engine_start(enabled: bool) -> None:
    """Loading the model and the start-up measurements take seconds before anything else shows."""
    if enabled:
        print("firsttoken: starting the engine (loading the model, choosing its kernels)...", file=sys.stderr,
              flush=True)  # fmt: skip


def progress_bar(total: int, description: str, unit: str, enabled: bool) -> tqdm:
    """A bar that leaves no line behind once done: the command's own report follows it."""
    return tqdm(total=total, desc=description, unit=unit, file=sys.stderr, disable=not enabled, leave=False)
