"""The server's own counters over a benchmark run, read from its Prometheus `/metrics`: what
share of prompt tokens the prefix cache served and of proposed tokens speculation accepted.

Counters are read before and after the load; a server without our metrics (another engine)
gives None and the report leaves the line out.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

_COUNTERS = {
    "firsttoken:prefix_cache_queries": "prefix_cache_queries",
    "firsttoken:prefix_cache_hits": "prefix_cache_hits",
    "firsttoken:spec_decode_num_draft_tokens": "spec_draft_tokens",
    "firsttoken:spec_decode_num_accepted_tokens": "spec_accepted_tokens",
}


@dataclass(frozen=True)
class ServerCounters:
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    spec_draft_tokens: float = 0.0
    spec_accepted_tokens: float = 0.0

    def minus(self, earlier: ServerCounters) -> ServerCounters:
        return ServerCounters(
            self.prefix_cache_queries - earlier.prefix_cache_queries,
            self.prefix_cache_hits - earlier.prefix_cache_hits,
            self.spec_draft_tokens - earlier.spec_draft_tokens,
            self.spec_accepted_tokens - earlier.spec_accepted_tokens,
        )

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None


def parse_counters(text: str) -> ServerCounters | None:
    """Our counters summed over their labels; None when the text holds none of them."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        field = _COUNTERS.get(family.name)
        if field is None:
            continue
        totals[field] = sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    return ServerCounters(**totals) if totals else None


async def read_counters(client: httpx.AsyncClient) -> ServerCounters | None:
    try:
        response = await client.get("/metrics")
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    return parse_counters(response.text)


def format_counters(counters: ServerCounters) -> str:
    parts = []
    if counters.prefix_cache_hit_rate is not None:
        parts.append(
            f"prefix cache hit rate {counters.prefix_cache_hit_rate:.1%} of "
            f"{counters.prefix_cache_queries:.0f} "
            "prompt tokens"
        )
    if counters.spec_acceptance_rate is not None:
        parts.append(
            f"speculative acceptance {counters.spec_acceptance_rate:.1%} of {counters.spec_draft_tokens:.0f} "
            "proposed tokens"
        )
    return "server counters over the run: " + (
        "; ".join(parts) if parts else "no prompt-cache queries, no proposals"
    )
