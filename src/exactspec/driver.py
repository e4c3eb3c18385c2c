"""The one round loop: `speculative_generate`, the server's scheduler and a tensor-parallel leader
(a `Decoder` that sends each step to its followers) all run rounds through `Driver.step`."""
from __future__ import annotations

from exactspec.policy import Choice, Controller
from exactspec.rows import round_source


class Driver:
    """Runs a decoder's rounds: before each, the policy's `Choice` for the decoder's `Situation`
    (rank 0's holds on every rank: `Decoder.agree`); the round; then the policy observes it, the rounds and kept
    drafts are counted per source, and `on_round` gets the round's `trace_line`. Without a policy,
    or when no row's γ is "auto", the round's γ is the fixed `gamma` (rows of a continuous batch
    with a fixed γ keep their own)."""

    def __init__(self, decoder, policy: Controller | None = None, gamma: int = 0, on_round=None):
        self.decoder, self.policy, self.gamma, self.on_round = decoder, policy, gamma, on_round
        self.rounds_by_source: dict[str, int] = {}  # "plain": rounds with no drafts
        self.kept_by_source: dict[str, int] = {}

    def run(self) -> None:
        """Rounds until every row is done."""
        with self.decoder.lm.threads():
            while not self.decoder.done:
                self.step()

    def step(self):
        """One round; returns its report (`engine.Round`)."""
        decoder = self.decoder
        choice = self.choose(decoder.drafter.next_source())
        report = decoder.step(choice.gamma, choice.min_drafts)
        decoder.after_round()
        if self.policy is not None:
            self.policy.observe_round(choice.source, report, decoder.row_drafts())
        kind = round_source(choice.source, report.drafted)
        self.rounds_by_source[kind] = self.rounds_by_source.get(kind, 0) + 1
        self.kept_by_source[kind] = self.kept_by_source.get(kind, 0) + int(report.num_accepted.sum())
        if self.on_round is not None:
            self.on_round(trace_line(decoder.rounds, kind, choice, report))
        return report

    def choose(self, source: str) -> Choice:
        if self.policy is None:
            return Choice.fixed(self.gamma, source)
        if not self.decoder.auto_rows():
            return Choice.fixed(0, source, "every row has a fixed γ")
        return self.decoder.agree(self.policy.decide(self.decoder.situation(source)))


def trace_line(number: int, source: str, choice: Choice, report) -> dict:
    """One round in the trace (`--trace FILE`, one JSON line each): who drafted ("plain": no
    drafts), the γ chosen and why, the drafts proposed and kept over all rows, and the seconds
    of the draft and of the target's pass."""
    reason = choice.reason
    if choice.gamma and not report.drafted:
        reason += "; no drafts came (no proposal, or fewer than min_drafts)"
    return {"round": number, "source": source, "gamma": choice.gamma,
            "min_drafts": choice.min_drafts, "reason": reason,
            "rows": int(report.num_accepted.numel()), "drafted": report.drafted,
            "kept": int(report.num_accepted.sum()), "draft_seconds": round(report.draft_seconds, 6),
            "pass_seconds": round(report.target_seconds, 6)}
