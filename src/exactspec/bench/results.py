"""What one timed generation returns, for every runner (exactspec, Transformers, llama.cpp)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunResult:
    """One timed generation."""

    tokens: list[int]
    wall_seconds: float
    time_to_first_token: float | None
    stats: object | None = None  # DecodeStats for exactspec methods
    rounds_by_source: dict | None = None  # exactspec methods: rounds per source ("ngram", ...)
    first_tokens: int | None = None  # how many tokens the first emission (at time_to_first_token) held
    peer_stats: dict | None = None  # llama-server rows: its drafted_tokens and accepted_drafts
    kept_by_source: dict | None = None  # exactspec methods: drafts kept per source ("grammar", ...)
    constraint_seconds: float = 0.0  # exactspec methods: time in the grammar's matchers
