"""Adaptive γ: before each round, the γ that maximizes expected output tokens per expected second.

The controller keeps, from rounds already run (the past-only rule, so the output stays exact):
- T(k): the seconds of a target pass over k tokens per row, per k and per batch size (rows in
  the pass: a batch's rows end at different rounds, and a pass over 8 rows costs more than over
  1), and for the k not seen yet a line between the nearest sizes seen;
- the draft's seconds per proposed token, per source ("model", "ngram", ...) and batch size (a
  batch size not seen yet takes the nearest one's);
- a model draft's catch-up seconds per token: after rounds it sat out (and for the prompt) it
  feeds the tokens it missed before drafting, so it drafts only if what drafting saves over the
  tokens left to generate pays for that twice over (`_CATCH_UP_MARGIN`);
- α per source: kept drafts / (kept drafts + rejections) in this generation, the geometric
  model's estimate, starting from a uniform prior; for prompt lookup on one row, which can score
  itself against every committed token (`NGramDrafter.evidence`), hits / (hits + misses) instead.

Timings follow the machine as it is now: each estimate is the median of its last _RECENT
samples, so a change in cost (another process taking a core, or leaving it) shows within three
rounds, and one outlier either way (a first call's set-up, a descheduled moment) does not move
it; a k-token pass slower than k one-token passes is set aside as an outlier, and the draft's
cost is per forward pass of its model (a catch-up pass counts once). A drafting round that took
more than _RECHECK times its price re-times T(1) (its samples are dropped, so the next rounds
are plain steps that measure it again): what every round is weighed against must be as current
as the rounds themselves. Blocks longer than _STEADY_GAMMA are chosen only while T(1) and the
draft's cost are steady (recent samples within _STEADY_SPREAD of each other): a long block
priced at a quiet moment is the costliest mistake when the machine gets busy.

The guard: within a generation, a source whose last drafting rounds (at least _GUARD_ROUNDS of
them) delivered fewer tokens per second than a plain step does now (1 / T(1)) stops drafting;
its probes (below) still run, and a probe round that beats a plain step lets it draft again.
(Not for a one-row source that scores itself, prompt lookup: its α is measured at every token
and its drafts cost nothing, so its price is what its rounds deliver but for the pass's cost;
for that it drafts only when a round promises _MARGIN times a plain step's rate.)

It picks γ in 0..max_gamma maximizing E[N](α, γ) / (γ · c_draft + T(γ + 1)), where
E[N] = Σ_{k=0..γ} α^k and γ = 0 is a plain step (one token per T(1)).

A round whose first `free` drafts are kept with certainty (a grammar round's forced tokens: p = 1
under the mask) drafts them whatever γ is, so γ is the tail after them: it maximizes
(free + E[N](α, γ)) / (γ · c_draft + T(free + γ + 1)), with no plain step to beat, and α is the
tail's (the forced drafts, always kept, would price a long tail as if it were always kept too).

Before rounds at a batch size are priced, T(1), what every round is weighed against, is timed
with _PLAIN_SAMPLES plain steps (they cost nothing against plain decoding; fewer would leave T(1)
the smallest of fewer samples than the drafting rounds' T(k), biased towards drafting); before
anything is known of a draft its first round drafts START_GAMMA tokens.

When γ = 0 wins it still probes now and then (but not for prompt lookup, whose α keeps coming
from its scores of itself), with the γ that would be best at an optimistic α (`probe_gamma`),
doubled after each probe the draft kept whole, so a drop to γ = 0 is never permanent and a
draft that pays only in long blocks gets them: after 4, 8, 16 and then every 32 plain steps while drafting could pay
at a better α, and every 64 while it could not pay even if every draft were kept (then only
the timings can change the answer); plain steps count across generations, so short generations
probe too. Timings are remembered for the process (`shared`), held for the target model itself
(a weak reference: they go with it, and a model loaded later in its place starts afresh) and the
drafter's name, so a second generation starts from the first one's costs; so is
acceptance, but only as a prior worth _PRIOR_DRAFTS drafts: α belongs to the text, and a few of
this generation's drafts outweigh it.
"""
from __future__ import annotations

import statistics
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

