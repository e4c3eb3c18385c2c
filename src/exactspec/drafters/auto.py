"""The `auto` draft: per round, prompt lookup when the context offers a match worth drafting,
else the model draft (whose γ the controller may set to 0, a plain step)."""
from __future__ import annotations

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.drafters.model import ModelDrafter
from exactspec.drafters.ngram import NGramDrafter
from exactspec.sampling import SamplingConfig

MIN_MATCH = 2  # a lookup needs a match of at least this many tokens to be worth a round
MODEL_SOURCES = ("model", "none")  # the rounds the model proposes, if γ > 0


class AutoDrafter(Drafter):
    """Chooses, before each round and from the committed tokens only (the past-only rule), who
    drafts: `NGramDrafter` when some row's context repeats its last MIN_MATCH or more tokens,
    else the `ModelDrafter`. The one that sat a round out learns its tokens afterwards
    (`observe`); the model's cache catches up lazily, when it next drafts.

    With the γ controller a generation's first round is a plain step unless the lookup already
    matches, while the model has the prompt to catch up on (source "none", for which the
    controller chooses γ = 0): the first token shows whether the output starts by quoting the
    prompt, and then prompt lookup drafts and the model's prefill of the prompt is not paid for
    nothing. Waiting costs at most one token's worth of drafting, since the catch-up costs the
    same a round later. With a fixed γ the model drafts that round, as before any round without
    a lookup match (a seeded request then samples the same text alone or in a batch)."""

    name = "auto"

    def __init__(self, model: ModelDrafter, lookup: NGramDrafter | None = None,
                 min_match: int = MIN_MATCH):
        self.model, self.lookup = model, lookup or NGramDrafter()
        self.min_match, self.source, self.first = min_match, None, False

    calls = property(lambda self: self.model.calls)
    catch_up = property(lambda self: self.model.catch_up
                        if self.source in MODEL_SOURCES else (0.0, 0))
    tokens_fed = property(lambda self: self.model.tokens_fed)
    padding_fed = property(lambda self: self.model.padding_fed)

    def bind(self, target, total_tokens: int) -> int:
        return self.model.bind(target, total_tokens)

    def lag(self) -> int:
        """The model draft's catch-up if it drafts the next round (prompt lookup has none)."""
        return self.model.lag() if self.next_source() == "model" else 0

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.model.start(input_ids, valid, vocab_size)
        self.lookup.start(input_ids, valid, vocab_size)
        self.first = True

    def next_source(self) -> str:
        """The lookup's source ("ngram", ...), "model", or "none" (a plain step: the first round,
        see the class docstring), decided from the committed tokens; kept until the round
        commits."""
        if self.source is None:
            match = self.lookup.match_length()
            if match >= self.min_match:
                self.source = self.lookup.source(match)
            else:
                self.source = "none" if self.first and self.model.lag() else "model"
        return self.source

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        drafter = self.model if self.next_source() in MODEL_SOURCES else self.lookup
        return drafter.propose(gamma, sampling, generator)

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        drafted, idle = ((self.model, self.lookup) if self.source in MODEL_SOURCES
                         else (self.lookup, self.model))
        drafted.commit(num_accepted, next_tokens)
        idle.observe(drafted.drafts, num_accepted, next_tokens)
        self.source, self.first = None, False

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        """A round someone else drafted (the grammar draft's): both drafters learn its tokens."""
        self.model.observe(drafts, num_accepted, next_tokens)
        self.lookup.observe(drafts, num_accepted, next_tokens)
        self.source, self.first = None, False

    def prompt_lookup(self) -> NGramDrafter:
        return self.lookup

    def evidence(self) -> dict[str, list[tuple[int, int]]]:
        """The lookup's scores of itself against the committed tokens (`NGramDrafter.evidence`)."""
        return self.lookup.evidence()

    def select(self, rows: torch.Tensor) -> None:
        self.model.select(rows)
        self.lookup.select(rows)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """New rows (left-padded prompts [n, L]) join at a round boundary (continuous batching):
        both drafters take them, so either may propose the next round, chosen afresh. The model
        draft takes them lazily: its cache catches up only when it next drafts (often never)."""
        self.model.join(input_ids, valid, lazy=True)
        self.lookup.join(input_ids, valid)
        self.source = None
