"""Servers for the reliability tests: one shared by the package, and servers of their own for
tests that exhaust or break them. They serve the 2-layer random-weight model of the embedded
model's shapes and tokenizer: what is checked is how the server holds up (limits, refusals,
disconnects, faults), with the same kernels at a fifth of the step time."""

from __future__ import annotations

import pytest

from firsttoken.server.server_config import ServerConfig
from tests.server.conftest import MODEL_NAME, running_server

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 8
MAX_QUEUE = 16
# Small prefill chunks: a prompt of a few hundred tokens takes several steps to its first token.
SHARED_ENGINE_OPTIONS = dict(
    max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, max_waiting_requests=MAX_QUEUE, chunk_size=32
)


def shared_config() -> ServerConfig:
    return ServerConfig(port=0, served_model_names=(MODEL_NAME,), shutdown_timeout_s=5)


@pytest.fixture(scope="package")
def server(two_layer_model_path):
    """The package's server: a short context, a bounded queue, small prefill chunks."""
    with running_server(two_layer_model_path, shared_config(), **SHARED_ENGINE_OPTIONS) as running:
        yield running
