"""Continuous batching's per-row state: each row's own settings and random streams (rule 8).

A row (one request) owns its temperature, top-k, top-p, penalties, seed, γ, verification rule
and budget. Its γ is a fixed integer, or "auto": then each round's γ comes from the batch's
policy (`batch_controller.BatchController`, past-only), capped by the row's own budget like a
fixed γ.
Its random draws come from its own streams, keyed by (seed, tokens it has emitted, purpose):
each round starts a fresh stream for drafting and one for verifying, so how many uniforms the
other rows — or a longer block drafted for them — consume never shifts this row's draws. Its
block length γ_b = min(γ, budget left − 1) depends only on the row itself, and `verify_rows`
verifies only its first γ_b drafts (the rest were drafted for other rows and are ignored). So a
row's round is exactly the round it would have alone, and the same seed reproduces the same
output whatever shares the batch. Each round is still an exact sample of the next tokens given
the prefix (the choices look only backwards, rule 7), so exactness is untouched.

A row under the "token" or "block" rule reproduces its output only as long as its γ and draft
do (γ = "auto" follows timings). Under the "coupled" rule it draws from noise keyed by (seed,
absolute position) instead (`exactspec.noise`): its tokens are those of plain decoding with that
seed, whatever its γ, its draft or its company.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from exactspec.constraints import Constraint
from exactspec.policy import AUTO, MAX_GAMMA
from exactspec.drafters.base import NoDraft
from exactspec.drafters.grammar import GrammarDrafter
from exactspec.logprobs import check_logprobs_args, emitted
from exactspec.noise import RowNoise, mix, row_seed
from exactspec.sampling import RowSampling, SamplingConfig
from exactspec.verify import VERIFY_RULES, BlockResult, verify_block, verify_rows

DRAFT, VERIFY = 1, 2  # the purposes of a row's per-round streams


def left_pad(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Prompts as left-padded rows: (ids[B, L], valid[B, L]); right padding is moved left."""
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(attention_mask.shape)}")
    valid = attention_mask.to(input_ids.device).bool()
    if not valid.any(dim=1).all():
        raise ValueError("the prompt is empty: a row of attention_mask has no tokens")
    order = torch.argsort(valid.long(), dim=1, stable=True)  # [B, L], padding first
    return input_ids.gather(1, order), valid.gather(1, order)


