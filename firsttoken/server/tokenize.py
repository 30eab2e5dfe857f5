"""POST /tokenize and /detokenize (vLLM's shapes): the server's own tokenizer, for clients that
count tokens against the context or read ids back as text."""

from __future__ import annotations

from firsttoken.engine import EngineClient, InvalidInputError
from firsttoken.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from firsttoken.server.request_checks import RequestChecks


async def tokenize(engine: EngineClient, checks: RequestChecks, body: TokenizeRequest) -> TokenizeResponse:
    """The token ids generation would see: a prompt as /v1/completions encodes it, messages as
    /v1/chat/completions renders and encodes them."""
    checks.check_fields(body)
    messages = None
    if body.messages is not None:
        messages = [{"role": message.role, "content": message.text()} for message in body.messages]
        checks.check_tokenizable_bytes("messages", [message["content"] for message in messages])
    else:
        checks.check_tokenizable_bytes("prompt", [body.prompt or ""])
    tokenized = await engine.tokenize(
        body.prompt,
        messages=messages,
        add_generation_prompt=body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
    )
    token_ids = tokenized.token_ids
    token_strs = None
    if body.return_token_strs:
        token_strs = [engine.tokenizer.id_to_token(token_id) or "" for token_id in token_ids]
    return TokenizeResponse(
        count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids, token_strs=token_strs
    )


async def detokenize(
    engine: EngineClient, checks: RequestChecks, body: DetokenizeRequest
) -> DetokenizeResponse:
    checks.check_fields(body)
    try:
        text = await engine.detokenize(body.tokens)
    except InvalidInputError as error:
        raise InvalidInputError("tokens", str(error).removeprefix(f"{error.field}: ")) from error
    return DetokenizeResponse(prompt=text)
