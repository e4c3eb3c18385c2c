"""Continuous batching's per-row state: each row's own settings and random streams (rule 8).

A row (one request) owns its temperature, top-k, top-p, seed, γ, verification rule and budget.
Its random draws come from its own streams, keyed by (seed, tokens it has emitted, purpose):
each round starts a fresh stream for drafting and one for verifying, so how many uniforms the
other rows — or a longer block drafted for them — consume never shifts this row's draws. Its
block length γ_b = min(γ, budget left − 1) depends only on the row itself, and `verify_rows`
verifies only its first γ_b drafts (the rest were drafted for other rows and are ignored). So a
row's round is exactly the round it would have alone, and the same seed reproduces the same
output whatever shares the batch. Each round is still an exact sample of the next tokens given
the prefix (the choices look only backwards, rule 7), so exactness is untouched.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from exactspec.cache import CachedModel
from exactspec.sampling import RowSampling, SamplingConfig, check_sampling_args
from exactspec.verify import VERIFY_RULES, BlockResult, verify_block, verify_rows

MAX_GAMMA = 32
_MASK = (1 << 64) - 1
DRAFT, VERIFY = 1, 2  # the purposes of a row's per-round streams


@dataclass(frozen=True)
class RowSettings:
    """One row's decoding settings. gamma 0 decodes that row plainly (one token per round)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    gamma: int = 4
    verify: str = "block"

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        for name, value, low, high in (("max_new_tokens", self.max_new_tokens, 1, None),
                                       ("gamma", self.gamma, 0, MAX_GAMMA)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                    high is not None and value > high):
                where = f"in [{low}, {high}]" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be an integer {where}, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


def _mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK
        state ^= state >> 29
    return state >> 1


class PerRow:
    """The settings and stream seeds of the rows in the batch, in batch order."""

    def __init__(self, settings, device: torch.device):
        self.device = device
        self.settings: list[RowSettings] = []
        self.seeds: list[int] = []
        self.join(settings)

    def join(self, settings) -> None:
        """Rows appended at the end of the batch; a row without a seed gets a random one."""
        for row in settings:
            self.settings.append(row)
            self.seeds.append(secrets.randbits(63) if row.seed is None else row.seed)

    def select(self, going: torch.Tensor) -> None:
        keep = going.tolist()
        self.settings = [self.settings[i] for i in keep]
        self.seeds = [self.seeds[i] for i in keep]

    def sampling(self) -> RowSampling:
        return RowSampling(row.sampling for row in self.settings)

    def gammas(self, emitted: list[int]) -> list[int]:
        """γ_b = min(γ, budget left − 1): no row drafts past its own budget."""
        return [max(0, min(row.gamma, row.max_new_tokens - n - 1))
                for row, n in zip(self.settings, emitted)]

    def generators(self, purpose: int, emitted: list[int]) -> list[torch.Generator]:
        """Row b's fresh stream for this round: seeded by (seed, tokens emitted so far, purpose)."""
        streams = []
        for seed, n in zip(self.seeds, emitted):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(_mix(seed, n, purpose))
            streams.append(generator)
        return streams

    def lengths(self, proposal, emitted: list[int]) -> list[int]:
        """Drafts row b verifies: its γ_b, cut to what it proposed itself."""
        proposed = proposal.lengths or [proposal.tokens.size(1)] * len(emitted)
        return [min(g, n) for g, n in zip(self.gammas(emitted), proposed)]

    def verify(self, proposal, drafts: torch.Tensor, p: torch.Tensor,
               emitted: list[int]) -> BlockResult:
        """Each row verifies its own drafts with its own rule and verification stream."""
        return verify_rows(drafts, proposal.q, p, self.generators(VERIFY, emitted),
                           self.lengths(proposal, emitted), [row.verify for row in self.settings])


