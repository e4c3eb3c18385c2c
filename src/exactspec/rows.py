"""Per-row bookkeeping of a generation: each row's new tokens, counters and budget, and which
rows are still generating. A row ends on an EOS, on its budget, or when `on_tokens` returns
`EndRow`; a prefix of an exact sample is an exact sample, so a row is exact however it ends."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

PLAIN = "plain"  # the source of a round in which a row had no drafts


@dataclass
class SourceCounts:
    """One source's share of a row's rounds (who drafted them: "model", "ngram", "grammar", ...,
    or "plain"): rounds, drafted tokens and accepted drafts. Over all sources they add up to the
    row's own counters."""

    rounds: int = 0
    drafted_tokens: int = 0
    accepted_drafts: int = 0

    def add(self, rounds: int, drafted_tokens: int, accepted_drafts: int) -> None:
        self.rounds += rounds
        self.drafted_tokens += drafted_tokens
        self.accepted_drafts += accepted_drafts


ROW_COUNTERS = (  # what a batch total sums over its rows (`DecodeStats.add`)
    "output_tokens", "accepted_drafts", "drafted_tokens", "corrections", "bonus_tokens")


@dataclass
class DecodeStats:
    """Counters of one generation. output tokens = accepted drafts + corrections + bonus tokens.
    by_source splits rounds, drafted tokens and accepted drafts by who drafted each round;
    drafted_per_pos[i] counts the rounds with a draft at index i of the block, accepted_per_pos[i]
    those whose draft at index i was accepted (and emitted): each sums to its counter. In a
    batch's total (`GenerateOutput.stats`) these sum the rows' (by_source counts row-rounds; the
    batch's own rounds per source are `GenerateOutput.rounds_by_source`)."""

    output_tokens: int = 0
    accepted_drafts: int = 0
    drafted_tokens: int = 0
    corrections: int = 0
    bonus_tokens: int = 0
    rounds: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    target_tokens_fed: int = 0
    draft_tokens_fed: int = 0
    padding_fed: int = 0  # batches: padding slots run through either model
    hole_fraction: float = 0.0  # batches: mean share of the target cache's columns that are holes
    wall_seconds: float = 0.0
    time_to_first_token: float | None = None
    by_source: dict[str, SourceCounts] = field(default_factory=dict)
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.output_tokens / self.rounds if self.rounds else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    def add(self, row: DecodeStats, rounds: bool = False) -> None:
        """Add a row's token counts, by_source and per-position counts (and its rounds, with
        `rounds`: a request's choices; a batch counts its own rounds) into this total."""
        for counter in ROW_COUNTERS + (("rounds",) if rounds else ()):
            setattr(self, counter, getattr(self, counter) + getattr(row, counter))
        for source, share in row.by_source.items():
            self.by_source.setdefault(source, SourceCounts()).add(
                share.rounds, share.drafted_tokens, share.accepted_drafts)
        for mine, theirs in ((self.drafted_per_pos, row.drafted_per_pos),
                             (self.accepted_per_pos, row.accepted_per_pos)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.tokens_per_round, "tokens_per_s": self.tokens_per_s}


def cut(tokens: list[int], eos: set[int], budget: int) -> list[int]:
    """The tokens up to and including the first EOS, and at most `budget` of them."""
    for i, token in enumerate(tokens[:budget]):
        if token in eos:
            return tokens[: i + 1]
    return tokens[:budget]


