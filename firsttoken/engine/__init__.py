"""The step loop, the offline LLM API, the asyncio front end and output processing.

Front ends (the server, the CLI, benchmarks) use only what this module exports.
"""

from firsttoken.engine.async_engine import AsyncEngine, RequestObserver, RequestStream, TokenizedPrompt
from firsttoken.engine.llm import LLM
from firsttoken.errors import EngineDeadError, InvalidInputError, QueueFullError
from firsttoken.tokenizer import CHAT_ROLES, Tokenizer

__all__ = [
    "CHAT_ROLES",
    "AsyncEngine",
    "EngineDeadError",
    "InvalidInputError",
    "LLM",
    "QueueFullError",
    "RequestObserver",
    "RequestStream",
    "TokenizedPrompt",
    "Tokenizer",
]
