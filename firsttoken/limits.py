"""Bounds that both a start-up option and a request field may hit, in one place for every layer."""

from __future__ import annotations

# The longest wait any option or request may set, a day: past it a bound is no bound, and an
# infinite one overflows the clocks and timers it is handed to.
MAX_SECONDS = 86_400
MAX_MILLISECONDS = MAX_SECONDS * 1000
