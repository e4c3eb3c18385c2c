"""The γ policy's contract: before each round the driver (`engine.Driver`) tells the policy the
round's `Situation` and gets a `Choice`; after it the policy observes the round. Choices read only
rounds already run (the past-only rule), so every round stays an exact sample."""
from __future__ import annotations

from dataclasses import dataclass

AUTO = "auto"
MAX_GAMMA = 32  # the longest block anyone may ask for


@dataclass(frozen=True)
class Situation:
    """What a round's choice may weigh besides past rounds: who drafts it (`source`, "none": no
    one), the rows in the batch, the tokens the draft must catch up on first (`lag`), the most
    tokens any row may still generate, and the drafts every row keeps for certain (`free`)."""

    source: str
    rows: int = 1
    lag: int = 0
    tokens_left: int | None = None
    free: int = 0


@dataclass(frozen=True)
class Choice:
    """A round's γ, the fewest drafts worth the target's pass (a shorter proposal is dropped for
    a plain step), the source it was chosen for, and why, in words (the trace's `reason`)."""

    gamma: int
    min_drafts: int
    source: str
    reason: str

    @classmethod
    def fixed(cls, gamma: int, source: str, reason: str | None = None) -> Choice:
        return cls(gamma, 0, source, reason or ("fixed γ" if gamma else "plain decoding"))


class Controller:
    """What the round loop needs from a γ policy; subclass it for your own. `decide` returns the
    round's `Choice`; by default from `choose` (γ), `min_drafts` (0: any proposal is verified)
    and `reason`. After the round `observe_round` learns from it."""

    reason: str = ""

    def decide(self, situation: Situation) -> Choice:
        """The next round's choice (`Choice`), from finished rounds only."""
        gamma = self.choose(situation.source, rows=situation.rows, lag=situation.lag,
                            tokens_left=situation.tokens_left, free=situation.free)
        return Choice(gamma, self.min_drafts(situation.source, gamma, situation.free),
                      situation.source, self.reason or type(self).__name__)

    def choose(self, source: str, *, rows: int = 1, lag: int = 0, tokens_left: int | None = None,
               free: int = 0) -> int:
        """The γ for the next round of `rows` rows when `source` drafts it (`GammaController`)."""
        raise NotImplementedError(f"{type(self).__name__} must define choose(source, **situation)")

    def min_drafts(self, source: str, gamma: int, free: int = 0) -> int:
        """The fewest drafts worth a pass: 0, any proposal is verified."""
        return 0

    def observe(self, source: str, drafted: int | list[int], num_accepted, target_tokens: int,
                draft_seconds: float | None, target_seconds: float, draft_calls: int = 0,
                free: int = 0) -> None:
        """Learn from one finished round (`GammaController.observe`): nothing, by default."""

    def observe_round(self, source: str, report, drafted=None) -> None:
        """Learn from a finished round, `exactspec.engine.Round` (drafted: each row's drafts, when
        rows differ)."""
        draft_seconds, draft_calls = report.draft_cost()
        self.observe(source, report.drafted if drafted is None else drafted, report.num_accepted,
                     report.target_tokens, draft_seconds, report.target_seconds, draft_calls,
                     free=report.free)