class ContinuousBatching:
    """The `Decoder`'s continuous-batching half (mixed into `exactspec.engine.Decoder`).

    Without `use_row_settings` the Decoder runs as always: one SamplingConfig, one generator,
    one γ and rule for every row. With it, every row decodes with its own `RowSettings` (the γ
    passed to `step` is then ignored: each row drafts its own γ_b), rows may `join` at a round
    boundary and be `cancel`led between rounds.

    Joining: a new row's prompt minus its last token is prefilled on its own and merged into the
    running caches (the shorter side padded with holes); its last prompt token becomes its last
    committed token, so the next round feeds [last, drafts] for every row alike.
    """

    per_row: PerRow | None = None

    def use_row_settings(self, settings) -> None:
        """Per-row settings for the rows of the first batch, set before the first round."""
        settings = list(settings)
        if len(settings) != self.rows.active.numel() or self.rounds:
            raise ValueError(f"settings must give one RowSettings per row "
                             f"({self.rows.active.numel()}) before the first round, got {len(settings)}")
        self.per_row = PerRow(settings, self.lm.device)
        self.sampling = self.per_row.sampling()
        self.rows.budget = [row.max_new_tokens for row in settings]
        self.done = False

    def join(self, input_ids: torch.Tensor, attention_mask, settings) -> list[int]:
        """Add rows (prompts [n, L], left or right padded) at a round boundary; returns their row
        indices (as `on_tokens` and `rows.new` number them)."""
        from exactspec.engine import _left_pad  # the engine imports this module

        if self.per_row is None or self.rounds == 0 or self.done:
            raise RuntimeError("join needs a running per-row Decoder after its first round")
        if not hasattr(self.drafter, "join"):
            raise ValueError(f"drafter {self.drafter.name!r} cannot take rows joining a batch")
        ids, valid = (t.to(self.lm.device) for t in _left_pad(input_ids, attention_mask))
        settings = list(settings)
        if len(settings) != ids.size(0):
            raise ValueError(f"settings must give one RowSettings per new row ({ids.size(0)}), "
                             f"got {len(settings)}")
        other = CachedModel(self.lm.model, self.lm.name, self.lm.vocab_size, ids.size(0))
        if ids.size(1) > 1:
            other.prefill(ids[:, :-1], valid[:, :-1])
        self.lm.merge(other)
        self.drafter.join(ids, valid)
        self.last = torch.cat([self.last, ids[:, -1]])  # [B + n]
        first = len(self.rows.new)
        self.rows.join([row.max_new_tokens for row in settings])
        self.per_row.join(settings)
        self.sampling = self.per_row.sampling()
        return list(range(first, first + ids.size(0)))

    def cancel(self, rows) -> None:
        """These rows (row indices) leave the batch now, between rounds (their client went away)."""
        gone = set(rows)
        going = [i for i, row in enumerate(self.rows.active.tolist()) if row not in gone]
        self._retire(torch.tensor(going, dtype=torch.long))

    def _emitted(self) -> list[int]:
        return [len(self.rows.new[row]) for row in self.rows.active.tolist()]

    def _block(self, gamma: int) -> int:
        """The round's block: γ capped by the longest budget left, or the largest γ_b per row."""
        if self.per_row is None:
            return min(gamma, self.rows.budget_left() - 1)
        return max(self.per_row.gammas(self._emitted()))

    def _stream(self, purpose: int):
        """The generator for this round's draws: the Decoder's own, or one fresh stream per row."""
        if self.per_row is None:
            return self.generator
        return self.per_row.generators(purpose, self._emitted())

    def _verify(self, proposal, drafts: torch.Tensor, p: torch.Tensor) -> BlockResult:
        if self.per_row is None:
            return verify_block(drafts, proposal.q, p, self.generator, self.verify)
        return self.per_row.verify(proposal, drafts, p, self._emitted())

    def _drafted(self, proposal, drafts: torch.Tensor):
        """Drafts each row proposed this round: the block, or each row's own."""
        if self.per_row is None:
            return drafts.size(1)
        return self.per_row.lengths(proposal, self._emitted())