class Rows:
    """Per-row bookkeeping: new tokens, counters, and which rows are still generating."""

    def __init__(self, batch: int, max_new_tokens: int, eos: set[int], clock, on_tokens):
        self.new = [[] for _ in range(batch)]
        self.logprobs = [[] for _ in range(batch)]  # TokenLogprob per new token, where asked
        self.stats = [DecodeStats() for _ in range(batch)]
        self.active = torch.arange(batch)  # original index of each row still in the batch
        self.max_new_tokens, self.eos, self.clock, self.on_tokens = max_new_tokens, eos, clock, on_tokens
        self.budget = [max_new_tokens] * batch  # per original row: rows may differ (rule 8)
        self.first_token_at: float | None = None

    def budget_left(self) -> int:
        return max(self.budget[r] - len(self.new[r]) for r in self.active.tolist())

    def join(self, budgets: list[int]) -> None:
        """Rows joining the batch at a round boundary: new original indices, appended last."""
        first = len(self.new)
        self.new += [[] for _ in budgets]
        self.logprobs += [[] for _ in budgets]
        self.stats += [DecodeStats() for _ in budgets]
        self.budget += list(budgets)
        self.active = torch.cat([self.active, torch.arange(first, first + len(budgets))])

    def record(self, result, drafted: int, target_calls: int, draft_calls: int,
               logprobs=None, source: str = PLAIN) -> torch.Tensor:
        """Count one round per active row; return the batch positions of rows still going.
        logprobs[i] (`exactspec.logprobs.emitted`, None: not asked) is cut with row i's tokens
        and reaches `on_tokens` as its `logprobs=` keyword. `source`: the drafter's
        `next_source()` for this round (each row counts it under `round_source`)."""
        now = self.clock.read()
        if self.first_token_at is None:
            self.first_token_at = now
        going = []
        for i, row in enumerate(self.active.tolist()):
            tau = int(result.num_accepted[i])
            new = cut(result.tokens[i, : tau + 1].tolist(), self.eos,
                       self.budget[row] - len(self.new[row]))
            chosen = None if logprobs is None or logprobs[i] is None else logprobs[i][: len(new)]
            ended = self._tell(row, new, chosen)
            if isinstance(ended, EndRow):  # the callback's stopping rule ends the row here
                new = new[: ended.keep]
            self.new[row].extend(new)
            if chosen is not None:
                self.logprobs[row].extend(chosen[: len(new)])
            count_round(self.stats[row], new, drafted if isinstance(drafted, int) else drafted[i],
                         tau, target_calls, draft_calls, source)
            if self.stats[row].time_to_first_token is None and new:
                self.stats[row].time_to_first_token = now
            if (isinstance(ended, EndRow) or new and new[-1] in self.eos
                    or len(self.new[row]) >= self.budget[row]):
                self.stats[row].wall_seconds = now
            else:
                going.append(i)
        return torch.tensor(going, dtype=torch.long)

    def _tell(self, row: int, new: list[int], logprobs):
        if self.on_tokens is None or not new:
            return None
        if logprobs is None:
            return self.on_tokens(row, new)
        return self.on_tokens(row, new, logprobs=logprobs)


@dataclass(frozen=True)
class EndRow:
    """What `on_tokens(row, new_ids)` returns to end that row after the first `keep` of new_ids
    (a stopping rule: one that reads only the row's own tokens keeps the output exact)."""

    keep: int


def round_source(source: str, drafted: int) -> str:
    """Who drafted a round, as counted: "plain" when there were no drafts, "model" for the auto
    draft's first round ("none": drafted by its model at a fixed γ, `AutoDrafter`), else the
    drafter's `next_source()` ("model", "ngram", "ngram-1", "grammar", ...)."""
    if not drafted:
        return PLAIN
    return "model" if source == "none" else source


def count_round(stats: DecodeStats, new: list[int], drafted: int, tau: int,
                 target_calls: int, draft_calls: int, source: str = PLAIN) -> None:
    """Count what the round emitted for one row (EOS or the budget may have cut it short).
    An accepted draft counts only when it was emitted: min(τ, len(new)) of them."""
    stats.rounds += 1
    stats.target_calls += target_calls
    stats.draft_calls += draft_calls
    stats.drafted_tokens += drafted
    stats.output_tokens += len(new)
    kept = min(tau, len(new))
    stats.accepted_drafts += kept
    if len(new) == tau + 1:
        if tau == drafted:
            stats.bonus_tokens += 1
        else:
            stats.corrections += 1
    stats.by_source.setdefault(round_source(source, drafted), SourceCounts()).add(1, drafted, kept)
    count_positions(stats.drafted_per_pos, drafted)
    count_positions(stats.accepted_per_pos, kept)


def count_positions(per_pos: list[int], n: int) -> None:
    """One more round with something at each of the block's indices 0..n-1 (a row's kept drafts
    are the block's first τ: a draft is accepted only after every draft before it)."""
    per_pos.extend([0] * (n - len(per_pos)))
    for i in range(n):
        per_pos[i] += 1
