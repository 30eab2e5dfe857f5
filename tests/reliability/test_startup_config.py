"""A bad start-up config is one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import pytest

from firsttoken.cli import main


@pytest.mark.parametrize(
    "speculative_config,message",
    [
        ('{"method": "ngram", "num_speculative_tokens": "4"}',
         "speculative_config.num_speculative_tokens: expected int, got str '4'"),
        ('{"method": 5}', "speculative_config.method: expected str or null, got int 5"),
        (
            '{"method": "ngram", "prompt_lookup_max": true}',
            "speculative_config.prompt_lookup_max: expected int",
        ),
    ],
)  # fmt: skip
def test_a_wrongly_typed_speculative_field_is_a_clean_error(capsys, speculative_config, message):
    assert main(["serve", "--speculative-config", speculative_config, "--model", "/nonexistent.gguf"]) == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error
