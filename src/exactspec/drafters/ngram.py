"""Prompt lookup: a point-mass draft copied from earlier in the sequence, at zero model cost."""
from __future__ import annotations

import torch

from exactspec.drafters.base import Proposal
from exactspec.models import usable_vocab
from exactspec.sampling import SamplingConfig


class NGramDrafter:
    """Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the
    sequence's last n tokens (n from max_ngram down to min_ngram). Zero model cost; a point-mass
    draft (q = None), exact by the point-mass rule. A row with fewer than γ tokens to propose is
    padded by repeating its last proposal (or last token): any deterministic proposal is exact."""

    name = "ngram"
    calls = tokens_fed = padding_fed = 0

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def bind(self, target, total_tokens: int) -> int:
        return usable_vocab(target)  # it proposes tokens of the sequence itself

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
