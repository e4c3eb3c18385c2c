"""Adaptive γ: before each round, the γ that maximizes expected output tokens per expected second,
E[N](α, γ) / (γ · c_draft + T(γ + 1)), from rounds already run only (the past-only rule keeps the
output exact); γ = 0 is a plain step. Prices: `exactspec.pricing`; α and probes:
`exactspec.acceptance`; the rules and their reasons: docs/design.md, "Moved from comments".
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from exactspec.acceptance import Acceptance, Probe, count_past
from exactspec.models.loaded import Memory
from exactspec.policy import AUTO, MAX_GAMMA, Choice, Controller, Situation  # noqa: F401 (re-exported)
from exactspec.pricing import between, estimate, pass_estimates, record, steady

AUTO_MAX_GAMMA = MAX_GAMMA  # the longest the controller chooses (docs/design.md)
START_GAMMA = 4  # a source's first round, before its cost is known
_RECHECK = 1.5  # a drafting round dearer than this times its price re-times T(1)
_MARGIN = 1.1  # a source that scores itself must promise this times a plain step (docs/design.md)
_STEADY_GAMMA = 8  # longer blocks only while costs are steady
_CATCH_UP_MARGIN = 1.5  # drafting after a catch-up must save this times its cost (docs/design.md)
_GUARD_ROUNDS = 4  # drafting rounds of a source in a generation before the guard judges them
_PLAIN_SAMPLES = 3  # T(1) is timed this many times at a batch size before rounds are priced there


@dataclass
class GammaController(Controller):
    """Chooses γ per round from past timings and acceptances (docs/design.md: moved from comments).

    It keeps T(k) per k and batch size, the draft's seconds per token per source and batch size,
    a model draft's catch-up seconds per token, and α per source. A drafting round dearer than
    _RECHECK times its price re-times T(1); blocks longer than _STEADY_GAMMA wait for steady costs;
    the guard stops a source whose last rounds delivered less than a plain step (`delivers`); a
    plain step probes now and then (`probe_gamma`), so a drop to γ = 0 is never permanent."""

    max_gamma: int = AUTO_MAX_GAMMA
    target_by_rows: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # rows → k → s
    draft_by_rows: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # rows → source → s/token
    catch_up: dict[str, list[float]] = field(default_factory=dict)  # source → seconds per token
    acceptance: dict[str, Acceptance] = field(default_factory=dict)
    past: dict[str, list[int]] = field(default_factory=dict)  # source → [kept, rejected] before
    probes: dict[str, Probe] = field(default_factory=dict)  # source → its probe schedule
    rows: int = 1  # the batch size of the round being chosen (set by `choose`)
    lockstep: bool = False  # a fixed batch, done when its slowest row is: see `observe`
    scored: set[str] = field(default_factory=set)  # sources whose one-row α is `observe_evidence`'s
    # this generation's drafting rounds per source: (tokens per row, seconds), for the guard
    delivered: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _priced: dict | None = field(default=None, repr=False)  # estimates made while `_pricing`
    reason: str = ""  # why `choose` chose its last γ, in words (the trace's `reason`)

    @classmethod
    def shared(cls, memory: Memory, drafter_name: str) -> GammaController:
        """A controller whose timings persist in `memory` (the target's, `models.loaded.Memory`)
        across generations with the same drafter name, and whose α starts from the past
        generations' (`Acceptance.from_past`); so does which sources score themselves, so that a
        generation's first rounds do not probe them."""
        kept = memory.drafters.setdefault(drafter_name, dict(draft={}, catch_up={}, past={},
                                                             probes={}, scored=set()))
        return cls(target_by_rows=memory.passes, draft_by_rows=kept["draft"],
                   catch_up=kept["catch_up"], past=kept["past"], probes=kept["probes"],
                   scored=kept["scored"])

    @property
    def target(self) -> dict[int, list[float]]:
        """k → seconds of k-token passes, at the current batch size."""
        return self.target_by_rows.setdefault(self.rows, {})

    @property
    def draft(self) -> dict[str, list[float]]:
        """source → seconds per draft token, at the current batch size."""
        return self.draft_by_rows.setdefault(self.rows, {})

    def draft_seconds(self, source: str) -> float | None:
        """The draft's seconds per token at the current batch size, else at the nearest one
        seen; None before any."""
        return self._once(source, lambda: self._draft_estimate(source))

    def _draft_estimate(self, source: str) -> float | None:
        seen = [rows for rows, costs in self.draft_by_rows.items() if costs.get(source)]
        if not seen:
            return None
        return estimate(self.draft_by_rows[min(seen, key=lambda rows: abs(rows - self.rows))][source])

    def _stats(self, source: str) -> Acceptance:
        if source not in self.acceptance:
            self.acceptance[source] = Acceptance.from_past(*self.past.get(source, (0, 0)))
        return self.acceptance[source]

    def observe(self, source: str, drafted: int | list[int], num_accepted, target_tokens: int,
                draft_seconds: float | None, target_seconds: float, draft_calls: int = 0,
                free: int = 0) -> None:
        """Learn from one finished round: its timings, the draft model's forward passes (0 for a
        drafter without a model; draft_seconds None when the round says nothing of the draft's
        cost) and each row's τ, num_accepted[B]. The first `free` drafts of every row were
        certain (`choose`): α counts only the drafts after them, in rows that kept them all.
        drafted: the drafts of every row, or a list of each row's own (rows of a continuous batch
        differ); a row that drafted nothing in a round that drafted (no lookup match, its
        budget's last token) counts as a rejection: it got the one token of a plain step.
        In `lockstep` (a fixed batch whose rows share one budget: it ends with its slowest row)
        a round counts as the row that kept the fewest drafts: drafts other rows kept only make
        them finish early, which on a CPU saves little."""
        self.rows = num_accepted.numel()
        kept = num_accepted.tolist()
        per_row = [drafted] * len(kept) if isinstance(drafted, int) else list(drafted)
        width = max(per_row, default=0)
        drafting = width > 0 and source != "none"
        if drafting and draft_seconds is not None:
            self._check_price(source, width, target_tokens, draft_seconds + target_seconds)
        if target_tokens > 0:
            record(self.target, target_tokens, target_seconds)
        if not drafting:
            return
        if self.lockstep:
            least = min(range(len(kept)), key=lambda i: min(kept[i], per_row[i]))
            kept, per_row = [kept[least]], [per_row[least]]
        if draft_seconds is not None:
            record(self.draft, source, draft_seconds / (draft_calls or width))
        probe = self.probes.get(source)
        if target_tokens > 0:  # a round that also read the prompts says nothing of its rate
            self._deliver(source, sum(kept) / len(kept) + 1, (draft_seconds or 0.0) + target_seconds,
                          probe is not None and probe.pending)
        if probe is not None and probe.pending:  # the probe's outcome sets the ladder
            probe.observed(all(tau >= n for tau, n in zip(kept, per_row)))
        if source in self.scored and self.rows == 1:
            return
        pairs = list(zip(kept, per_row)) if not free else [
            (tau - free, n - free) for tau, n in zip(kept, per_row) if tau >= free and n > free]
        self._count(source, sum(min(tau, n) for tau, n in pairs),
                    sum(1 for tau, n in pairs if tau < n or n == 0))

    def _check_price(self, source: str, width: int, target_tokens: int, seconds: float) -> None:
        """A drafting round that cost more than _RECHECK times its price re-times T(1); not one
        whose pass size had not been seen (its price was a guess, `pricing.between`)."""
        cost = self.draft_seconds(source)
        if target_tokens not in self.target or cost is None or not self.plain_timed():
            return
        price = width * cost + self.target_seconds(target_tokens)
        if seconds > _RECHECK * price:
            self.target.pop(1, None)

    def _deliver(self, source: str, tokens: float, seconds: float, probe: bool) -> None:
        """The guard's record of a drafting round (tokens per row, seconds); a probe that beats
        a plain step starts the record afresh (the guard lifts)."""
        if seconds <= 0:
            return
        rounds = self.delivered.setdefault(source, [])
        if probe and self.plain_timed() and self._beats_plain(tokens, seconds):
            rounds.clear()
        rounds.append((tokens, seconds))
        del rounds[:-2 * _GUARD_ROUNDS]

    def delivers(self, source: str) -> bool:
        """The guard: false when this generation's last drafting rounds of `source` (at least
        _GUARD_ROUNDS) delivered fewer tokens per second than a plain step now does."""
        rounds = self.delivered.get(source, [])
        if len(rounds) < _GUARD_ROUNDS or not self.plain_timed():
            return True
        return self._beats_plain(*(sum(r[i] for r in rounds) for i in (0, 1)))

    def _beats_plain(self, tokens: float, seconds: float) -> bool:
        """Whether `tokens` per row in `seconds` is at least a plain step's rate now, 1 / T(1)."""
        return tokens / seconds >= 1 / self.target_seconds(1)

    def observe_evidence(self, evidence: dict[str, list[tuple[int, int]]]) -> None:
        """α from a drafter that scores itself against the committed tokens (prompt lookup:
        `NGramDrafter.evidence`, one row's hits and misses since the last round), at every
        position rather than only at drafted ones; such a source's α then ignores one-row
        rounds' own counts (the same positions, counted once). One row only: a hit rate is α
        where the row has a match, and in a batch a round drafts for rows without one too (each
        a rejection in `observe`), so batches keep counting rounds."""
        for source, rows in evidence.items():
            if len(rows) == 1:
                self.scored.add(source)
                self._count(source, *rows[0])

    def _count(self, source: str, accepted: int, rejected: int) -> None:
        stats = self._stats(source)
        stats.accepted, stats.rejected = stats.accepted + accepted, stats.rejected + rejected
        count_past(self.past.setdefault(source, [0, 0]), accepted, rejected)

    def observe_catch_up(self, source: str, seconds: float, tokens: int) -> None:
        """A round's draft first fed `tokens` it had missed (its lag) with a round in step's own,
        in `seconds`: the lag's cost is those seconds less one decode in step (`draft_seconds`),
        so a short catch-up, mostly that decode, does not price a long one."""
        if tokens > 0:
            in_step = self.draft_seconds(source) or 0.0
            record(self.catch_up, source, max(seconds - in_step, 0.0) / tokens)

    def observe_round(self, source: str, report, drafted=None) -> None:
        """Learn from a finished round (`Controller.observe_round`), and from the drafter's scores
        of itself and the draft's catch-up."""
        if report.evidence:
            self.observe_evidence(report.evidence)
        super().observe_round(source, report, drafted)
        if report.catch_up[1]:
            self.observe_catch_up(source, report.catch_up[0], report.lag)

    def choose(self, source: str, *, rows: int = 1, lag: int = 0, tokens_left: int | None = None,
               free: int = 0) -> int:
        """The γ for the next round of `rows` rows when `source` drafts it; `lag`: the tokens the
        draft must catch up on first, `tokens_left`: the most any row may still generate, `free`:
        the drafts every row keeps for certain before the γ chosen here: γ is then the tail after
        them, with no plain step to beat, and α the tail's. Nothing is recorded while it prices
        (`_pricing`)."""
        self.rows = rows
        with self._pricing():
            gamma, self.reason = self._choose(source, rows, lag, tokens_left, free)
        return gamma

    @contextmanager
    def _pricing(self):
        """Within it the pass and draft estimates are made once each, when first needed
        (`_once`), not for every γ priced: nothing is recorded while a round is priced."""
        if self._priced is not None:
            yield
            return
        self._priced = {}
        try:
            yield
        finally:
            self._priced = None

    def _once(self, key, make):
        """make(), kept under `key` while `_pricing`."""
        if self._priced is None:
            return make()
        if key not in self._priced:
            self._priced[key] = make()
        return self._priced[key]

    def _choose(self, source: str, rows: int, lag: int, tokens_left: int | None,
                free: int) -> tuple[int, str]:
        """γ and the reason for it (`reason`, the trace's words)."""
        if source == "none":
            return 0, "the drafter proposes nothing this round"
        if self.draft_seconds(source) is None:
            return START_GAMMA, f"first round of {source}: its cost is not known yet"
        if not self.plain_timed():
            return 0, "a plain step times T(1)"
        stats = self._stats(source)
        if free:  # the free drafts come anyway: the best tail after them, however short
            alpha = stats.alpha()
            gamma = max(range(self.longest(source) + 1), key=lambda g: self.rate(source, alpha, g, free))
            return gamma, f"{free} forced drafts, then the best tail at α {alpha:.2f}"
        scored = source in self.scored and rows == 1  # α from every committed token, free drafts
        alpha = stats.alpha()
        gamma = self.best_gamma(source, alpha, _MARGIN if scored else 1.0)
        if gamma > 0 and not self.catch_up_pays(source, alpha, gamma, lag, tokens_left):
            return 0, f"catching up on {lag} tokens costs more than drafting saves"  # no probes either
        probe = self.probes.setdefault(source, Probe())
        if gamma > 0 and (scored or self.delivers(source)):
            probe.reset()
            return gamma, f"the best γ at α {alpha:.2f} beats a plain step"
        if scored:  # its α is scored at every committed token and it costs nothing: no probes
            return 0, f"no γ beats a plain step at α {alpha:.2f}"
        could_pay = self.best_gamma(source, 1.0)
        if not probe.due(could_pay):
            return 0, (f"no γ beats a plain step at α {alpha:.2f}" if gamma == 0 else
                       f"its last drafting rounds delivered less than a plain step") + "; no probe due"
        if not self.catch_up_pays(source, 1.0, max(could_pay, 1), lag, tokens_left):
            return 0, f"catching up on {lag} tokens would cost more than drafting saves at α 1"
        # a probe keeps α and the draft's cost up to date
        gamma = probe.start(min(max(self.probe_gamma(source), probe.ladder), self.max_gamma))
        return gamma, f"a probe (α {alpha:.2f} scored, its estimate kept current)"

    def probe_gamma(self, source: str) -> int:
        """The γ of a probe: the best at an optimistic α (`Acceptance.optimistic`), so that
        where drafts are kept a probe is a block long enough to show it (a draft as dear as 0.4
        of a target pass, kept 99 % of the time, pays only in blocks of 8 or more, and a prior
        of 1/2 prices any block below a plain step); when even that α prices no drafting round
        above a plain step, the cheapest drafting round (on a CPU a pass of 2 tokens can cost
        more than one of 5, so a probe of γ = 1 is not always the cheap one). `choose` lengthens
        it to the probe ladder (`Probe`): after a probe kept whole, the next is twice as long."""
        gamma = self.best_gamma(source, self._stats(source).optimistic())
        if gamma > 0:
            return gamma
        cost = self.draft_seconds(source)
        return min(range(1, self.max_gamma + 1), key=lambda g: g * cost + self.target_seconds(g + 1))

    def catch_up_pays(self, source: str, alpha: float, gamma: int, lag: int,
                      tokens_left: int | None) -> bool:
        """Whether drafting at γ from now on saves, over the tokens left, more than
        _CATCH_UP_MARGIN times what the catch-up on `lag` tokens is expected to cost (true while
        that cost or the budget is unknown)."""
        if not lag or tokens_left is None or not self.catch_up.get(source):
            return True
        saved = tokens_left * (1 / self.rate(source, alpha, 0) - 1 / self.rate(source, alpha, gamma))
        return saved > _CATCH_UP_MARGIN * lag * estimate(self.catch_up[source])

    def min_drafts(self, source: str, gamma: int, free: int = 0) -> int:
        """The fewest drafts worth a target pass in a round of up to γ: a proposal of fewer (prompt
        lookup often finds only a short match) is expected to deliver fewer tokens per second
        than a plain step, so the round drops it. 0 (keep any proposal) before the costs are
        known; γ when no length up to γ pays: that round is a probe (`probe_gamma`), which only
        a proposal of its whole length makes worth its pass. 0 when the round has `free` drafts
        (they pay for its pass)."""
        if gamma == 0 or free or self.draft_seconds(source) is None or not self.plain_timed():
            return 0
        alpha = self._stats(source).alpha()
        with self._pricing():
            plain = self.rate(source, alpha, 0)
            return next((n for n in range(1, gamma + 1) if self.rate(source, alpha, n) >= plain), gamma)

    def plain_timed(self) -> bool:
        """Whether T(1) has _PLAIN_SAMPLES samples at this batch size (its estimate is the smallest
        of them; drafting rounds get many samples, fewer would bias it towards drafting)."""
        return len(self.target.get(1, ())) >= _PLAIN_SAMPLES

    def best_gamma(self, source: str, alpha: float, margin: float = 1.0) -> int:
        """The γ of the highest `rate`, up to _STEADY_GAMMA unless the costs are steady; 0 (a
        plain step) unless that rate beats a plain step's `margin` times."""
        best = max(range(1, self.longest(source) + 1), key=lambda g: self.rate(source, alpha, g))
        return best if self.rate(source, alpha, best) > margin * self.rate(source, alpha, 0) else 0

    def longest(self, source: str) -> int:
        """max_gamma while T(1) and the draft's cost are steady, else at most _STEADY_GAMMA."""
        plain = self.target.get(1, [])
        costs = self.draft.get(source, [])
        if steady(plain) and steady(costs, floor=0.02 * estimate(plain)):
            return self.max_gamma
        return min(self.max_gamma, _STEADY_GAMMA)

    def rate(self, source: str, alpha: float, gamma: int, free: int = 0) -> float:
        """Expected output tokens per second of a round with γ drafts after `free` certain ones."""
        tokens = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)  # E[N]
        return (free + tokens) / (gamma * self.draft_seconds(source)
                                  + self.target_seconds(free + gamma + 1))

    def target_seconds(self, k: int) -> float:
        """T(k) at this batch size: measured when k was seen, else `pricing.between` the sizes
        seen (outliers set aside: `pricing.pass_estimates`)."""
        seen = self._once(None, self.pass_estimates)  # None: no source's name
        return seen[k] if k in seen else between(seen, k)

    def pass_estimates(self) -> dict[int, float]:
        """k → the estimate of a k-token pass at this batch size, outliers set aside."""
        return pass_estimates(self.target)
