"""Prompt texts shared by the parity and equivalence tests."""

from __future__ import annotations

_STORY = (
    "In the valley below the old observatory, the river changed its course every spring. "
    "The villagers kept a ledger of each flood: the date, the height of the water at the mill, "
    "and the names of the families who moved their animals to the high pasture. "
    "Over two hundred years the ledger grew to eleven volumes, and the astronomer's daughter, "
    "who had learned to read from it, noticed that the floods followed the comet's return. "
)


def long_prompt(num_repeats: int = 18) -> str:
    """Varied prose in numbered sections of ~94 tokens each: ~1700 tokens at the default 18."""
    sections = [f"Section {index}: {_STORY}" for index in range(1, num_repeats + 1)]
    return "\n".join(sections) + "\nSummarize the pattern the daughter found:"


SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "La tour Eiffel a été construite en",
    "東京は日本の首都です。東京の人口は",
    "Счастливые семьи все похожи друг на друга,",
    "Q: What is 17 * 23?\nA:",
]

CHAT_CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Give me three tips for learning to play the violin."},
]
