"""Command-line flags for every engine option (generated from the config dataclasses), and the
flags of the verbs that load a model: which model, and which system prompt to pin."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any, Callable, Sequence

from firsttoken.config import SUBCONFIGS, flat_name
from firsttoken.errors import InvalidInputError

# Flags a verb defines itself (add_model_arg where it loads a model).
_NOT_FLAGS = {"model"}
# Engine options whose plain name a verb uses for something else (`--seed` seeds one request).
_CLI_RENAMES = {
    "seed": "engine_seed",
    "enable_prompt_cache": "prompt_cache",
    "enable_chunked_prefill": "chunked_prefill",
}


def _chunk_size(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"chunk size must be 'auto' or an integer, got {value!r}") from None


def _flag_type(field: dataclasses.Field) -> Any:
    if field.name == "chunk_size":
        return _chunk_size
    text = str(field.type)  # config.py uses postponed annotations: the type is its source text
    if "bool" in text:
        return bool
    if "float" in text:
        return float
    if "int" in text:
        return int
    return str


class _FromEnvironment(str):
    """The default of a flag that an environment variable sets: the variable's name. argparse
    converts a string default with the flag's type only when the flag is not given, and after
    --help is answered: so the variable is read only when it is used, and a bad value is a usage
    error like a bad flag's."""


def _checked_environment(choices: Sequence[str]) -> Callable[[str], str | None]:
    """The flag's type: a given value passes (argparse checks its choices); the variable, when
    set, must be one of them too. None then: the config's own default reads the variable, as
    it does for LLM(...), and a --config file's value is not overridden by it."""

    def convert(value: str) -> str | None:
        if not isinstance(value, _FromEnvironment):
            return value
        setting = os.environ.get(value)
        if setting is not None and setting not in choices:
            raise argparse.ArgumentTypeError(f"${value} is {setting!r}, not one of {', '.join(choices)}")
        return None

    return convert


def _shown_default(field: dataclasses.Field) -> str:
    """The help's default; a field with a default factory (one read from the environment) says
    what its default is in its own help, and the factory is not run to build a parser."""
    return "" if field.default is dataclasses.MISSING else f" (default: {field.default})"


def _dest(name: str) -> str:
    return "engine_option_" + name


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg}): {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {value!r}")
    return parsed


def engine_flag(name: str) -> str:
    """The command-line flag of the engine option `name` (a keyword of LLM(...))."""
    return "--" + _CLI_RENAMES.get(name, name).replace("_", "-")


def engine_flags(options: dict[str, Any]) -> list[str]:
    """The command line that sets these engine options (the inverse of `engine_kwargs`); None
    leaves an option at its default."""
    flags: list[str] = []
    for name, value in options.items():
        if value is None:
            continue
        if name == "speculative_config":
            flags += ["--speculative-config", json.dumps(value)]
        elif isinstance(value, bool):
            flags.append(engine_flag(name) if value else "--no-" + engine_flag(name).removeprefix("--"))
        else:
            flags += [engine_flag(name), str(value)]
    return flags


def read_config_file(path: str) -> dict[str, Any]:
    """The engine options of a JSON config file: one object of LLM(...) keywords, as `firsttoken
    tune` writes it. The engine names an unknown keyword when it starts."""
    try:
        with open(path, encoding="utf-8") as handle:
            options = json.load(handle)
    except OSError as error:
        raise InvalidInputError("config", f"cannot read {path} ({error.strerror})") from error
    except json.JSONDecodeError as error:
        raise InvalidInputError("config", f"{path} is not JSON ({error.msg}, line {error.lineno})") from error
    if not isinstance(options, dict):
        raise InvalidInputError("config", f"{path} must hold one JSON object of engine options")
    return options


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per engine config field, with the field's help text and default, and
    `--config FILE` (engine options from a JSON file; flags given beside it win)."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="engine options from a JSON object of LLM(...) keywords, such as `firsttoken tune` writes; "
        "flags given on the command line win",
    )
    for section, section_cls in SUBCONFIGS.items():
        group = parser.add_argument_group(section.replace("_", " "))
        for field in dataclasses.fields(section_cls):
            name = flat_name(section, field.name)
            if name in _NOT_FLAGS:
                continue
            flag = engine_flag(name)
            help_text = field.metadata.get("help", "") + _shown_default(field)
            kind = _flag_type(field)
            if kind is bool:
                group.add_argument(
                    flag,
                    dest=_dest(name),
                    action=argparse.BooleanOptionalAction,
                    default=None,
                    help=help_text,
                )
            elif "environment" in field.metadata:
                group.add_argument(
                    flag,
                    dest=_dest(name),
                    type=_checked_environment(field.metadata["choices"]),
                    default=_FromEnvironment(field.metadata["environment"]),
                    choices=field.metadata["choices"],
                    help=help_text,
                )
            else:
                group.add_argument(
                    flag,
                    dest=_dest(name),
                    type=kind,
                    default=None,
                    choices=field.metadata.get("choices"),
                    metavar=None if field.metadata.get("choices") else name.upper(),
                    help=help_text,
                )
    parser.add_argument_group("speculative config").add_argument(
        "--speculative-config",
        dest=_dest("speculative_config"),
        type=_json_object,
        default=None,
        metavar="JSON",
        help='the speculative options as one JSON object, as vLLM takes them: '
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' (the flags above override its fields)',
    )


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file, Hugging Face folder, or repo id (org/name[@revision]) in the local "
        "Hugging Face cache (default: embedded SmolLM2-135M-Instruct)",
    )


def add_pin_system_prompt_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pin-system-prompt",
        metavar="FILE",
        default=None,
        help="keep the KV of this system prompt (a text file) resident in the prompt cache; "
        "chats that start with it reuse it",
    )


def read_system_prompt(args: argparse.Namespace) -> str | None:
    """The text of the --pin-system-prompt file; None without the flag."""
    if not args.pin_system_prompt:
        return None
    try:
        with open(args.pin_system_prompt, encoding="utf-8") as handle:
            return handle.read()
    except OSError as error:
        raise InvalidInputError(
            "pin_system_prompt", f"cannot read {args.pin_system_prompt} ({error.strerror})"
        ) from error


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options the user set: the --config file's, then the flags given (unset ones
    keep config defaults)."""
    config_file = getattr(args, "config", None)
    options = read_config_file(config_file) if config_file else {}
    for section, section_cls in SUBCONFIGS.items():
        for field in dataclasses.fields(section_cls):
            name = flat_name(section, field.name)
            value = getattr(args, _dest(name), None)
            if name not in _NOT_FLAGS and value is not None:
                options[name] = value
    speculative = getattr(args, _dest("speculative_config"), None)
    if speculative is not None:
        options["speculative_config"] = speculative
    return options