AUTO = "auto"
MAX_GAMMA = 32  # the longest block anyone may ask for
AUTO_MAX_GAMMA = MAX_GAMMA  # the longest the controller chooses (free drafts kept ~always:
# on a 2-core CPU a pass over 33 tokens costs 1.6x one over 9 and yields up to 3.7x the tokens)
START_GAMMA = 4  # a source's first round, before its cost is known
_RECENT = 5  # an estimate is the median of this many latest samples
_RECHECK = 1.5  # a drafting round dearer than this times its price re-times T(1)
# A source that scores itself (no guard: see below) drafts only when a round promises this many
# times a plain step's tokens per second: its price is made of medians, and what rounds cost on
# average is more (a busy moment, a thread count being tried); on open prompts beside a busy
# process lookup rounds priced at break-even lost 12 %.
_MARGIN = 1.1
_STEADY_GAMMA = 8  # longer blocks only while costs are steady
_STEADY_SPREAD = 1.5  # steady: the largest recent sample at most this times the smallest
# Drafting after a catch-up must save this many times the catch-up's expected cost: its cost per
# token swings with the lag's length and the machine (the bundled model's bfloat16 copy read 44
# and 40 tokens at 13.5 and 29 ms a token, a minute apart), and a wrong yes pays the whole
# catch-up while a wrong no forgoes at most half of what drafting would save (seen in an idle
# bench: a probe's catch-up of 40 tokens priced at 0.54 s took 1.17 s).
_CATCH_UP_MARGIN = 2.0
_GUARD_ROUNDS = 4  # drafting rounds of a source in a generation before the guard judges them
_PLAIN_SAMPLES = 3  # T(1) is timed this many times at a batch size before rounds are priced there
_PRIOR_SLOPE = 0.05  # past the pass sizes seen, a token costs this share of the cheapest pass
_FIRST_PROBE, _LAST_PROBE, _REFRESH_PROBE = 4, 32, 64
_PROBE_QUANTILE = 0.9  # a probe's γ is the best at this quantile of α's posterior (probe_gamma)

_PRIOR_DRAFTS = 2  # a generation's α starts from a prior worth this many drafts
_PAST_WINDOW = 256  # past generations' drafts per source, after which older ones weigh half


@dataclass
class _Memory:
    """What the process remembers of one target model: T(k) per batch size, and per drafter
    name the draft's cost per token per batch size and source, its catch-up cost per token,
    [kept, rejected] per source, its probe schedules and the sources that score themselves."""

    target: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    drafters: dict[str, dict[str, object]] = field(default_factory=dict)

    def drafter(self, name: str) -> dict[str, object]:
        return self.drafters.setdefault(name, dict(draft={}, catch_up={}, past={}, probes={},
                                                   scored=set()))


_MEMORY: "weakref.WeakKeyDictionary[object, _Memory]" = weakref.WeakKeyDictionary()


def memory(model) -> _Memory:
    """The timings and acceptance kept for `model` (a target), for as long as it lives."""
    if model not in _MEMORY:
        _MEMORY[model] = _Memory()
    return _MEMORY[model]


def _record(samples: dict, key, seconds: float) -> None:
    recent = samples.setdefault(key, [])
    recent.append(seconds)
    del recent[:-_RECENT]


def estimate(samples: list[float]) -> float:
    """The median of the recent samples: current, and robust to one outlier either way."""
    return statistics.median(samples)


def steady(samples: list[float], floor: float = 0.0) -> bool:
    """Whether recent samples agree: at least 3, the largest within _STEADY_SPREAD times the
    smallest (or within `floor` seconds of it: costs too small to matter)."""
    return len(samples) >= 3 and max(samples) <= max(_STEADY_SPREAD * min(samples), min(samples) + floor)


@dataclass
class _Probe:
    """When a source probes next, and how long: `plain` steps since its last probe, the next one
    `after` that many; `ladder`: twice the last probe's γ when the draft kept all of it (a
    doubling search for the block length that shows what the draft is worth), else 0;
    `pending`: the γ of a probe not yet observed."""

    plain: int = 0
    after: int = _FIRST_PROBE
    ladder: int = 0
    pending: int = 0


@dataclass
class _Acceptance:
    """Kept and rejected drafts of one source in this generation.
    α starts from `prior`, weighted as _PRIOR_DRAFTS drafts: the α of past generations with the
    same drafter when there were any, else 1/2 (a uniform prior)."""

    accepted: int = 0
    rejected: int = 0
    prior: float = 0.5

    def alpha(self) -> float:
        return (self.accepted + _PRIOR_DRAFTS * self.prior) / (self.accepted + self.rejected + _PRIOR_DRAFTS)


