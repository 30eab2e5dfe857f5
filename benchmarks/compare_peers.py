"""TTFT and decode speed of firsttoken against transformers (and llama.cpp when installed),
on the same prompts in the same run, with ratios.

    python benchmarks/compare_peers.py [--input-lens 128 512 2048] [--output-len 32] [--runs 3] \\
        [--dtype float32]

The same as `firsttoken bench compare`; every engine option of firsttoken is a flag too.
--dtype defaults to float32 and applies to transformers too.
"""

from __future__ import annotations

import argparse
import sys

from firsttoken.bench.bench_commands import add_compare_args, run_compare


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_compare_args(parser)
    return run_compare(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
