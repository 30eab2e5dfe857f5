"""Every test lands in one tier by its fixtures and folder, with no marker written in its file."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.conftest import TESTS_ROOT, tier_of


def _item(relative_path: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(path=TESTS_ROOT / relative_path, fixturenames=list(fixtures))


@pytest.mark.parametrize(
    ("path", "fixtures", "tier"),
    [
        ("core/test_scheduler.py", (), "fast"),
        ("server/test_json_body.py", ("tmp_path",), "fast"),
        ("ops/test_native.py", ("native_kernels",), "engine"),
        ("engine/test_generation.py", ("llm", "model_path"), "engine"),
        ("test_cli.py", ("model_path",), "engine"),
        ("server/test_openai_api.py", ("server", "model_path"), "server"),
        ("reliability/test_soak.py", ("server", "model_path"), "server"),
        ("server/test_chat_page_browser.py", ("page", "chromium", "server", "model_path"), "browser"),
        ("deploy/test_ray_serve.py", ("endpoint", "ray_cluster", "model_path"), "ray"),
        ("cuda/test_triton_ops.py", ("model_path",), "triton"),
    ],
)
def test_a_test_is_in_the_tier_its_fixtures_and_folder_say(path, fixtures, tier):
    assert tier_of(_item(path, *fixtures)) == tier


def test_a_test_outside_the_tests_folder_is_fast():
    assert tier_of(SimpleNamespace(path=TESTS_ROOT.parent / "bench" / "test_x.py", fixturenames=[])) == "fast"