@dataclass
class GammaController:
    """Chooses γ per round from past timings and acceptances (see the module docstring)."""

    max_gamma: int = AUTO_MAX_GAMMA
    target_by_rows: dict[int, dict[int, list[float]]] = field(default_factory=dict)  # rows → k → s
    draft_by_rows: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # rows → source → s/token
    catch_up: dict[str, list[float]] = field(default_factory=dict)  # source → seconds per token
    acceptance: dict[str, _Acceptance] = field(default_factory=dict)
    past: dict[str, list[int]] = field(default_factory=dict)  # source → [kept, rejected] before
    probes: dict[str, "_Probe"] = field(default_factory=dict)  # source → its probe schedule
    rows: int = 1  # the batch size of the round being chosen (set by `choose`)
    lockstep: bool = False  # a fixed batch, done when its slowest row is: see `observe`
    scored: set[str] = field(default_factory=set)  # sources whose one-row α is `observe_evidence`'s
    # this generation's drafting rounds per source: (tokens per row, seconds), for the guard
    delivered: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    _priced: dict | None = field(default=None, repr=False)  # estimates made while `_pricing`

    @classmethod
    def shared(cls, target, drafter_name: str) -> GammaController:
        """A controller whose timings persist across generations with the same target model (the
        object: `memory`) and drafter name, and whose α starts from the past generations' (see
        `_Acceptance`); so does which sources score themselves, so that a generation's first
        rounds do not probe them."""
        kept = memory(target)
        drafter = kept.drafter(drafter_name)
        return cls(target_by_rows=kept.target, draft_by_rows=drafter["draft"],
                   catch_up=drafter["catch_up"], past=drafter["past"], probes=drafter["probes"],
                   scored=drafter["scored"])

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

    def _stats(self, source: str) -> _Acceptance:
        if source not in self.acceptance:
            kept, rejected = self.past.get(source, (0, 0))
            prior = (kept + 1) / (kept + rejected + 2) if kept + rejected else 0.5
            self.acceptance[source] = _Acceptance(prior=prior)
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
            _record(self.target, target_tokens, target_seconds)
        if not drafting:
            return
        if self.lockstep:
            least = min(range(len(kept)), key=lambda i: min(kept[i], per_row[i]))
            kept, per_row = [kept[least]], [per_row[least]]
        if draft_seconds is not None:
            _record(self.draft, source, draft_seconds / (draft_calls or width))
        probe = self.probes.get(source)
        if target_tokens > 0:  # a round that also read the prompts says nothing of its rate
            self._deliver(source, sum(kept) / len(kept) + 1, (draft_seconds or 0.0) + target_seconds,
                          probe is not None and probe.pending)
        if probe is not None and probe.pending:  # the probe's outcome sets the ladder
            whole = all(tau >= n for tau, n in zip(kept, per_row))
            probe.ladder = 2 * probe.pending if whole else 0
            probe.pending = 0
        if source in self.scored and self.rows == 1:
            return
        pairs = list(zip(kept, per_row)) if not free else [
            (tau - free, n - free) for tau, n in zip(kept, per_row) if tau >= free and n > free]
        self._count(source, sum(min(tau, n) for tau, n in pairs),
                    sum(1 for tau, n in pairs if tau < n or n == 0))

    def _check_price(self, source: str, width: int, target_tokens: int, seconds: float) -> None:
        """A drafting round that cost more than _RECHECK times its price re-times T(1)."""
        cost = self.draft_seconds(source)
        if target_tokens <= 0 or cost is None or not self.plain_timed():
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
        stats, past = self._stats(source), self.past.setdefault(source, [0, 0])
        stats.accepted, stats.rejected = stats.accepted + accepted, stats.rejected + rejected
        past[0], past[1] = past[0] + accepted, past[1] + rejected
        if sum(past) > _PAST_WINDOW:
            past[0], past[1] = past[0] // 2, past[1] // 2

    def observe_catch_up(self, source: str, seconds: float, tokens: int) -> None:
        """A round's draft first fed `tokens` it had missed (its lag), in `seconds`."""
        if tokens > 0:
            _record(self.catch_up, source, seconds / tokens)

    def choose(self, source: str, rows: int = 1, lag: int = 0, tokens_left: int | None = None,
               free: int = 0) -> int:
        """The γ for the next round of `rows` rows when `source` drafts it; `lag`: the tokens the
        draft must catch up on first, `tokens_left`: the most any row may still generate, `free`:
        the drafts every row keeps for certain before the γ chosen here (see the module's
        docstring). Nothing is recorded while it prices (`_pricing`)."""
        self.rows = rows
        with self._pricing():
            return self._choose(source, rows, lag, tokens_left, free)

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

    def _choose(self, source: str, rows: int, lag: int, tokens_left: int | None, free: int) -> int:
        if source == "none":
            return 0
        if self.draft_seconds(source) is None:
            return START_GAMMA
        if not self.plain_timed():
            return 0  # a plain step times T(1)
        stats = self._stats(source)
        if free:  # the free drafts come anyway: the best tail after them, however short
            alpha = stats.alpha()
            return max(range(self.longest(source) + 1), key=lambda g: self.rate(source, alpha, g, free))
        scored = source in self.scored and rows == 1  # α from every committed token, free drafts
        gamma = self.best_gamma(source, stats.alpha(), _MARGIN if scored else 1.0)
        if gamma > 0 and not self.catch_up_pays(source, stats.alpha(), gamma, lag, tokens_left):
            return 0  # sitting out only adds to the lag: no probes either
        probe = self.probes.setdefault(source, _Probe())
        if gamma > 0 and (scored or self.delivers(source)):
            probe.plain, probe.after, probe.ladder = 0, _FIRST_PROBE, 0
            return gamma
        if scored:
            return 0  # its α is scored at every committed token and it costs nothing: no probes
        probe.plain += 1
        could_pay = self.best_gamma(source, 1.0)
        if probe.plain < (probe.after if could_pay else _REFRESH_PROBE):
            return 0
        if not self.catch_up_pays(source, 1.0, max(could_pay, 1), lag, tokens_left):
            return 0  # even if every draft were kept, catching up would cost more than it saves
        probe.plain, probe.after = 0, min(2 * probe.after, _LAST_PROBE)
        probe.pending = min(max(self.probe_gamma(source), probe.ladder), self.max_gamma)
        return probe.pending  # a probe keeps α and the draft's cost up to date

    def probe_gamma(self, source: str) -> int:
        """The γ of a probe: the best at an optimistic α, the _PROBE_QUANTILE quantile of α's
        Beta posterior (the point estimate's kept and rejected counts with its prior), so that
        where drafts are kept a probe is a block long enough to show it (a draft as dear as 0.4
        of a target pass, kept 99 % of the time, pays only in blocks of 8 or more, and a prior
        of 1/2 prices any block below a plain step); when even that α prices no drafting round
        above a plain step, the cheapest drafting round (on a CPU a pass of 2 tokens can cost
        more than one of 5, so a probe of γ = 1 is not always the cheap one). `choose` lengthens
        it to the probe ladder (`_Probe`): after a probe kept whole, the next is twice as long."""
        from scipy.special import betaincinv

        stats = self._stats(source)
        optimistic = float(betaincinv(stats.accepted + _PRIOR_DRAFTS * stats.prior,
                                      stats.rejected + _PRIOR_DRAFTS * (1 - stats.prior),
                                      _PROBE_QUANTILE))
        gamma = self.best_gamma(source, optimistic)
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
        """T(k): measured when k was seen, else read off a line between the nearest sizes seen
        on either side; past the sizes seen, each further token costs _PRIOR_SLOPE of the
        cheapest pass. Not a line through all sizes: on a CPU a pass of 2 or 3 tokens can cost
        more than one of 4 to 8 (other matrix kernels), and such a fit would price long blocks
        far too high. A size whose pass took longer than k one-token passes is set aside as an
        outlier (a first call's set-up, a busy moment) until it is measured again within that
        bound."""
        seen = self._once(None, self.pass_estimates)  # None: no source's name
        return seen[k] if k in seen else _between(seen, k)

    def pass_estimates(self) -> dict[int, float]:
        """k → the estimate of a k-token pass at this batch size, outliers set aside (see
        `target_seconds`)."""
        seen = {size: estimate(samples) for size, samples in self.target.items()}
        if 1 in seen:
            seen = {size: t for size, t in seen.items() if t <= size * seen[1]}
        return seen


