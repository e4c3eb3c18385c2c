"""The oracle drafts: a known continuation of each prompt (the bench's: the target's own greedy
tokens), proposed position by position at no model cost; and prompt lookup told by it how much
of each proposal the target keeps (`LookupOracleDrafter`).

It shows what speculation can give at best through the real engine: at temperature 0, with the
target's greedy continuation as reference, every draft is kept, so each round emits γ + 1 tokens
for one target pass over γ + 1 tokens. It is a point-mass draft (q = None), exact by the
point-mass rule for any reference. A row whose text leaves the reference (a sampled token, a
near-tie broken the other way) drafts no more, so what it emits follows p with plain steps.
"""
from __future__ import annotations

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.drafters.ngram import NGramDrafter
from exactspec.models import usable_vocab
from exactspec.sampling import SamplingConfig

ORACLE = "oracle"
LOOKUP_ORACLE = "lookup-oracle"
ORACLES = (ORACLE, LOOKUP_ORACLE)  # the bench's bounds, not contenders


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
        return self._proposal([_ahead(reference, done[1:], gamma) for reference, done in self.rows])

    def _proposal(self, found: list[list[int]]) -> Proposal:
        """Each row's found tokens, the shorter padded (the class docstring)."""
        width = max(len(f) for f in found)
        padded = [f + [(f or done)[-1]] * (width - len(f)) for f, (_, done) in zip(found, self.rows)]
        self.drafts = torch.tensor(padded, dtype=torch.long).view(len(padded), width)  # [B, γ']
        return Proposal(self.drafts, None, [len(f) for f in found])

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        for (_, done), kept, n, nxt in zip(self.rows, self.drafts.tolist(), num_accepted.tolist(),
                                           next_tokens.tolist()):
            done.extend(kept[:n] + [nxt])

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]


class LookupOracleDrafter(OracleDrafter):
    """Prompt lookup (`NGramDrafter`, its defaults) with an oracle for its length: each round the
    lookup's proposal is cut to its longest prefix that the row's reference continues with (the
    drafts the target keeps at T = 0), then to the length g whose pass over g + 1 tokens costs
    least per token, T(g + 1)/(g + 1) from `pass_seconds` (T(1..K)); g = 0 is a plain step. Each
    round's γ is the best any policy could choose for that proposal, so its speed is the most
    prompt lookup can give through this engine on this machine. A point-mass draft chosen from
    the past and a fixed reference: exact by the point-mass rule, as the oracle is."""

    name = LOOKUP_ORACLE

    def __init__(self, references: dict[tuple[int, ...], list[int]], pass_seconds: list[float]):
        super().__init__(references)
        if not pass_seconds or min(pass_seconds) <= 0:
            raise ValueError(f"pass_seconds must be T(1..K) > 0, got {pass_seconds}")
        self.pass_seconds = list(pass_seconds)
        self.lookup = NGramDrafter()

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.lookup.start(input_ids[:0], valid[:0], vocab_size)  # no rows: `join` adds them
        super().start(input_ids, valid, vocab_size)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        super().join(input_ids, valid)
        self.lookup.join(input_ids, valid)

    def next_source(self) -> str:
        return LOOKUP_ORACLE

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        found = []
        for (reference, done), row in zip(self.rows, self.lookup.rows):
            proposed = self.lookup.lookup(row, min(gamma, len(self.pass_seconds) - 1))
            kept = _ahead(reference, done[1:], len(proposed))
            run = next((i for i, (x, y) in enumerate(zip(proposed, kept)) if x != y),
                       min(len(proposed), len(kept)))
            found.append(proposed[:self.cheapest(run)])
        return self._proposal(found)

    def cheapest(self, run: int) -> int:
        """The g in 0..run whose pass over g + 1 tokens costs least per token."""
        return min(range(run + 1), key=lambda g: self.pass_seconds[g] / (g + 1))

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        super().commit(num_accepted, next_tokens)
        self.lookup.observe(self.drafts, num_accepted, next_tokens)

    def select(self, rows: torch.Tensor) -> None:
        super().select(rows)
        self.lookup.select(rows)


def _ahead(reference: list[int], committed: list[int], gamma: int) -> list[int]:
    """The reference's next γ tokens after `committed`, if it is the reference's beginning."""
    n = len(committed)
    return reference[n: n + gamma] if reference[:n] == committed else []
