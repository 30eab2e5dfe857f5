"""W8A8 checkpoints in the compressed-tensors layout (llm-compressor's output, which vLLM reads).

config.json's `quantization_config` names the scheme: `quant_method` "compressed-tensors", a
format that stores int8 weights as they are ("int-quantized", or "naive-quantized"), and config
groups whose weights are symmetric int8 with one scale per output channel and whose input
activations are symmetric int8, quantized per token at run time. That is the engine's own W8A8
(`firsttoken.ops.w8a8`), so such a checkpoint runs on its levels and scales exactly: each
quantized projection's safetensors hold `<name>.weight` (int8 [out, in]) and
`<name>.weight_scale` ([out, 1] or [out]). Projections the config ignores keep float weights
(the LM head always does here). Any other scheme (static or per-tensor activations, fp8, int4
packed, groups) is refused with the field that differs.
"""

from __future__ import annotations

from typing import Any

COMPRESSED_TENSORS = "compressed-tensors"
# Formats whose quantized weights are stored as int8 tensors (no packing).
INT8_FORMATS = ("int-quantized", "naive-quantized")
_INT8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INT8_TOKEN_ACTIVATIONS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "token",
    "dynamic": True,
}


def checkpoint_quantization(config: dict[str, Any], path: str) -> str | None:
    """ "w8a8" for a compressed-tensors W8A8 checkpoint (dynamic per-token activations, per-channel
    weights), None for a float one; ValueError naming what differs for any other quantization."""
    quantization_config = config.get("quantization_config")
    if quantization_config is None:
        return None
    method = quantization_config.get("quant_method")
    if method != COMPRESSED_TENSORS:
        raise ValueError(
            f"model: quantization_config.quant_method {method!r} of {path} is not supported "
            f"(supported: {COMPRESSED_TENSORS!r} W8A8, or a float checkpoint)"
        )
    groups = quantization_config.get("config_groups") or {}
    if not groups:
        raise ValueError(f"model: quantization_config of {path} has no config_groups")
    for group_name, group in groups.items():
        where = f"quantization_config.config_groups.{group_name}"
        group_format = group.get("format") or quantization_config.get("format")
        if group_format not in INT8_FORMATS:
            raise ValueError(
                f"model: {where}.format {group_format!r} of {path} is not supported "
                f"(supported: {', '.join(INT8_FORMATS)})"
            )
        _check_args(group.get("weights"), _INT8_WEIGHTS, f"{where}.weights", path)
        activations = group.get("input_activations")
        _check_args(activations, _INT8_TOKEN_ACTIVATIONS, f"{where}.input_activations", path)
        if group.get("output_activations") is not None:
            raise ValueError(f"model: {where}.output_activations of {path} is not supported (only null)")
    return "w8a8"


def _check_args(args: dict[str, Any] | None, expected: dict[str, Any], where: str, path: str) -> None:
    """The quantization arguments match the engine's W8A8 on every field it depends on."""
    if args is None:
        raise ValueError(f"model: {where} of {path} is missing (W8A8 quantizes weights and activations)")
    for key, value in expected.items():
        if args.get(key) != value:
            raise ValueError(
                f"model: {where}.{key} {args.get(key)!r} of {path} is not supported (W8A8 needs {value!r})"
            )
