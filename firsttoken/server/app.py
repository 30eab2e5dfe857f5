"""create_app: the OpenAI-compatible FastAPI app over one engine client: an AsyncEngine in this
process, or engine replicas behind a router (firsttoken.deploy)."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from firsttoken import __version__
from firsttoken.engine import EngineClient
from firsttoken.metrics.prometheus import PrometheusMetrics
from firsttoken.server.auth import ApiKeyGate
from firsttoken.server.body_limit import BodySizeLimit
from firsttoken.server.chat import create_chat_completion
from firsttoken.server.completions import create_completion
from firsttoken.server.server_config import ServerConfig
from firsttoken.server.errors import APIError, install_error_handlers
from firsttoken.server.json_body import checked_json_route
from firsttoken.server.pins import Pin, PinDeleted, PinList, PinRequest, list_pins, pin_system_prompt, unpin
from firsttoken.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from firsttoken.server.request_checks import RequestChecks
from firsttoken.server.streaming import respond_unless_disconnected
from firsttoken.server.tokenize import detokenize, tokenize
from firsttoken.server.web_ui import add_web_ui

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request (the message names the field)"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "unknown model or pin"},
    409: {"model": ErrorResponse, "description": "pins need the prompt cache; this server runs without"},
    413: {"model": ErrorResponse, "description": "request body over --max-request-bytes"},
    429: {"model": ErrorResponse, "description": "waiting queue full; retry after Retry-After seconds"},
    503: {"model": ErrorResponse, "description": "the engine is not running"},
}
_STREAMED = {
    "content": {"text/event-stream": {}},
    "description": "JSON, or server-sent events when stream is true",
}


def create_app(
    engine: EngineClient, config: ServerConfig, metrics: PrometheusMetrics | None = None
) -> FastAPI:
    """The app serving `engine`; its lifespan starts and stops the engine.

    `metrics`: what /metrics shows and requests are observed into (default: this engine's own
    stats and request metrics; replicas behind a router bring theirs, labelled by replica).
    """
    metrics = metrics or PrometheusMetrics(config.model_name, engine.stats)
    engine.add_observer(metrics)
    created = int(time.time())
    checks = RequestChecks(engine, config.strict_fields)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(
        # /tokenize/ is not /tokenize: a 307 would make a client send its body twice.
        redirect_slashes=False,
        title="firsttoken",
        version=__version__,
        summary="OpenAI-compatible server built for the shortest time to first token",
        lifespan=lifespan,
    )
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    # Middleware added later runs earlier: the key is checked before the body's size is known.
    if config.api_key is not None:
        app.add_middleware(ApiKeyGate, api_key=config.api_key)
    if config.allowed_origins:
        # Before the key gate: a browser's preflight carries no key, and a 401 or 413 must carry
        # CORS headers for the page to read it.
        origins = list(config.allowed_origins)
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    install_error_handlers(app, config.retry_after_s)

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")

    v1 = APIRouter(
        prefix="/v1",
        responses=_ERROR_RESPONSES,
        route_class=checked_json_route(config.json_limits),
    )

    @v1.post("/completions", response_model=CompletionResponse, responses={200: _STREAMED})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond_unless_disconnected(request, create_completion(engine, config, checks, body))

    @v1.post("/chat/completions", response_model=ChatCompletionResponse, responses={200: _STREAMED})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await respond_unless_disconnected(
            request, create_chat_completion(engine, config, checks, body)
        )

    def model_card(name: str) -> ModelCard:
        compute = engine.compute
        return ModelCard(
            id=name,
            created=created,
            max_model_len=engine.max_model_len,
            dtype=compute.dtype,
            batch_invariant=compute.batch_invariant,
            start_up_choices=list(compute.start_up_choices),
        )

    @v1.get("/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in config.served_model_names])

    # `:path`: a served name may hold "/" (an organisation/model id).
    @v1.get("/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card(model_id)

    @v1.post("/pins", response_model=Pin)
    async def pins_create(body: PinRequest) -> Pin:
        return await pin_system_prompt(engine, body)

    @v1.get("/pins", response_model=PinList)
    async def pins_list() -> PinList:
        return list_pins(engine)

    @v1.delete("/pins/{pin_id}", response_model=PinDeleted)
    async def pins_delete(pin_id: str) -> PinDeleted:
        return await unpin(engine, pin_id)

    app.include_router(v1)
    if config.web_ui:
        add_web_ui(app)

    tokenizer_routes = APIRouter(
        responses=_ERROR_RESPONSES, route_class=checked_json_route(config.json_limits)
    )

    @tokenizer_routes.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        return await tokenize(engine, checks, body)

    @tokenizer_routes.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        return await detokenize(engine, checks, body)

    app.include_router(tokenizer_routes)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "the engine is not running", "server_error", code="engine_unavailable")
        return Response(status_code=200)

    # Load balancers probe with HEAD; one operation in the schema is enough.
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
