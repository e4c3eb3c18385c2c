"""What the γ controller knows of a draft source's drafts: α, and when it probes next.

α is kept / (kept + rejected) drafts, the geometric model's estimate, from a prior worth
PRIOR_DRAFTS drafts (past generations' α, else 1/2): α belongs to the text, so a few of this
generation's drafts outweigh the past. See docs/design.md: moved from comments."""
from __future__ import annotations

from dataclasses import dataclass

PRIOR_DRAFTS = 2  # a generation's α starts from a prior worth this many drafts
WINDOW = 256  # drafts per source after which older ones weigh half (`decay`)
FIRST_PROBE, LAST_PROBE, REFRESH_PROBE = 4, 32, 64  # plain steps before a probe (see `Probe`)
PROBE_QUANTILE = 0.9  # a probe's γ is the best at this quantile of α's posterior


@dataclass
class Acceptance:
    """Kept and rejected drafts of one source in this generation; α starts from `prior`."""

    accepted: int = 0
    rejected: int = 0
    prior: float = 0.5

    @classmethod
    def from_past(cls, kept: int, rejected: int) -> Acceptance:
        """A generation's start: the prior is past generations' α (Laplace's rule), else 1/2."""
        return cls(prior=(kept + 1) / (kept + rejected + 2) if kept + rejected else 0.5)

    def alpha(self) -> float:
        return (self.accepted + PRIOR_DRAFTS * self.prior) / (self.accepted + self.rejected + PRIOR_DRAFTS)

    def optimistic(self) -> float:
        """The PROBE_QUANTILE quantile of α's Beta posterior (the counts with the prior)."""
        from scipy.special import betaincinv

        return float(betaincinv(self.accepted + PRIOR_DRAFTS * self.prior,
                                self.rejected + PRIOR_DRAFTS * (1 - self.prior), PROBE_QUANTILE))


def decay(counts: list[int]) -> None:
    """[kept, rejected] past WINDOW drafts: older ones weigh half (the one decay rule, for past
    generations' counts and for a server's, which span requests)."""
    if sum(counts) > WINDOW:
        counts[0], counts[1] = counts[0] // 2, counts[1] // 2


def count_past(past: list[int], accepted: int, rejected: int) -> None:
    """Add to past generations' [kept, rejected], then `decay`."""
    past[0], past[1] = past[0] + accepted, past[1] + rejected
    decay(past)


@dataclass
class Probe:
    """When a source probes next, and how long: `plain` steps since its last probe (probes come
    after FIRST_PROBE, doubling to LAST_PROBE plain steps while drafting could pay at a better α,
    every REFRESH_PROBE while it could not pay even if every draft were kept); `ladder`: twice
    the last probe's γ when the draft kept all of it (a doubling search for the block length that
    shows what the draft is worth), else 0; `pending`: the γ of a probe not yet observed."""

    plain: int = 0
    after: int = FIRST_PROBE
    ladder: int = 0
    pending: int = 0

    def due(self, could_pay: bool) -> bool:
        """Count a plain step; whether a probe is due now."""
        self.plain += 1
        return self.plain >= (self.after if could_pay else REFRESH_PROBE)

    def reset(self) -> None:
        """The source drafts again: the schedule starts over."""
        self.plain, self.after, self.ladder = 0, FIRST_PROBE, 0

    def start(self, gamma: int) -> int:
        """A probe of γ now: the next one comes twice as late (at most LAST_PROBE)."""
        self.plain, self.after = 0, min(2 * self.after, LAST_PROBE)
        self.pending = gamma
        return gamma

    def observed(self, whole: bool) -> None:
        """The pending probe's outcome: kept whole, the next probe is twice as long."""
        self.ladder = 2 * self.pending if whole else 0
        self.pending = 0