def _between(seen: dict[int, float], k: int) -> float:
    """The seconds of a k-token pass from the (size, seconds) seen at other sizes."""
    below = max((s for s in seen if s < k), default=None)
    above = min((s for s in seen if s > k), default=None)
    if below is not None and above is not None:
        return seen[below] + (seen[above] - seen[below]) * (k - below) / (above - below)
    per_token = _PRIOR_SLOPE * min(seen.values())
    if below is not None:
        return seen[below] + per_token * (k - below)
    return max(seen[above] - per_token * (above - k), per_token)


def observe_round(controller, source: str, report, drafted=None) -> None:
    """The controller learns from a finished round, `exactspec.engine.Round` (drafted: each row's
    drafts, when rows differ), and a GammaController also from the drafter's scores of itself,
    the round's free drafts and the draft's catch-up."""
    draft_seconds, draft_calls = report.draft_cost()
    facts = (source, report.drafted if drafted is None else drafted, report.num_accepted,
             report.target_tokens, draft_seconds, report.target_seconds, draft_calls)
    if not isinstance(controller, GammaController):
        controller.observe(*facts)
        return
    if report.evidence:
        controller.observe_evidence(report.evidence)
    controller.observe(*facts, free=report.free)
    if report.catch_up[1]:
        controller.observe_catch_up(source, report.catch_up[0], report.lag)
