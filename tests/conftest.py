"""Shared fixtures: the embedded model through firsttoken, and through transformers as the reference;
and the tier of every collected test (see "Test tiers" in the README)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pathlib
import tempfile
from typing import TYPE_CHECKING

import pytest
import torch

# Converted weights, built kernels and step costs go to a cache of this run, never the user's
# (engines started by tests, and the servers they spawn, read XDG_CACHE_HOME).
# pytest-xdist workers inherit the controller's (_RUN_CACHE_ENV): one build of the kernels per run.
_RUN_CACHE_ENV = "FIRSTTOKEN_TEST_RUN_CACHE"
if _RUN_CACHE_ENV not in os.environ:
    _RUN_CACHE = tempfile.TemporaryDirectory(prefix="firsttoken-tests-")
    os.environ[_RUN_CACHE_ENV] = _RUN_CACHE.name
os.environ["XDG_CACHE_HOME"] = os.environ[_RUN_CACHE_ENV]

# Importing firsttoken compiles kernels, which imports triton; without a GPU, tests/cuda needs
# triton's interpreter, and triton reads that choice once, when it is first imported.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from firsttoken.models.registry import default_model_path  # noqa: E402
from firsttoken.ops.cpu_info import physical_core_count  # noqa: E402

if TYPE_CHECKING:
    from firsttoken import LLM
    from firsttoken.ops.native import NativeKernels

TEST_KV_CACHE_BYTES = 512 * 1024 * 1024
# pytest-xdist (`-n auto` in pyproject.toml's addopts) runs test files in parallel processes: one
# per physical core, at most MAX_TEST_WORKERS, and one per TEST_WORKER_MEMORY_BYTES of memory
# (a worker holds engines of its own, up to MAX_SHARED_ENGINES shared ones besides a module's).
MAX_TEST_WORKERS = 4
TEST_WORKER_MEMORY_BYTES = 8 << 30


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(physical_core_count(), MAX_TEST_WORKERS, memory_bytes // TEST_WORKER_MEMORY_BYTES))


def _test_threads() -> int | None:
    """The threads of a test engine: FIRSTTOKEN_TEST_THREADS if set; else, in one of several
    pytest-xdist workers, its share of the physical cores (threads beyond a free core wait on
    each other); else None, the engine's own default."""
    if os.environ.get("FIRSTTOKEN_TEST_THREADS"):
        return int(os.environ["FIRSTTOKEN_TEST_THREADS"])
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, physical_core_count() // num_workers) if num_workers > 1 else None


TEST_THREADS = _test_threads()
if TEST_THREADS is not None:
    torch.set_num_threads(TEST_THREADS)  # the tests' own torch ops keep to the share too


@contextlib.contextmanager
def on_this_workers_cores():
    """Inside, the calling thread (and the threads it starts) may run on TEST_THREADS of the
    process's cores only (the pytest-xdist worker's share, by its number), so an engine of default
    options (a thread per core it may run on, adapting) starts as on a machine of that many cores
    instead of contending with the other workers for all of them. Outside pytest-xdist, nothing
    changes."""
    if TEST_THREADS is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    allowed = sorted(os.sched_getaffinity(0))
    worker_index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    first = worker_index * TEST_THREADS % len(allowed)
    os.sched_setaffinity(0, [allowed[(first + offset) % len(allowed)] for offset in range(TEST_THREADS)])
    try:
        yield
    finally:
        os.sched_setaffinity(0, allowed)


# Test engines with a fixed chunk size keep a fixed thread count: adapting it needs the step-cost
# model, measured at start (minutes on a busy 2-core machine), which nothing else there reads.
FIXED_THREADS = {"adaptive_threads": False, "num_threads": TEST_THREADS}


