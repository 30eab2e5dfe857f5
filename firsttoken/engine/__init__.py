"""The step loop, the offline LLM API, the asyncio front end and output processing.

Front ends (the server, the CLI, benchmarks, the Ray Serve deployment) use only what this
module exports.
"""

from firsttoken.engine.async_engine import AsyncEngine, RequestObserver, RequestStream
from firsttoken.engine.client import DeltaStream, EngineClient
from firsttoken.engine.llm import LLM
from firsttoken.engine.prompt_encoder import PromptEncoder, TokenizedPrompt
from firsttoken.errors import EngineDeadError, InvalidInputError, QueueFullError, SloUnattainableError
from firsttoken.tokenizer import CHAT_ROLES, Tokenizer

__all__ = [
    "CHAT_ROLES",
    "AsyncEngine",
    "DeltaStream",
    "EngineClient",
    "EngineDeadError",
    "InvalidInputError",
    "LLM",
    "PromptEncoder",
    "QueueFullError",
    "RequestObserver",
    "RequestStream",
    "SloUnattainableError",
    "TokenizedPrompt",
    "Tokenizer",
]
