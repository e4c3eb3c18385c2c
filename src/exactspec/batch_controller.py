"""γ for a server's continuous batch: a `GammaController` that lives as long as the server, with
one more guard, on what drafting delivered at each batch size. Rules and reasons: docs/design.md,
"The policy of a continuous batch"."""
from __future__ import annotations

from dataclasses import dataclass, field

from exactspec.acceptance import decay
from exactspec.controller import GammaController
from exactspec.models.loaded import Memory
from exactspec.policy import Choice, Situation

PAYOFF_SMOOTHING = 0.25  # weight of the newest drafting round in a source's payoff
PROBE_SHARE = 0.01  # the most of the serving time that drafting rounds that do not pay may take


@dataclass
class BatchController(GammaController):
    """One per target and drafter for the whole serving time: rows come and go, so α per source
    spans requests (counted with `acceptance.decay`, as past generations' are), and timings are
    kept per batch size. A round also costs what T(k) does not show (a model draft that sat
    rounds out catches up on every row's tokens when it drafts), so the controller checks what
    drafting delivered: per (source, batch size) the `payoff`, tokens per second of its drafting
    rounds over a plain step's (1 / T(1)), smoothed. While it is below 1 that source drafts again
    at that batch size only once the rounds since its last drafting round there took 1/PROBE_SHARE
    times that round's extra cost, and a round that pays lifts it."""

    payoff: dict[tuple[str, int], float] = field(default_factory=dict)
    since_drafting: dict[tuple[str, int], float] = field(default_factory=dict)  # seconds
    extra_cost: dict[tuple[str, int], float] = field(default_factory=dict)  # beyond T(1), seconds

    @classmethod
    def shared(cls, memory: Memory, drafter_name: str) -> BatchController:
        """Timings kept in the target's `memory` as for a generation; α this server's own."""
        controller = super().shared(memory, drafter_name)
        controller.past = {}
        return controller

    def decide(self, situation: Situation) -> Choice:
        choice = super().decide(situation)
        key = (situation.source, situation.rows)
        if choice.gamma and 1 in self.target and self.payoff.get(key, 1.0) < 1 and (
                self.since_drafting.get(key, 0.0) * PROBE_SHARE < self.extra_cost.get(key, 0.0)):
            return Choice(0, 0, situation.source, f"drafting at {situation.rows} rows delivered less "
                          "than a plain step lately; its next try is not due")
        return choice

    def _count(self, source: str, accepted: int, rejected: int) -> None:
        super()._count(source, accepted, rejected)
        stats = self._stats(source)
        counts = [stats.accepted, stats.rejected]
        decay(counts)
        stats.accepted, stats.rejected = counts

    def observe_round(self, source: str, report, drafted=None) -> None:
        self.rows = report.num_accepted.numel()
        key = (source, self.rows)
        plain = self.target_seconds(1) if 1 in self.target else None  # before this round counts
        super().observe_round(source, report, drafted)
        seconds = report.draft_seconds + report.target_seconds
        for name in self.since_drafting.keys() | {key}:
            self.since_drafting[name] = self.since_drafting.get(name, 0.0) + seconds
        if report.drafted and plain and report.target_tokens:  # (a round that read the prompts: no rate)
            self._learn_payoff(key, report, seconds, plain)

    def _learn_payoff(self, key: tuple[str, int], report, seconds: float, plain: float) -> None:
        """A drafting round (source, batch size) took `seconds` where a plain step takes `plain`."""
        rows = report.num_accepted.numel()
        payoff = (int(report.num_accepted.sum()) + rows) / seconds / (rows / plain)
        old = self.payoff.get(key)
        self.payoff[key] = payoff if old is None else (
            (1 - PAYOFF_SMOOTHING) * old + PAYOFF_SMOOTHING * payoff)
        self.since_drafting[key], self.extra_cost[key] = 0.0, max(seconds - plain, 0.0)
