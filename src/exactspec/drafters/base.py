"""The drafter contract: whatever proposes a round's tokens, with the distribution q it drew them from.

The engine talks to a drafter only through `Drafter` below, and `exactspec.drafters.make_drafter`
is the one place that turns a spec into a drafter. A new drafter is a new class with these members; the engine
does not change.

`Proposal.q` is None for a point-mass draft (a deterministic proposal): the verifier then uses
the point-mass rule, which is exact for any deterministic proposal, padding included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exactspec.models import usable_vocab
from exactspec.sampling import SamplingConfig


IN_STEP = 2  # committed tokens per row a draft model feeds in a round in step: last draft, next token


def lag(pending_per_row) -> int:
    """The tokens beyond IN_STEP per row that a draft model's next proposal must feed."""
    return sum(max(0, int(n) - IN_STEP) for n in pending_per_row)


@dataclass
class Proposal:
    """tokens: LongTensor[B, γ'] with γ' ≤ γ; q: [B, γ', V] the distributions they were sampled
    from, or None for a point-mass draft. lengths (optional): how many of its γ' tokens each row
    proposed itself, the rest padding to the longest row; per-row decoding verifies only those,
    so a row's block does not depend on the other rows. forced (optional): how many of each row's
    first drafts its grammar forces (`GrammarDrafter`), verified on top of the row's γ."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    lengths: list[int] | None = None
    forced: list[int] | None = None


class Drafter:
    """What the engine needs from a drafter working on B rows; every drafter subclasses it.

    Counters (read after each round): `calls` and `tokens_fed` of the draft's own model (0 for a
    drafter without one), `padding_fed` (padding slots it ran), `catch_up` (the seconds and passes
    of the last proposal's catching up, (0.0, 0) if none). Methods, in the order the engine
    calls them:
    - `bind(target, total_tokens) -> V`: check that it can serve this target for sequences of
      total_tokens (same vocabulary, enough context); return the vocabulary V that p and q share;
    - `start(input_ids[B, L], valid[B, L], vocab_size)`: once, with the left-padded prompts;
    - `next_source() -> str`: before each round, which way it will draft ("model", "ngram",
      "none", ...), decided from the past only; the γ controller keeps statistics per source;
    - `lag() -> int`: the committed tokens its next proposal must feed beyond the IN_STEP per row
      of a round in step (the prompt, or rounds it sat out), over all rows; the γ controller
      prices that catch-up against the tokens left to generate (0: no cache of its own);
    - `free() -> int`: how many of every row's next drafts are kept for certain (a grammar
      round's forced tokens); γ is then the tail after them;
    - `propose(gamma, sampling, generator) -> Proposal`: each round, up to γ tokens per row;
    - `commit(num_accepted[B], next_tokens[B])`: row b kept its first num_accepted[b] drafts,
      then emitted next_tokens[b] (a correction or the bonus);
    - `evidence() -> {source: [(hits, misses) per row]}`: its scores of itself since the last
      call, from committed tokens only ({}: it does not score itself);
    - `select(rows)`: keep only the rows still generating;
    - `join(input_ids[n, L], valid[n, L])`, for continuous batching (`Decoder.join`): add rows at a
      round boundary whose last prompt token is their last committed token.
    """

    name: str = "drafter"
    calls: int = 0
    tokens_fed: int = 0
    padding_fed: int = 0
    catch_up: tuple[float, int] = (0.0, 0)

    def bind(self, target, total_tokens: int) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define bind")

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define start")

    def next_source(self) -> str:
        raise NotImplementedError(f"{type(self).__name__} must define next_source")

    def lag(self) -> int:
        return 0

    def free(self) -> int:
        return 0

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError(f"{type(self).__name__} must define propose")

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define commit")

    def evidence(self) -> dict[str, list[tuple[int, int]]]:
        return {}

    def prompt_lookup(self):
        """The prompt lookup (`NGramDrafter`) this drafter drafts with in some rounds, if any:
        a grammar's drafter extends its matches through forced tokens (`GrammarDrafter`)."""
        return None

    def select(self, rows: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define select")

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        raise ValueError(f"drafter {self.name!r} cannot take rows joining a batch")


class NoDraft(Drafter):
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
