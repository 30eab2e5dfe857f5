"""`firsttoken serve`: load a model and serve the OpenAI-compatible API."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from firsttoken.engine_args import (
    add_engine_args,
    add_model_arg,
    add_pin_system_prompt_arg,
    engine_kwargs,
    read_system_prompt,
)
from firsttoken.server.server_config import JSONLimits, ServerConfig, default_model_name

_DEFAULTS = ServerConfig()


def register_serve_verb(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to the `firsttoken` command's verbs: every LLM(...) option is a flag."""
    serve = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_model_arg(serve)
    add_pin_system_prompt_arg(serve)
    group = serve.add_argument_group("server")
    group.add_argument(
        "--host", default=_DEFAULTS.host, help=f"address to listen on (default: {_DEFAULTS.host})"
    )
    group.add_argument(
        "--port", type=int, default=_DEFAULTS.port, help=f"TCP port (default: {_DEFAULTS.port})"
    )
    group.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model name(s) clients use; the first is reported (default: the model file's name)",
    )
    group.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="requests allowed to wait; more get 429 (the engine's max_waiting_requests; default: no limit)",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=_DEFAULTS.max_request_bytes,
        help=f"larger request bodies get 413 (default: {_DEFAULTS.max_request_bytes})",
    )
    group.add_argument(
        "--max-json-values",
        type=int,
        default=_DEFAULTS.json_limits.max_values,
        help="JSON values (numbers, strings, arrays, objects) a request body may hold; more get 400 "
        f"before the body is parsed (default: {_DEFAULTS.json_limits.max_values})",
    )
    group.add_argument(
        "--max-choices",
        type=int,
        default=_DEFAULTS.max_choices_per_request,
        help="choices (prompts x n) one request may ask for; more get 400 "
        f"(default: {_DEFAULTS.max_choices_per_request})",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=float,
        default=_DEFAULTS.shutdown_timeout_s,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long in-flight requests may finish before they are ended "
        f"with an error; a second signal ends them at once (default: {_DEFAULTS.shutdown_timeout_s:g})",
    )
    group.add_argument(
        "--stream-keepalive",
        type=float,
        default=_DEFAULTS.stream_keepalive_s,
        metavar="SECONDS",
        help="a stream sends an SSE comment (': queued') this often until its first chunk, so that "
        "clients with a read timeout keep waiting while it queues "
        f"(default: {_DEFAULTS.stream_keepalive_s:g})",
    )
    group.add_argument(
        "--strict-fields",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.strict_fields,
        help="refuse request fields the API does not define with 400 (default: ignore them, naming "
        "them in one warning per request)",
    )
    group.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help='browser origins allowed to call the API, e.g. https://app.example.com, or "*" for any '
        "(CORS; default: none, no CORS headers)",
    )
    group.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request (default: off)",
    )
    group.add_argument(
        "--web-ui",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS.web_ui,
        help="serve the chat page, with live time-to-first-token figures, at / (default: on)",
    )
    add_engine_args(serve)
    serve.set_defaults(handler=run_serve)
    return serve


# A server writes its KV cache at start: no request pays the cache's first page faults.
_SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"prefault_kv_cache": True}


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM(...) keywords the command line set, over the server's own defaults;
    --max-queue is max_waiting_requests."""
    options = {**_SERVE_ENGINE_DEFAULTS, **engine_kwargs(args)}
    if args.max_queue is not None:
        options["max_waiting_requests"] = args.max_queue
    return options


def server_config(args: argparse.Namespace, model_path: str | None = None) -> ServerConfig:
    """The server's settings; without --served-model-name, the model file's name (no .gguf), or
    the default name while no model is loaded."""
    names = args.served_model_name or (
        [default_model_name(model_path)] if model_path else list(_DEFAULTS.served_model_names)
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(names),
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        json_limits=JSONLimits(max_values=args.max_json_values),
        max_choices_per_request=args.max_choices,
        shutdown_timeout_s=args.shutdown_timeout,
        stream_keepalive_s=args.stream_keepalive,
        strict_fields=args.strict_fields,
        allowed_origins=tuple(args.allowed_origins),
        access_log=args.access_log,
        web_ui=args.web_ui,
    )


def run_serve(args: argparse.Namespace) -> NoReturn:
    """Serve until a signal ends the server; the process ends with it (`end_process`), with
    status 130 after Ctrl-C."""
    from firsttoken.engine import AsyncEngine
    from firsttoken.server.app import create_app
    from firsttoken.server.http_server import ExitDeadline, build_server, end_process

    system_prompt = read_system_prompt(args)
    server_config(args)  # a bad server flag is refused before the model loads, not after
    engine = AsyncEngine.from_options(args.model, system_prompt=system_prompt, **engine_options(args))
    config = server_config(args, engine.model_path)
    server = build_server(create_app(engine, config), config, abort_in_flight=engine.shutdown)
    server.exit_deadline = ExitDeadline()  # this process is the server's: a signal's deadline ends it
    address = f"http://{config.host}:{config.port}"
    chat_page = f"; chat page at {address}/" if config.web_ui else ""
    # As `firsttoken generate` says it: which kernels run, at any log level.
    print(f"firsttoken: engine: {engine.inspect().description}", file=sys.stderr, flush=True)
    print(f"firsttoken: serving {config.model_name} on {address}{chat_page}", file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        # Ctrl-C, raised again once the shutdown is done, ends here too: going up through main
        # and sys.exit would run the interpreter's teardown (thread joins, freeing the model),
        # which the exit deadline cannot cut, as its timer thread stops once finalization
        # begins; a second Ctrl-C then took 1.09 s, not the 0.5 s the docs promise.
        end_process(130)
    end_process(1 if server.aborted_in_flight else 0)
