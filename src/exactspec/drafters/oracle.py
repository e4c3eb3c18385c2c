"""The oracle draft: a known continuation of each prompt (the bench's: the target's own greedy
tokens), proposed position by position at no model cost.

It shows what speculation can give at best through the real engine: at temperature 0, with the
target's greedy continuation as reference, every draft is kept, so each round emits γ + 1 tokens
for one target pass over γ + 1 tokens. It is a point-mass draft (q = None), exact by the
point-mass rule for any reference. A row whose text leaves the reference (a sampled token, a
near-tie broken the other way) drafts no more, so what it emits follows p with plain steps.
"""
from __future__ import annotations

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.models import usable_vocab
from exactspec.sampling import SamplingConfig

ORACLE = "oracle"


class OracleDrafter(Drafter):
    """Proposes, for a row whose prompt is a key of `references` (prompt token ids → the tokens
    that follow it), the reference's tokens from the row's own position on: after n tokens
    committed, reference[n : n + γ], while those n tokens are the reference's first n. A row whose
    committed tokens have left its reference (a sampled token, or a near-tie that a pass of
    another size breaks the other way), or that is past its end, proposes nothing: drafts aligned
    to a text the row no longer follows would all be rejected, each costing a pass. A shorter row
    is padded by repeating its last proposal (or last token), as `NGramDrafter` does: any
    deterministic proposal is exact."""

    name = ORACLE
    calls = tokens_fed = padding_fed = 0

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        if not references:
            raise ValueError("OracleDrafter needs at least one reference continuation")
        self.references = {tuple(map(int, prompt)): [int(t) for t in tokens]
                           for prompt, tokens in references.items()}
        # per row: (its reference, its last prompt token then the tokens it committed)
        self.rows: list[tuple[list[int], list[int]]] = []

    def bind(self, target, total_tokens: int) -> int:
        return usable_vocab(target)  # it proposes the target's own token ids

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.rows = []
        self.join(input_ids, valid)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        for ids, ok in zip(input_ids, valid):
            prompt = tuple(ids[ok].tolist())
            if prompt not in self.references:
                raise ValueError(f"OracleDrafter has no reference continuation for this prompt "
                                 f"({len(prompt)} tokens, ending {list(prompt[-5:])})")
            self.rows.append((self.references[prompt], [prompt[-1]]))

    def next_source(self) -> str:
        return ORACLE

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        found = [_ahead(reference, done[1:], gamma) for reference, done in self.rows]
        width = max(len(f) for f in found)
        padded = [f + [(f or done)[-1]] * (width - len(f)) for f, (_, done) in zip(found, self.rows)]
        tokens = torch.tensor(padded, dtype=torch.long).view(len(padded), width)  # [B, γ']
        self.drafts = tokens
        return Proposal(tokens, None, [len(f) for f in found])

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        for (_, done), kept, n, nxt in zip(self.rows, self.drafts.tolist(), num_accepted.tolist(),
                                           next_tokens.tolist()):
            done.extend(kept[:n] + [nxt])

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]


def _ahead(reference: list[int], committed: list[int], gamma: int) -> list[int]:
    """The reference's next γ tokens after `committed`, if it is the reference's beginning."""
    n = len(committed)
    return reference[n: n + gamma] if reference[:n] == committed else []
