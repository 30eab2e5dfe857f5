"""/v1/pins: system prompts whose KV stays resident, so that every chat starting with one skips
its prefill. Under /v1, so a server started with --api-key requires the key here too."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from firsttoken.engine import EngineClient, InvalidInputError
from firsttoken.outputs import PinnedPrefix
from firsttoken.server.errors import APIError


class PinRequest(BaseModel):
    """POST /v1/pins: a system prompt whose KV the server should keep resident."""

    model_config = ConfigDict(strict=True, extra="forbid")

    system_prompt: str = Field(
        min_length=1,
        description="the content of the conversations' first (system) message; its chat-template "
        "rendering is computed once and its full KV blocks stay cached until unpinned",
    )


class Pin(BaseModel):
    """A pinned system prompt."""

    id: str = Field(description="named by the prompt's tokens: pinning the same prompt again gives it")
    object: Literal["pin"] = "pin"
    num_tokens: int = Field(description="prompt tokens kept resident (whole KV blocks)")


class PinList(BaseModel):
    """GET /v1/pins."""

    object: Literal["list"] = "list"
    data: list[Pin]


class PinDeleted(BaseModel):
    """DELETE /v1/pins/{pin_id}."""

    id: str
    object: Literal["pin"] = "pin"
    deleted: Literal[True] = True


async def pin_system_prompt(engine: EngineClient, body: PinRequest) -> Pin:
    """Returns once the prompt's KV is computed and pinned."""
    if not engine.can_pin:
        raise APIError(
            409,
            "system_prompt: cannot be pinned: this server runs without a prompt cache (--no-prompt-cache)",
            param="system_prompt",
            code="prompt_cache_disabled",
        )
    return _pin(await engine.pin_system_prompt(body.system_prompt))


def list_pins(engine: EngineClient) -> PinList:
    return PinList(data=[_pin(pinned) for pinned in engine.pinned_prefixes()])


async def unpin(engine: EngineClient, pin_id: str) -> PinDeleted:
    try:
        await engine.unpin_prefix(pin_id)
    except InvalidInputError as error:
        raise APIError(404, str(error), param="pin_id", code="pin_not_found") from error
    return PinDeleted(id=pin_id)


def _pin(pinned: PinnedPrefix) -> Pin:
    return Pin(id=pinned.pin_id, num_tokens=pinned.num_tokens)
