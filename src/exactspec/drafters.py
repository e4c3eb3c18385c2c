"""Drafters: whatever proposes the γ tokens of a round, with the distribution q it drew them from.

A drafter works on B rows and has three methods:
- `start(input_ids[B, L], valid[B, L], vocab_size)` once, with the left-padded prompts;
- `propose(gamma, sampling, generator) -> Proposal` each round: γ tokens per row;
- `commit(num_accepted[B], next_tokens[B])` after verification: row b kept its first
  num_accepted[b] drafts and then emitted next_tokens[b] (a correction or the bonus);
- `select(rows)` keeps only the rows still generating.
`Proposal.q` is None for a point-mass draft (a deterministic proposal): the sampler then uses
the point-mass rule, which is exact for any deterministic proposal, padding included.
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
    exactness); at temperature 0, q is one-hot and sampling is the argmax. The cache holds each
    row's committed tokens except the `pending` ones: the last committed token, and after a round
    that kept every draft also the last draft (it was sampled but never fed). A round feeds the
    pending tokens (rows with fewer get a padding hole), then one token per further draft.
    """

    def __init__(self, model):
        self.model, self.tokenizer, self.name = unwrap_model(model)
        self.lm: CachedModel | None = None

    @property
    def calls(self) -> int:
        return self.lm.calls if self.lm else 0

    @property
    def tokens_fed(self) -> int:
        return self.lm.tokens_fed if self.lm else 0

    @property
    def padding_fed(self) -> int:
        return self.lm.padding_fed if self.lm else 0

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.lm = CachedModel(self.model, self.name, vocab_size, input_ids.size(0))
        self.next_logits = self.lm.prefill(input_ids, valid)  # [B, V], used while nothing is pending
        self.pending = input_ids[:, :0]  # [B, 0]
        self.pending_valid = valid[:, :0]  # [B, 0]

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        batch = self.pending.size(0)
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            self.drafts = self.pending.new_empty(batch, 0)
            return Proposal(self.drafts, None)
        if self.pending.size(1):
            logits = self.lm.feed(self.pending, self.pending_valid)[:, -1]  # [B, V]
        else:
            logits = self.next_logits  # [B, V], straight after the prefill
        tokens, qs = [], []
        for i in range(gamma):
            q_i = sampling.probs(logits)  # [B, V]
            x_i = sample(q_i, generator)  # [B]
            tokens.append(x_i)
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self.lm.feed(x_i.unsqueeze(1))[:, -1]  # [B, V]
        self.drafts = torch.stack(tokens, dim=1)  # [B, γ]
        return Proposal(self.drafts, torch.stack(qs, dim=1))  # [B, γ], [B, γ, V]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        gamma = self.drafts.size(1)
        if gamma == 0:  # nothing was fed this round: the next token joins the pending ones
            self.pending = torch.cat([self.pending, next_tokens.unsqueeze(1)], dim=1)
            self.pending_valid = torch.cat([self.pending_valid, torch.ones_like(next_tokens.unsqueeze(1),
                                                                                dtype=torch.bool)], dim=1)
            return
        # Fed drafts x_1..x_{γ-1}; those after the kept ones become holes.
        self.lm.discard_last((gamma - 1 - num_accepted).clamp(min=0))
        all_kept = (num_accepted == gamma).unsqueeze(1)  # [B, 1]
        last_draft = torch.where(all_kept, self.drafts[:, -1:], next_tokens.unsqueeze(1))
        self.pending = torch.cat([last_draft, next_tokens.unsqueeze(1)], dim=1)  # [B, 2]
        self.pending_valid = torch.cat([all_kept, torch.ones_like(all_kept)], dim=1)  # [B, 2]
        if not all_kept.any():
            self.pending, self.pending_valid = self.pending[:, 1:], self.pending_valid[:, 1:]

    def select(self, rows: torch.Tensor) -> None:
        self.lm.select(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]


class NGramDrafter:
    """Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from max_ngram down to min_ngram). Zero model cost; a point-mass
    draft (q = None), exact by the point-mass rule. A row with fewer than γ tokens to propose is
    padded by repeating its last proposal (or last token): any deterministic proposal is exact."""

    name = "ngram"
    calls = 0
    tokens_fed = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.rows = [ids[ok] for ids, ok in zip(input_ids, valid)]  # B × [L_b]

    def lookup(self, seq: torch.Tensor, gamma: int) -> torch.Tensor:
        """The continuation of the most recent earlier match of the longest suffix found. [γ']"""
        for n in range(min(self.max_ngram, seq.numel() - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [L-n, n], every earlier n-gram
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten()  # start positions
            if hits.numel():
                start = hits[-1].item() + n
                return seq[start: start + gamma]
        return seq[:0]

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        found = [self.lookup(seq, gamma) for seq in self.rows]
        width = max(len(f) for f in found)
        padded = [torch.cat([f, (f if len(f) else seq)[-1:].expand(width - len(f))])
                  for f, seq in zip(found, self.rows)]
        self.drafts = torch.stack(padded)  # [B, γ']
        return Proposal(self.drafts, None)

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.rows = [torch.cat([seq, drafts[:n], nxt.view(1)]) for seq, drafts, n, nxt in
                     zip(self.rows, self.drafts, num_accepted.tolist(), next_tokens)]

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]


def as_drafter(draft):
    """A drafter from a drafter, a LoadedModel or a Hugging Face model."""
    if hasattr(draft, "propose") and hasattr(draft, "start"):
        return draft
    return ModelDrafter(draft)