def cpu_has_bf16_instructions() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16). Elsewhere bf16 runs emulated,
    slower than float32 (for transformers too), and no bf16 engine claims batch invariance."""
    from firsttoken.ops.cpu_info import cpu_flags

    return "avx512_bf16" in cpu_flags()


def may_claim_batch_invariance(dtype: str) -> bool:
    """False where an engine of `dtype` surely claims no batch invariance here, known without
    starting one; True where it may (the engine's own claim still decides)."""
    return dtype != "bfloat16" or cpu_has_bf16_instructions()


# How many engines `engine_for` keeps alive at once (each holds its weights and KV cache).
MAX_SHARED_ENGINES = 4

TESTS_ROOT = pathlib.Path(__file__).resolve().parent
# Costliest first: pytest-xdist hands test files to its workers in collection order, and a run
# should end on short files of the fast tier, not with one worker alone on a long one.
TIERS = ("ray", "browser", "server", "engine", "triton", "fast")
# A test using one of these fixtures (directly or through another fixture) is in that tier.
TIER_OF_FIXTURE = {"chromium": "browser", "ray_cluster": "ray"}
# Fixtures that load the embedded model: a test using one runs a real engine.
MODEL_FIXTURES = frozenset(
    {"model_path", "llm", "engine_for", "hf_model", "hf_tokenizer", "two_layer_model_path"}
)
# Folders whose tests start servers or engines, or build kernels, even without the embedded model.
SERVER_FOLDERS = frozenset({"server", "reliability", "deploy"})
ENGINE_FOLDERS = frozenset({"attention", "engine", "models", "ops", "worker", "reliability"})


def tier_of(item: pytest.Item) -> str:
    """The one tier a test runs in: by the fixtures it uses, then by its folder; the rest is fast."""
    path = pathlib.Path(item.path).resolve()
    folder = path.relative_to(TESTS_ROOT).parts[0] if TESTS_ROOT in path.parents else ""
    if folder == "cuda":
        return "triton"
    fixtures = set(item.fixturenames)
    for fixture, tier in TIER_OF_FIXTURE.items():
        if fixture in fixtures:
            return tier
    if fixtures & MODEL_FIXTURES:
        return "server" if folder in SERVER_FOLDERS else "engine"
    if folder in ENGINE_FOLDERS:
        return "engine"
    return "fast"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its tier, so `pytest -m fast` (or engine, ...) selects one; a test
    marked slow is in no other tier, so that selecting a tier never runs a slow test. Then order
    the files by their costliest tier (TIERS; slow last), each file's tests in their order."""
    for item in items:
        if item.get_closest_marker("slow") is not None:
            continue
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(tier_of(item))
    by_cost = (*TIERS, "slow")
    file_rank: dict[pathlib.Path, int] = {}
    for item in items:
        rank = min(by_cost.index(marker.name) for marker in item.iter_markers() if marker.name in by_cost)
        file_rank[item.path] = min(rank, file_rank.get(item.path, rank))
    items.sort(key=lambda item: file_rank[item.path])


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def embedded_tokenizer():
    """The embedded model's tokenizer alone, read once (no weights: tests using it stay fast)."""
    from firsttoken.models.registry import open_checkpoint

    return open_checkpoint(default_model_path()).tokenizer


@pytest.fixture(scope="session")
def llm(model_path):
    """A float32 engine with a fixed chunk size (no start-up calibration)."""
    from firsttoken import LLM

    return LLM(
        model_path,
        dtype="float32",
        kv_cache_memory_bytes=TEST_KV_CACHE_BYTES,
        chunk_size=512,
        **FIXED_THREADS,
    )


class SharedEngines:
    """Owns the engines that tests share by their options (the embedded model unless `model`
    names another): one per distinct option set, the least recently asked for dropped beyond
    MAX_SHARED_ENGINES.

    For tests that only generate and read what came back: a test that pins, resets the prefix
    cache, injects a fault, counts prefix-cache hits or shuts its engine down builds its own."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        self.engines: dict[str, LLM] = {}

    def __call__(self, **options) -> LLM:
        from firsttoken import LLM

        if "adaptive_threads" not in options:
            options = {**FIXED_THREADS, **options}
        key = repr(sorted(options.items()))
        engine = self.engines.pop(key, None)
        if engine is None:
            engine = LLM(**{"model": self.model_path, **options})
        self.engines[key] = engine  # now the most recently asked for
        while len(self.engines) > MAX_SHARED_ENGINES:
            del self.engines[next(iter(self.engines))]
        return engine


@pytest.fixture(scope="session")
def native_kernels() -> NativeKernels | None:
    """The run's build of the compiled CPU kernels engines use (`auto`), or None on a machine
    without a working C compiler."""
    from tests.native_builds import built_kernels

    return built_kernels()


@pytest.fixture(scope="session")
def engine_for(model_path) -> SharedEngines:
    """`engine_for(**options)`: the session's LLM on the embedded model (or `model=`) with these
    options (and a fixed thread count unless `adaptive_threads` is given), started on first use."""
    return SharedEngines(model_path)


@pytest.fixture(scope="session")
def two_layer_model_path(tmp_path_factory) -> str:
    """A random-weight model of the embedded model's shapes and tokenizer with 2 of its 30
    layers: the same kernels at a fifth of the step time, for tests of the engine's logic
    (batching, chunking, caching, preemption) that compare it with itself."""
    from tests.models.tiny_models import write_smollm2_shaped_folder

    return write_smollm2_shaped_folder(str(tmp_path_factory.mktemp("two-layer-smollm2")))


@contextlib.contextmanager
def transformers_reading_gguf_quickly():
    """transformers' GGUF loading (models and tokenizers) on the gguf reader firsttoken opens
    files with (the library's, on a plain view of the file map: the same fields and tensors,
    tests/models/test_checkpoints.py), and with gguf's tensor-name map built once per
    architecture instead of once per module: the same model from the same file, ~2x sooner."""
    import gguf

    from firsttoken.models.loaders.gguf_file import MappedGGUFReader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", MappedGGUFReader)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own GGUF loader and Llama implementation on the same file, float32.

    Its GGUF loader takes ~8 s of a core: the first test process of the run to need the model
    saves the weights it made in the run's cache, and the others read them (~0.5 s)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from firsttoken.cache_lock import building

    saved_folder = os.path.join(os.environ[_RUN_CACHE_ENV], "transformers-reference")
    saved_weights = os.path.join(saved_folder, "model.safetensors")
    with building(saved_folder + ".lock", "transformers' reference model"):
        if os.path.exists(saved_weights):
            model = AutoModelForCausalLM.from_pretrained(saved_folder, dtype=torch.float32)
        else:
            folder, file_name = os.path.split(model_path)
            with transformers_reading_gguf_quickly():
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file_name, dtype=torch.float32)
            model.config.save_pretrained(saved_folder)
            save_model(model, saved_weights + ".partial")
            os.replace(saved_weights + ".partial", saved_weights)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer

    folder, file_name = os.path.split(model_path)
    with transformers_reading_gguf_quickly():
        return AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
