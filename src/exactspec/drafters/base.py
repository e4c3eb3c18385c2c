"""The drafter contract: whatever proposes a round's tokens, with the distribution q it drew them from.

The engine talks to a drafter only through `Drafter` below, and `exactspec.drafters.make_drafter`
is the one place that turns a spec into a drafter. A new drafter is a new class with these members; the engine
does not change.

`Proposal.q` is None for a point-mass draft (a deterministic proposal): the verifier then uses
the point-mass rule, which is exact for any deterministic proposal, padding included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from exactspec.models import usable_vocab
from exactspec.sampling import SamplingConfig


IN_STEP = 2  # committed tokens per row a draft model feeds in a round in step: last draft, next token


def lag(pending_per_row) -> int:
    """The tokens beyond IN_STEP per row that a draft model's next proposal must feed."""
    return sum(max(0, int(n) - IN_STEP) for n in pending_per_row)


def drafter_lag(drafter) -> int:
    """A drafter's `lag()`, 0 for drafters without a cache of their own."""
    return drafter.lag() if hasattr(drafter, "lag") else 0


def drafter_free(drafter) -> int:
    """A drafter's `free()`: how many of every row's next drafts are kept for certain (a grammar
    round's forced tokens); 0 for drafters that have none."""
    return drafter.free() if hasattr(drafter, "free") else 0


def drafter_evidence(drafter) -> dict[str, list[tuple[int, int]]]:
    """A drafter's `evidence()` (source → each row's hits and misses since the last call, from
    committed tokens only), {} for drafters that do not score themselves."""
    return drafter.evidence() if hasattr(drafter, "evidence") else {}


@dataclass
class Proposal:
    """tokens: LongTensor[B, γ'] with γ' ≤ γ; q: [B, γ', V] the distributions they were sampled
    from, or None for a point-mass draft. lengths (optional): how many of its γ' tokens each row
    proposed itself, the rest padding to the longest row; per-row decoding verifies only those,
    so a row's block does not depend on the other rows."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    lengths: list[int] | None = None


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter working on B rows.

    Counters (read after each round): `calls` and `tokens_fed` of the draft's own model (0 for a
    drafter without one), `padding_fed` (padding slots it ran). Methods, in the order the engine
    calls them:
    - `bind(target, total_tokens) -> V`: check that it can serve this target for sequences of
      total_tokens (same vocabulary, enough context); return the vocabulary V that p and q share;
    - `start(input_ids[B, L], valid[B, L], vocab_size)`: once, with the left-padded prompts;
    - `next_source() -> str`: before each round, which way it will draft ("model", "ngram",
      "none", ...), decided from the past only; the γ controller keeps statistics per source;
    - `propose(gamma, sampling, generator) -> Proposal`: each round, up to γ tokens per row;
    - `commit(num_accepted[B], next_tokens[B])`: row b kept its first num_accepted[b] drafts,
      then emitted next_tokens[b] (a correction or the bonus);
    - `select(rows)`: keep only the rows still generating.
    Optional, for continuous batching (`Decoder.join`): `join(input_ids[n, L], valid[n, L])` adds
    rows at a round boundary whose last prompt token is their last committed token. Optional, for
    a draft model with its own cache: `lag() -> int`, the committed tokens its next proposal must
    feed beyond the IN_STEP per row of a round in step (the prompt, or rounds it sat out), over
    all rows; the γ controller prices that catch-up against the tokens left to generate.
    """

    name: str
    calls: int
    tokens_fed: int
    padding_fed: int

    def bind(self, target, total_tokens: int) -> int: ...

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None: ...

    def next_source(self) -> str: ...

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal: ...

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None: ...

    def select(self, rows: torch.Tensor) -> None: ...


class NoDraft:
    """Plain decoding as the γ = 0 case of a round: nothing proposed, the bonus drawn from p."""

    name = "none"
    calls = tokens_fed = padding_fed = 0

    def bind(self, target, total_tokens: int) -> int:
        return usable_vocab(target)

    def start(self, input_ids, valid, vocab_size):
        self.batch = input_ids.size(0)

    def next_source(self) -> str:
        return "none"

    def propose(self, gamma, sampling, generator) -> Proposal:
        return Proposal(torch.empty(self.batch, 0, dtype=torch.long), None)

    def commit(self, num_accepted, next_tokens):
        pass

    def select(self, rows):
        self.batch = rows.numel()

    def join(self, input_ids, valid):
        self.batch += input_ids.size(0)
