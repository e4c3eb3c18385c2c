"""Drafters: whatever proposes the γ tokens of a round, with the distribution q it drew them from.

A drafter has two methods:
- `start(input_ids, vocab_size)` once per generation, with the prompt;
- `propose(sequence, gamma, sampling, generator) -> Proposal` each round, with the committed
  sequence so far (prompt and output). It may propose fewer than γ tokens (even none).
`Proposal.q` is None for a point-mass draft (a deterministic proposal): the sampler then uses
the point-mass rule, which is exact too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exactspec.kvmodel import CachedModel, unwrap_model
from exactspec.sampling import probs_from_logits, sample


@dataclass(frozen=True)
class SamplingConfig:
    """The decoding settings that make both p and q (rule 1: the same processing for both)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)


@dataclass
class Proposal:
    """tokens: LongTensor[B, γ'] with γ' ≤ γ; q: [B, γ', V] the distributions they were sampled
    from, or None for a point-mass draft."""

    tokens: torch.Tensor
    q: torch.Tensor | None


class ModelDrafter:
    """A draft language model with its own KV cache.

    Drafts are sampled from q (never the argmax while q is a softmax: that would break
    exactness); at temperature 0, q is one-hot and sampling is the argmax. Each round the cache
    is cut back to the longest prefix it shares with the committed sequence and the missing tokens
    (the correction, or the last draft and the bonus when all γ were kept) are fed first.
    """

    def __init__(self, model):
        self.model, self.tokenizer, self.name = unwrap_model(model)
        self.lm: CachedModel | None = None
        self._cached_ids = torch.empty(0, dtype=torch.long)

    @property
    def calls(self) -> int:
        return self.lm.calls if self.lm else 0

    @property
    def tokens_fed(self) -> int:
        return self.lm.tokens_fed if self.lm else 0

    def start(self, input_ids: torch.Tensor, vocab_size: int) -> None:
        self.lm = CachedModel(self.model, self.name, vocab_size)
        self._cached_ids = input_ids.new_empty(0)

    def _catch_up(self, sequence: torch.Tensor) -> torch.Tensor:
        """Crop the cache to the prefix it shares with sequence[1, L], feed the rest (at least the
        last token), and return the logits after the last token. [1, V]"""
        seq = sequence[0]  # [L]
        shared = min(self.lm.length, seq.numel() - 1)
        agree = (self._cached_ids[:shared] == seq[:shared]).long().cumprod(0).sum().item()
        self.lm.crop(agree)
        logits = self.lm.feed(sequence[:, agree:])[:, -1]  # [1, V]
        self._cached_ids = seq.clone()
        return logits

    def propose(self, sequence: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            return Proposal(sequence.new_empty(1, 0), None)
        logits = self._catch_up(sequence)  # [1, V]
        tokens, qs = [], []
        for i in range(gamma):
            q_i = sampling.probs(logits)  # [1, V]
            x_i = sample(q_i, generator)  # [1]
            tokens.append(x_i)
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self.lm.feed(x_i.view(1, 1))[:, -1]  # [1, V]
                self._cached_ids = torch.cat([self._cached_ids, x_i])
        return Proposal(torch.stack(tokens, dim=1), torch.stack(qs, dim=1))  # [1, γ], [1, γ, V]


class NGramDrafter:
    """Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from max_ngram down to min_ngram). Zero model cost; a point-mass
    draft (q = None), exact by the point-mass rule."""

    name = "ngram"
    calls = 0
    tokens_fed = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, input_ids: torch.Tensor, vocab_size: int) -> None:
        pass

    def lookup(self, seq: torch.Tensor, gamma: int) -> torch.Tensor:
        """The continuation of the most recent earlier match of the longest suffix found. [γ']"""
        for n in range(min(self.max_ngram, seq.numel() - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [L-n, n], every earlier n-gram
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()  # start positions
            if hits.numel():
                start = hits[-1].item() + n
                return seq[start: start + gamma]
        return seq[:0]

    def propose(self, sequence: torch.Tensor, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        tokens = self.lookup(sequence[0], gamma)  # [γ']
        return Proposal(tokens.view(1, -1), None)


def as_drafter(draft):
    """A drafter from a drafter, a LoadedModel or a Hugging Face model."""
    if hasattr(draft, "propose") and hasattr(draft, "start"):
        return draft
    return ModelDrafter(draft)