@dataclass(frozen=True)
class RowSettings:
    """One row's decoding settings. gamma 0 decodes that row plainly (one token per round);
    gamma "auto" takes the γ the batch's controller chooses each round."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    gamma: int | str = 4
    verify: str = "block"
    constraint: Constraint | None = None  # what the row's output must match
    frequency_penalty: float = 0.0  # and the other penalties: as in `SamplingConfig`
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    min_p: float | None = None
    logprobs: int | None = None  # alternatives to record per token (`exactspec.logprobs`)

    def __post_init__(self):
        object.__setattr__(self, "logit_bias", self.sampling.logit_bias)  # checks the settings
        check_logprobs_args(self.logprobs)
        checked = [("max_new_tokens", self.max_new_tokens, 1, None)]
        if self.gamma != AUTO:
            checked.append(("gamma", self.gamma, 0, MAX_GAMMA))
        for name, value, low, high in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (
                    high is not None and value > high):
                where = f"in [{low}, {high}] or 'auto'" if high is not None else f">= {low}"
                raise ValueError(f"{name} must be an integer {where}, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.verify not in VERIFY_RULES:
            raise ValueError(f"verify must be one of {VERIFY_RULES}, got {self.verify!r}")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.frequency_penalty,
                              self.presence_penalty, self.repetition_penalty, self.logit_bias,
                              self.min_p)


class SharedSettings:
    """Every row decodes with one SamplingConfig, one generator (the Decoder's), one γ and one
    rule; row b's coupled noise is from (seed, b). The other kind of rows' settings: `PerRow`."""

    def __init__(self, sampling, generator: torch.Generator, verify: str, budget_left,
                 logprobs: int | None = None):
        self.sampling_config, self.generator, self.rule = sampling, generator, verify
        self.logprobs = logprobs  # alternatives to record per token for every row, or None
        self.seed = generator.initial_seed()  # row b's noise: `noise.row_seed(seed, b)`
        self.budget_left = budget_left  # the Rows' budget_left(): the most any row may emit

    def auto(self) -> bool:
        return True

    def sampling(self):
        return self.sampling_config

    def drafted(self) -> None:
        return None  # every row drafted the round's block

    def block(self, gamma: int, emitted: list[int]) -> int:
        """γ capped by the longest budget left."""
        return min(gamma, self.budget_left() - 1)

    def streams(self, purpose: int, emitted: list[int], noise: list):
        """The round's draws: the rows' `RowNoise` under the coupled rule, else the generator."""
        return noise if self.rule == "coupled" else self.generator

    def verify(self, proposal, drafts: torch.Tensor, p: torch.Tensor, emitted: list[int],
               noise: list) -> BlockResult:
        return verify_block(drafts, proposal.q, p, self.streams(VERIFY, emitted, noise), self.rule)

    def noise_keys(self, rows: list[int]) -> tuple[list[int], list[str]]:
        """Each active row's noise seed and rule (rows: their indices in the whole batch)."""
        return [row_seed(self.seed, row) for row in rows], [self.rule] * len(rows)

    def count_drafted(self, proposal, drafts: torch.Tensor, emitted: list[int]) -> int:
        return drafts.size(1)

    def select(self, going: torch.Tensor) -> None:
        pass

    def wanted_logprobs(self, rows: int) -> list[int | None]:
        return [self.logprobs] * rows


class PerRow:
    """The settings and stream seeds of the rows in the batch, in batch order: each row its own
    SamplingConfig, seed, γ (an integer or "auto") and rule."""

    def __init__(self, settings, device: torch.device):
        self.device = device
        self.auto_gamma = 0  # this round's γ for the rows whose gamma is "auto"
        self.verified: list[int] = []  # the drafts each row verified in the last round
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

    def auto(self) -> bool:
        """Whether some row's γ is "auto" (the policy chooses it)."""
        return any(row.gamma == AUTO for row in self.settings)

    def sampling(self) -> RowSampling:
        return RowSampling(row.sampling for row in self.settings)

    def wanted_logprobs(self, rows: int) -> list[int | None]:
        return [row.logprobs for row in self.settings]

    def drafted(self) -> list[int]:
        return self.verified

    def block(self, gamma: int, emitted: list[int]) -> int:
        """The largest γ_b (`gammas`), with the "auto" rows at γ."""
        self.auto_gamma = gamma
        return max(self.gammas(emitted))

    def streams(self, purpose: int, emitted: list[int], noise: list) -> list:
        return self.generators(purpose, emitted, noise)

    def noise_keys(self, rows: list[int]) -> tuple[list[int], list[str]]:
        """Each row's noise seed and rule: each row its own request, row 0 of its seed."""
        return [row_seed(seed) for seed in self.seeds], [row.verify for row in self.settings]

    def count_drafted(self, proposal, drafts: torch.Tensor, emitted: list[int]) -> list[int]:
        """Drafts each row verified: its γ_b, cut to what it proposed itself."""
        self.verified = self.lengths(proposal, emitted)
        return self.verified

    def gammas(self, emitted: list[int]) -> list[int]:
        """γ_b = min(γ, budget left − 1): no row drafts past its own budget."""
        return [max(0, min(self.auto_gamma if row.gamma == AUTO else row.gamma,
                           row.max_new_tokens - n - 1))
                for row, n in zip(self.settings, emitted)]

    def generators(self, purpose: int, emitted: list[int], noise: list) -> list:
        """Row b's fresh stream for this round: its `RowNoise` under the coupled rule (noise[b]),
        else a generator seeded by (seed, tokens emitted so far, purpose)."""
        streams = []
        for seed, n, own in zip(self.seeds, emitted, noise):
            if own is not None:
                streams.append(own)
                continue
            generator = torch.Generator(device=self.device)
            generator.manual_seed(mix(seed, n, purpose))
            streams.append(generator)
        return streams

    def lengths(self, proposal, emitted: list[int]) -> list[int]:
        """Drafts row b verifies: its γ_b, after the tokens its grammar forces unless the row asked
        for plain decoding (γ 0), cut to what it proposed itself."""
        proposed = proposal.lengths or [proposal.tokens.size(1)] * len(emitted)
        forced = proposal.forced or [0] * len(emitted)
        return [min(g + (f if row.gamma != 0 else 0), row.max_new_tokens - e - 1, n)
                for row, g, f, n, e in zip(self.settings, self.gammas(emitted), forced, proposed, emitted)]

    def verify(self, proposal, drafts: torch.Tensor, p: torch.Tensor,
               emitted: list[int], noise: list) -> BlockResult:
        """Each row verifies its own drafts with its own rule and verification stream."""
        return verify_rows(drafts, proposal.q, p, self.generators(VERIFY, emitted, noise),
                           self.lengths(proposal, emitted), [row.verify for row in self.settings])


class ContinuousBatching:
    """The `Decoder`'s continuous-batching half: the rows' settings and streams (`settings`,
    `SharedSettings` or `PerRow`) and rows joining and leaving. Mixed into
    `exactspec.engine.Decoder`, whose attributes it reads: `lm`, `drafter`, `rows`, `matchers`,
    `last`, `prompt_lengths`, `rounds`, `done`, `sampling`.

    Until `use_row_settings`, every row shares the Decoder's SamplingConfig, generator, γ and rule.
    With it, every row decodes with its own `RowSettings` (each row drafts its own γ_b; the γ
    passed to `step` is the γ of the rows whose gamma is "auto"), rows may `join` at a round
    boundary and be `cancel`led between rounds.

    Joining: a new row's prompt minus its last token is prefilled on its own and merged into the
    running target (`join` of the target protocol); its last prompt token becomes its last
    committed token, so the next round feeds [last, drafts] for every row alike.
    """

    settings: SharedSettings | PerRow
    logprobs_mode: str = "raw"
    _round_noise: tuple = (None, [])  # (the round's key, its rows' RowNoise): see `_noise`

    def constrain(self, constraints) -> None:
        """Rows appended to the batch's grammars (a `Constraint` or None each); once any row has
        one, the drafter drafts what the grammar forces first (`GrammarDrafter`)."""
        self.matchers.join(constraints)
        if self.matchers and not isinstance(self.drafter, (NoDraft, GrammarDrafter)):
            self.drafter = GrammarDrafter(self.drafter, self.matchers, self.rows.budget_left)

    def use_row_settings(self, settings) -> None:
        """Per-row settings for the rows of the first batch, set before the first round."""
        settings = list(settings)
        if len(settings) != self.rows.active.numel() or self.rounds:
            raise ValueError(f"settings must give one RowSettings per row "
                             f"({self.rows.active.numel()}) before the first round, got {len(settings)}")
        self.settings = PerRow(settings, self.lm.device)
        self.sampling = self.settings.sampling()
        self.matchers.select(torch.arange(0))  # the rows' own constraints replace the batch's
        self.constrain(row.constraint for row in settings)
        self.rows.budget = [row.max_new_tokens for row in settings]
        self.done = False

    def join(self, input_ids: torch.Tensor, attention_mask, settings) -> list[int]:
        """Add rows (prompts [n, L], left or right padded) at a round boundary; returns their row
        indices (as `on_tokens` and `rows.new` number them)."""

        if not isinstance(self.settings, PerRow) or self.rounds == 0 or self.done:
            raise RuntimeError("join needs a running per-row Decoder after its first round")
        ids, valid = (t.to(self.lm.device) for t in left_pad(input_ids, attention_mask))
        settings = list(settings)
        if len(settings) != ids.size(0):
            raise ValueError(f"settings must give one RowSettings per new row ({ids.size(0)}), "
                             f"got {len(settings)}")
        self.drafter.join(ids, valid)  # first: a drafter that cannot take rows raises ValueError
        self.lm.join(ids[:, :-1], valid[:, :-1])
        self.last = torch.cat([self.last, ids[:, -1]])  # [B + n]
        self.prompt_lengths += valid.sum(dim=1).tolist()
        self.prompts += list(zip(ids, valid))
        first = len(self.rows.new)
        self.rows.join([row.max_new_tokens for row in settings])
        self.settings.join(settings)
        self.sampling = self.settings.sampling()
        self.constrain(row.constraint for row in settings)
        return list(range(first, first + ids.size(0)))

    def cancel(self, rows) -> None:
        """These rows (row indices) leave the batch now, between rounds (their client went away)."""
        gone = set(rows)
        going = [i for i, row in enumerate(self.rows.active.tolist()) if row not in gone]
        self._retire(torch.tensor(going, dtype=torch.long))

    def auto_rows(self) -> bool:
        """Whether the policy chooses this round's γ: one γ for all rows, or some row's is "auto"."""
        return self.settings.auto()

    def row_drafts(self) -> list[int] | None:
        """The drafts each row verified in the last round (None: every row the round's block)."""
        return self.settings.drafted()

    def _emitted(self) -> list[int]:
        return [len(self.rows.new[row]) for row in self.rows.active.tolist()]

    def _block(self, gamma: int) -> int:
        """The round's block: γ capped by the longest budget left, or the largest γ_b per row."""
        return self.settings.block(gamma, self._emitted())

    def _stream(self, purpose: int):
        """This round's draws for `purpose` (DRAFT or VERIFY)."""
        return self.settings.streams(purpose, self._emitted(), self._noise())

    def _verify(self, proposal, drafts: torch.Tensor, p: torch.Tensor) -> BlockResult:
        return self.settings.verify(proposal, drafts, p, self._emitted(), self._noise())

    def _logprobs(self, logits: torch.Tensor, p: torch.Tensor, result: BlockResult):
        """Each active row's emitted tokens with their log-probabilities from this round's pass
        (`logprobs.emitted`), where the row asked; None when no row did (nothing computed)."""
        wants = self.settings.wanted_logprobs(result.tokens.size(0))
        if all(n is None for n in wants):
            return None
        return emitted(logits, p, result.tokens, result.num_emitted.tolist(), wants,
                       self.logprobs_mode)

    def _noise(self) -> list:
        """This round's `RowNoise` of each active row under the coupled rule (None for the other
        rows): its seed, from its absolute position (prompt tokens + tokens emitted) on. Made
        once a round, so the draft's races and the target's share their noise."""
        rows, emitted = self.rows.active.tolist(), self._emitted()
        seeds, rules = self.settings.noise_keys(rows)
        starts = [self.prompt_lengths[row] + n for row, n in zip(rows, emitted)]
        key = (tuple(seeds), tuple(starts), tuple(rules))
        if self._round_noise[0] != key:
            self._round_noise = (key, [RowNoise(seed, start) if rule == "coupled" else None
                                       for seed, start, rule in zip(seeds, starts, rules)])
        return self._round_noise[1]

    def _drafted(self, proposal, drafts: torch.Tensor):
        """Drafts each row verified this round: the block, or each row's own."""
        return self.settings.count_drafted(proposal, drafts, self._emitted())
