"""Speculative and plain autoregressive generation with real Hugging Face models: the round loop.

A round: the drafter proposes γ tokens x_1..x_γ per row with their q; the target scores
[last committed token, x_1..x_γ] of every row in one pass, giving p_1..p_{γ+1}; `verify_block`
keeps a prefix of each row's drafts and adds one correction or bonus token. Rows keep different
numbers of tokens; the target forgets what a row did not keep (`exactspec.targets`: the target
protocol, with a Hugging Face model's KV cache or a llama.cpp context behind it). The first
round's pass scores the whole prompt and its γ drafts at once (`Scorer`); after that each row's
cache holds its committed tokens minus the last one (the correction or bonus), and a round feeds
exactly γ+1 tokens per row. Plain decoding is the same loop with no drafter (γ = 0: each round
draws the bonus token from p).

Rows that end (EOS or their token budget) leave the batch, so they stop costing compute.
A row's output is exact however it is cut: a prefix of an exact sample is an exact sample.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from exactspec import distributed
from exactspec.batching import DRAFT, ContinuousBatching, SharedSettings, left_pad
from exactspec.controller import AUTO, MAX_GAMMA, Controller, GammaController
from exactspec.policy import Situation
from exactspec.constraints import RowMatchers, as_constraint
from exactspec.drafters import Drafter, Proposal, make_drafter
from exactspec.driver import Driver, trace_line  # noqa: F401 (trace_line: part of the API)
from exactspec.logprobs import TokenLogprob, check_logprobs_args
from exactspec.models import check_context, eos_token_ids, unwrap_model
from exactspec.models.loaded import memory_of
from exactspec.rows import DecodeStats, EndRow, Rows  # noqa: F401 (EndRow: part of the API)
from exactspec.sampling import SamplingConfig
from exactspec.targets import Scorer, make_target
from exactspec.verify import VERIFY_RULES, verify_block



@dataclass
class GenerateOutput:
    """sequences: LongTensor[B, L + n], each row's prompt followed by its new tokens; a list of
    per-row LongTensors when rows differ in length (prompts of different lengths, or rows that
    ended early). stats: the whole batch; row_stats: one DecodeStats per row; rounds_by_source:
    how many rounds each way of drafting proposed ("model", "ngram", "grammar"), and "plain" for
    rounds with no drafts."""

    sequences: torch.Tensor | list[torch.Tensor]
    stats: DecodeStats = field(default_factory=DecodeStats)
    row_stats: list[DecodeStats] = field(default_factory=list)
    rounds_by_source: dict[str, int] = field(default_factory=dict)
    kept_by_source: dict[str, int] = field(default_factory=dict)  # drafts kept, per source
    constraint_seconds: float = 0.0  # spent in the grammar's matchers (`exactspec.constraints`)
    # per row, one TokenLogprob per new token (`exactspec.logprobs`); None unless logprobs=N
    logprobs: list[list[TokenLogprob]] | None = None


# --------------------------------------------------------------------------- set-up and checks


def check_generation_args(input_ids: torch.Tensor, max_new_tokens: int,
                          gamma: int | None = None) -> None:
    """Raise ValueError naming the first bad argument of a generation."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor[B, L]")
    if input_ids.size(1) == 0 or input_ids.size(0) == 0:
        raise ValueError(f"the prompt is empty: input_ids has shape {tuple(input_ids.shape)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    if gamma is None or gamma == AUTO or isinstance(gamma, Controller):
        return  # a controller checks its own choices
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must be an integer in [1, {MAX_GAMMA}] or 'auto', got {gamma!r}")


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """Passed randomness: never global. No seed: a fresh, nondeterministic one."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def synchronize(device: torch.device) -> None:
    """Wait for the accelerator before reading a clock (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_id, target) -> set[int]:
    """The ids that end a generation: as given, else the target's tokenizer and configs say."""
    if eos_token_id is None:
        return set(eos_token_ids(target))
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def pad_prompts(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids[B, L] and attention_mask[B, L] of 1-D prompts, left-padded with id 0."""
    width = max(len(prompt) for prompt in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    return ids, mask


class _Clock:
    """Wall time, synchronizing the accelerator before each reading."""

    def __init__(self, device: torch.device):
        self.device = device
        synchronize(device)
        self.start = time.perf_counter()

    def read(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self.start


@dataclass
class Round:
    """What one round did, for whoever chooses the next γ: the drafts proposed per row (γ'),
    each row's τ, the target's tokens per row in its pass, and the seconds each model took."""

    drafted: int
    num_accepted: torch.Tensor
    target_tokens: int
    draft_seconds: float
    target_seconds: float
    draft_calls: int = 0  # forward passes of the draft's own model in this round
    catch_up: tuple[float, int] = (0.0, 0)  # of those: the seconds and passes of catching up
    lag: int = 0  # the tokens the draft had to catch up on (see `drafters.base.lag`)
    evidence: dict = field(default_factory=dict)  # the drafter's scores of itself (`Drafter.evidence`)
    free: int = 0  # drafts every row kept for certain, first in its block (`Drafter.free`)

    def draft_cost(self) -> tuple[float | None, int]:
        """The draft's seconds and passes without its catch-up (a one-off cost after rounds it sat
        out): what the controller learns a drafting round costs; seconds None when the catch-up
        was the round's only pass (nothing to learn the cost from)."""
        calls = self.draft_calls - self.catch_up[1]
        if self.catch_up[1] and calls == 0:
            return None, 0
        return self.draft_seconds - self.catch_up[0], calls


class Decoder(ContinuousBatching):
    """The round loop's state over B rows: the target's cache, the drafter, the rows.

    `step(gamma)` runs one round; `generate` drives it until every row is done."""

    def __init__(self, target, drafter: Drafter, input_ids, attention_mask, *, max_new_tokens: int,
                 sampling: SamplingConfig, seed, eos_token_id, verify: str, on_tokens,
                 constraint=None, logprobs: int | None = None, logprobs_mode: str = "raw"):
        model, tokenizer, name = unwrap_model(target, "target")
        ids, valid = left_pad(input_ids, attention_mask)
        check_context(model, name, ids.size(1) + max_new_tokens)
        vocab = drafter.bind((model, tokenizer), ids.size(1) + max_new_tokens)
        self.memory = memory_of(target)  # what generations with this target remember
        self.lm = make_target(model, name, vocab, ids.size(0), self.memory)  # `exactspec.targets`
        self.ids, self.valid = ids.to(self.lm.device), valid.to(self.lm.device)
        self.drafter, self.sampling = drafter, sampling
        self.logprobs_mode = logprobs_mode  # "raw" or "processed" (`exactspec.logprobs`)
        generator = _generator(distributed.agree_seed(seed), self.lm.device)  # same on every rank
        self.prompt_lengths = self.valid.sum(dim=1).tolist()  # per row, for absolute positions
        self.prompts = list(zip(self.ids, self.valid))  # per row: its prompt row as given, its mask
        self.clock = _Clock(self.lm.device)
        eos = _eos_set(eos_token_id, (model, tokenizer))
        self.rows = Rows(ids.size(0), max_new_tokens, eos, self.clock, on_tokens)
        self.settings = SharedSettings(sampling, generator, verify, self.rows.budget_left, logprobs)
        self.matchers = RowMatchers(tokenizer, vocab, eos, self.memory)  # each row's grammar, if any
        self.constrain([as_constraint(constraint)] * ids.size(0))
        self.scorer = Scorer(self.lm, self.ids, self.valid)
        self.drafter.start(self.ids, self.valid, vocab)  # the grammar's drafter, if constrained
        for stats in self.rows.stats:  # every row took part in the prefills
            stats.target_calls, stats.draft_calls = self.lm.calls, drafter.calls
        self.last = self.ids[:, -1]  # [B], each row's last committed token
        self.rounds = 0
        self.done = max_new_tokens == 0

    def step(self, gamma: int, min_drafts: int = 0) -> Round:
        """One round with at most γ drafts per row (fewer near the end of the budget). A proposal
        shorter than min_drafts (in its longest row) is dropped, and the round is a plain step:
        the drafter sees its drafts rejected. That reads only the draft's own output, so the round
        stays exact."""
        lm, drafter, rows = self.lm, self.drafter, self.rows
        block = self._block(gamma)  # the longest budget left decides
        calls_before, started, lag = (lm.calls, drafter.calls), self.clock.read(), drafter.lag()
        free, source = drafter.free(), drafter.next_source()  # decided before the round (rule 7)
        # 1. draft: up to γ tokens per row, with the q they were drawn from
        sampling = self._settings()  # bound to each row's prefix when its processing reads it
        proposal = drafter.propose(block, sampling, self._stream(DRAFT))
        if proposal.tokens.size(1) < min_drafts:  # too short to pay for its target pass
            proposal = Proposal(proposal.tokens[:, :0], None)  # [b, 0]
        drafts = proposal.tokens.to(lm.device)  # [b, γ']
        drafted_at, fed_before, prefill = self.clock.read(), lm.tokens_fed, self.scorer.pending
        # 2. score: one target pass over the last committed token and the drafts (the first
        #    round's over the prompts and the drafts: its time says nothing of T(k), target_tokens 0)
        logits = self.scorer.score(self.last, drafts)  # [b, γ'+1, V]
        p = sampling.probs(logits, drafts=drafts)  # [b, γ'+1, V]
        scored_at, catch_up = self.clock.read(), drafter.catch_up
        draft_calls = drafter.calls - calls_before[1]
        fed = 0 if prefill else (lm.tokens_fed - fed_before) // drafts.size(0)
        # 3. verify: keep a prefix of the drafts, then one correction or bonus token
        result = self._verify(proposal, drafts, p)
        tau = result.num_accepted  # [b]
        self.last = result.tokens.gather(1, tau.unsqueeze(1)).squeeze(1)  # [b], correction or bonus
        # 4. roll back: drafts after a rejection leave the target's cache (stop at the first rejection)
        lm.discard_last(drafts.size(1) - tau)
        # 5. commit: the drafter learns what was kept; the rows record what was emitted
        drafter.commit(tau, self.last)
        report = Round(drafted=drafts.size(1), num_accepted=tau, target_tokens=fed,
                       draft_seconds=drafted_at - started, target_seconds=scored_at - drafted_at,
                       draft_calls=draft_calls, catch_up=catch_up, lag=lag,
                       evidence=drafter.evidence(), free=free)
        self.rounds += 1
        going = rows.record(result, self._drafted(proposal, drafts), lm.calls - calls_before[0],
                            drafter.calls - calls_before[1], self._logprobs(logits, p, result), source)
        self.matchers.advance([rows.new[row] for row in rows.active.tolist()])
        # 6. retire finished rows: they leave both caches
        self._retire(going)
        return report

    def _settings(self):
        """This round's sampling settings. Settings that read the tokens before each position
        (`needs_prefix`: Transformers' logits processors, penalties) are bound to the active rows:
        each row's index, committed tokens (its prompt row as given, left padding included, then
        its new tokens), prompt tokens (no padding) and new tokens; the drafter and the target then
        pass the drafts before each position. Rows with a constraint then get their grammar's
        masks first (`constraints.Masked`)."""
        sampling = self.sampling
        if sampling.needs_prefix:
            active = self.rows.active.tolist()
            new = [self.ids.new_tensor(self.rows.new[row]) for row in active]
            prompts = [self.prompts[row] for row in active]  # (prompt row, mask)
            sampling = sampling.after(self.rows.active, [torch.cat([ids, n]) for (ids, _), n in
                                                         zip(prompts, new)],
                                      prompts=[ids[valid] for ids, valid in prompts], generated=new)
        return self.matchers.bind(sampling) if self.matchers else sampling

    def _retire(self, going: torch.Tensor) -> None:
        if going.numel() == self.rows.active.numel():
            return
        self.rows.active, self.last = self.rows.active[going], self.last[going]
        self.done = going.numel() == 0
        self.settings.select(going)
        self.sampling = self.settings.sampling()
        self.matchers.select(going)
        if not self.done:
            self.scorer.prefill()  # rows cancelled before the first round: the prompts first
            self.lm.select(going)
            self.drafter.select(going)

    def situation(self, source: str) -> Situation:
        """What the policy weighs besides past rounds (`policy.Situation`) when `source` drafts
        the next round."""
        return Situation(source, rows=self.rows.active.numel(), lag=self.drafter.lag(),
                         tokens_left=self.rows.budget_left(), free=self.drafter.free())

    def agree(self, choice):
        """Rank 0's choice on every rank (tensor-parallel generation; one process: `choice`)."""
        return distributed.from_leader(choice)

    def after_round(self) -> None:
        """Every rank committed the same tokens (EXACTSPEC_TP_CHECK=round, the debug mode)."""
        distributed.check_round(self.rows.new, self.rounds)

    def output(self) -> GenerateOutput:
        out = _output(self.ids, self.valid, self.rows, self.lm, self.drafter, self.rounds,
                      self.clock.read())
        out.logprobs = None if self.settings.logprobs is None else self.rows.logprobs
        return out


def _generate(target, drafter: Drafter, input_ids, attention_mask, *, gamma: int | str,
              on_round=None, **settings) -> GenerateOutput:
    """The round loop shared by speculative and plain decoding (`driver.Driver`). gamma "auto" (a
    `GammaController`) or a controller object picks each round's γ from the rounds before it
    (the past-only rule). `on_round(line)` gets each round's `driver.trace_line`."""
    decoder = Decoder(target, drafter, input_ids, attention_mask, **settings)
    policy = gamma if isinstance(gamma, Controller) else None
    if gamma == AUTO:  # timings carry over between generations with the same target and drafter
        policy = GammaController.shared(decoder.memory, drafter.name)
        policy.lockstep = decoder.ids.size(0) > 1
    driver = Driver(decoder, policy, 0 if policy else gamma, on_round)
    driver.run()
    distributed.check_same(decoder.rows.new, "the end")  # tensor-parallel ranks agree
    out = decoder.output()
    out.rounds_by_source, out.kept_by_source = driver.rounds_by_source, driver.kept_by_source
    out.constraint_seconds = decoder.matchers.seconds
    return out


def _output(ids, valid, rows: Rows, lm, drafter, rounds: int,
            wall: float) -> GenerateOutput:
    sequences = [torch.cat([prompt[ok], prompt.new_tensor(new)])
                 for prompt, ok, new in zip(ids, valid, rows.new)]
    if len({len(s) for s in sequences}) == 1:
        sequences = torch.stack(sequences)  # [B, L + n]
    total = DecodeStats(rounds=rounds, target_calls=lm.calls, draft_calls=drafter.calls,
                        target_tokens_fed=lm.tokens_fed, draft_tokens_fed=drafter.tokens_fed,
                        padding_fed=lm.padding_fed + drafter.padding_fed,
                        hole_fraction=statistics.fmean(lm.hole_shares) if lm.hole_shares else 0.0,
                        wall_seconds=wall, time_to_first_token=rows.first_token_at)
    for stats in rows.stats:
        total.add(stats)  # by_source's rounds: the rows' rounds, summed
        stats.wall_seconds = stats.wall_seconds or wall
    return GenerateOutput(sequences, total, rows.stats)


@torch.inference_mode()
def autoregressive_generate(target, input_ids: torch.Tensor, *, max_new_tokens: int,
                            temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None, seed: int | None = None,
                            eos_token_id=None, attention_mask=None,
                            on_tokens=None, sampling=None, constraint=None,
                            on_round=None, logprobs: int | None = None,
                            logprobs_mode: str = "raw") -> GenerateOutput:
    """Plain decoding of the target: one forward pass and one draw from p per output token.
    input_ids[B, L] with an optional attention_mask (left or right padding); `on_tokens`,
    `sampling`, `constraint`, `on_round`, `logprobs` and `logprobs_mode` as in
    `speculative_generate`. Each token is the race
    over p with the noise of (row seed, position) (`exactspec.noise`; row b's from (seed, b)),
    so `speculative_generate(..., seed=seed, verify="coupled")` emits the same tokens."""
    check_generation_args(input_ids, max_new_tokens)
    check_logprobs_args(logprobs, logprobs_mode)
    sampling = SamplingConfig(temperature, top_k, top_p) if sampling is None else sampling
    return _generate(target, make_drafter(None), input_ids, attention_mask, gamma=0,
                     max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                     eos_token_id=eos_token_id, verify="coupled", on_tokens=on_tokens,
                     constraint=constraint, on_round=on_round, logprobs=logprobs,
                     logprobs_mode=logprobs_mode)


@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, *, gamma: int | str = AUTO,
                         max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int | None = None,
                         eos_token_id=None, attention_mask=None, verify: str = "block",
                         on_tokens=None, sampling=None, constraint=None,
                         on_round=None, logprobs: int | None = None,
                         logprobs_mode: str = "raw") -> GenerateOutput:
    """Speculative decoding: each row's output follows the target's decoding distribution exactly.

    target: a Hugging Face causal LM or LoadedModel. draft: a model, a model spec, "ngram",
    "auto" (prompt lookup or the target's default model draft, round by round: llama.cpp on the
    target's own GGUF where it has one, else a bfloat16 copy; "auto:SPEC" names the model draft),
    "llamacpp:PATH", or any drafter (see `exactspec.drafters.make_drafter`). gamma: drafts per round,
    or "auto" (chosen each round from measured costs and acceptance: `GammaController`), or a
    `Controller` of your own. input_ids[B, L] with an optional
    attention_mask (left or right padding). verify: "block" (joint block verification, never
    fewer tokens per round), "token" (the reference's rule) or "coupled" (the target's token at
    each position drawn from noise of (row seed, position), drafts kept while equal to it: the
    same tokens as `autoregressive_generate` with that seed, whatever the draft and γ); all exact.
    `on_tokens(row, new_ids)` is called with the tokens each round emits for a row, for streaming;
    it may return `EndRow(n)` to end that row after the first n of them (a stopping rule that
    reads only the row's own tokens keeps the output exact). `sampling`, when given, makes p and q instead
    of temperature / top_k / top_p (e.g. `exactspec.hf.Processing`: Transformers' processors).
    `constraint` (an `exactspec.Constraint`: JSON Schema, any JSON object, regex, Lark grammar)
    makes every row follow the constrained target (`exactspec.constraints`), drafting first
    what the grammar forces. `on_round(line)` is called after each round with its trace line (a
    dict: `driver.trace_line`), which says who drafted, the γ chosen and why. `logprobs=N`
    (0..20) records each new token's log-probability and its N most likely alternatives, read
    from the pass that verified it (`GenerateOutput.logprobs`; `on_tokens` then gets them as its
    `logprobs=` keyword); `logprobs_mode` "raw" (the model's log-softmax) or "processed" (log p):
    see `exactspec.logprobs`.
    """
    check_generation_args(input_ids, max_new_tokens, gamma)
    check_logprobs_args(logprobs, logprobs_mode)
    sampling = SamplingConfig(temperature, top_k, top_p) if sampling is None else sampling
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    drafter = make_drafter(draft, target=target)
    return _generate(target, drafter, input_ids, attention_mask, gamma=gamma,
                     max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                     eos_token_id=eos_token_id, verify=verify, on_tokens=on_tokens,
                     constraint=constraint, on_round=on_round, logprobs=logprobs,
                     logprobs_mode=logprobs_mode)
