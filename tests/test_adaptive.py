"""Choices that shape a round (γ, who drafts) stay exact when they look only backwards, and
break exactness when they peek at the target's scores of the round: adaptive γ, the auto draft."""
import pytest
import torch

import exactspec as es
from exactspec.controller import _MARGIN, _PLAIN_SAMPLES, MAX_GAMMA, START_GAMMA, GammaController
from exactspec.drafters import AutoDrafter, ModelDrafter, NGramDrafter
from exactspec.models.loaded import Memory, memory_of
from conftest import ALPHA, chi_square_pvalue, first_tokens
from test_decoding import NGRAM_PROMPT, PROMPTS, hf_greedy, ids, target_joint

pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedController(es.Controller):
    """A past-only controller that varies γ a lot: γ = 1 in the first round, then 0 after a round
    that kept all its drafts and 2 after one that did not."""

    def __init__(self):
        self.next = 1

    def choose(self, source: str, **situation) -> int:
        return self.next

    def observe(self, source, drafted, num_accepted, *timings, free=0) -> None:
        self.next = 0 if drafted and bool((num_accepted == drafted).all()) else 2


class DroppingController(ScriptedController):
    """Past-only, like ScriptedController, and every other round it sets min_drafts above the
    proposal's length, so the engine drops that proposal and takes a plain step."""

    def __init__(self):
        super().__init__()
        self.rounds = 0

    def min_drafts(self, source: str, gamma: int, free: int = 0) -> int:
        self.rounds += 1
        return gamma + 1 if self.rounds % 2 else 0


class PeekingDrafter(es.Drafter):
    """Deliberately wrong: it cuts its own proposal to nothing whenever the target would give the
    first draft less probability than the draft did (p(x_1) < q(x_1)). The cut depends on the
    target's scores of the current round, which the past-only rule forbids."""

    def __init__(self, inner: ModelDrafter, target):
        self.inner, self.target = inner, target
        for name in ("name", "bind", "next_source", "select"):
            setattr(self, name, getattr(inner, name))
        self.calls = self.tokens_fed = self.padding_fed = 0

    def start(self, input_ids, valid, vocab_size):
        self.inner.start(input_ids, valid, vocab_size)
        self.sequence = input_ids[0].tolist()

    def propose(self, gamma, sampling, generator):
        proposal = self.inner.propose(gamma, sampling, generator)
        if proposal.tokens.size(1):
            with torch.no_grad():
                logits = self.target(torch.tensor([self.sequence])).logits[0, -1]
            x = proposal.tokens[0, 0]
            if sampling.probs(logits.double())[x] < proposal.q[0, 0, x]:
                proposal = es.drafters.Proposal(proposal.tokens[:, :0], proposal.q[:, :0])
        self.drafted = proposal.tokens
        return proposal

    def commit(self, num_accepted, next_tokens):
        n = int(num_accepted[0])
        self.sequence += self.drafted[0, :n].tolist() + [int(next_tokens[0])]
        self.inner.commit(num_accepted, next_tokens) if self.drafted.size(1) else \
            self.inner.observe(self.drafted, num_accepted, next_tokens)


def sample_first_two(target, drafter_factory, prompt, gamma, settings, n=1200, rows=50):
    """Counts of the first 2 new tokens over n generations (n // rows batches of `rows` rows,
    each batch with a fresh drafter and γ choice: its own history of rounds), and the drafts kept."""
    return first_tokens(lambda batch, seed: es.speculative_generate(
        target, drafter_factory(), batch, gamma=gamma(), max_new_tokens=3, seed=seed,
        eos_token_id=[], **settings), prompt, n=n, rows=rows)


@pytest.mark.parametrize("gamma", ["auto", "scripted"])
def test_greedy_with_adaptive_gamma_and_auto_draft_matches_target(tiny_pair, gamma):
    target, draft = tiny_pair
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 24)
        for drafter in (ModelDrafter(draft), NGramDrafter(), AutoDrafter(ModelDrafter(draft))):
            choice = ScriptedController() if gamma == "scripted" else "auto"
            out = es.speculative_generate(target, drafter, ids(prompt), gamma=choice,
                                          max_new_tokens=24, temperature=0, eos_token_id=[])
            assert out.sequences[0].tolist() == expected


CASES = [("model", PROMPTS[2], dict(temperature=1.0)),
         ("ngram", NGRAM_PROMPT, dict(temperature=0.5)),
         ("auto", NGRAM_PROMPT, dict(temperature=0.7, top_k=8))]


@pytest.mark.parametrize("gamma", ["auto", "scripted"])
@pytest.mark.parametrize("kind, prompt, settings", CASES, ids=["model", "ngram", "auto"])
def test_adaptive_sampling_matches_target_joint(tiny_pair, gamma, kind, prompt, settings):
    """With γ chosen each round from the past (the real controller, fresh each run so that it
    explores, or a scripted one that switches between 0, 1 and 2), the first 2 tokens follow the target's exact joint
    (chi-square, false-failure rate 1e-6 per case)."""
    target, draft = tiny_pair
    factories = {"model": lambda: ModelDrafter(draft), "ngram": NGramDrafter,
                 "auto": lambda: AutoDrafter(ModelDrafter(draft), min_match=1)}
    choose = ScriptedController if gamma == "scripted" else GammaController  # a fresh one per run
    counts, accepted = sample_first_two(target, factories[kind], prompt, choose, settings)
    assert accepted > 100  # drafts were really kept, so acceptance is exercised
    assert chi_square_pvalue(counts, target_joint(target, prompt, 2, es.SamplingConfig(**settings))) > ALPHA


def test_dropped_proposals_stay_exact(tiny_pair):
    """Rounds whose proposal is dropped as too short (a plain step; the model draft rolls back
    the drafts it fed) between rounds that verify: the first 2 tokens still follow the target's
    law (chi-square, false-failure rate 1e-6)."""
    target, draft = tiny_pair
    settings = dict(temperature=1.0)
    counts, accepted = sample_first_two(target, lambda: ModelDrafter(draft), PROMPTS[2],
                                        DroppingController, settings)
    assert accepted > 100
    assert chi_square_pvalue(counts, target_joint(target, PROMPTS[2], 2, es.SamplingConfig(**settings))) > ALPHA


def test_min_drafts_drops_lookups_too_short_to_pay():
    """With this CPU's pass times (2 tokens cost more than 4) and free lookups: at α ≈ 0.6 a
    match of 1 or 2 tokens is not worth a pass, one of 3 is; at α ≈ 0.95 any is; before any
    timing, nothing is dropped."""
    assert GammaController().min_drafts("ngram", 4) == 0
    controller = GammaController()
    plain_steps(controller, 0.040)
    for tokens, seconds in ((2, 0.068), (3, 0.084), (4, 0.063), (5, 0.064)):
        controller.observe("none", 0, torch.tensor([0]), tokens, 0.0, seconds)
    controller.observe("ngram", 4, torch.tensor([2]), 3, 1e-5, 0.084)  # α = 3/5 so far
    assert controller.min_drafts("ngram", 4) == 3
    for _ in range(20):
        controller.observe("ngram", 4, torch.tensor([4]), 5, 1e-5, 0.064)
    assert controller.min_drafts("ngram", 4) == 1


def test_a_controller_that_peeks_at_the_target_is_caught(tiny_pair):
    """The same kind of test, on the first token, turns red for a choice that depends on the
    round's target scores (its p-value falls below the 1e-6 the exact paths must stay above)."""
    target, draft = tiny_pair
    settings = dict(temperature=1.0)
    counts, _ = sample_first_two(target, lambda: PeekingDrafter(ModelDrafter(draft), target),
                                 PROMPTS[2], lambda: 2, settings, rows=1)  # it peeks at row 0
    first = {}
    for (token, _), n in counts.items():
        first[token] = first.get(token, 0) + n
    law = target_joint(target, PROMPTS[2], 1, es.SamplingConfig(**settings))
    assert chi_square_pvalue({(t,): n for t, n in first.items()}, law) < ALPHA


def plain_steps(controller: GammaController, seconds: float) -> None:
    """Enough plain steps of `seconds` for the controller to price rounds (it times T(1) first)."""
    for _ in range(_PLAIN_SAMPLES):
        controller.observe("none", 0, torch.tensor([0]), 1, 0.0, seconds)


def test_controller_prefers_plain_steps_when_the_draft_costs_more_than_it_saves():
    controller = GammaController()
    plain_steps(controller, 0.040)  # a plain step: 40 ms
    for _ in range(5):  # a draft token costs 44 ms and 40 % of drafts are kept
        controller.observe("model", 4, torch.tensor([1]), 5, 0.176, 0.065)
    choices = [controller.choose("model") for _ in range(130)]
    # Even with every draft kept it could not pay: plain steps, and a probe every 64 of them.
    assert [i for i, gamma in enumerate(choices) if gamma] == [63, 127]
    assert set(choices) == {0, 1}


def test_controller_probes_sooner_when_a_better_alpha_would_pay():
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(20):  # a draft token costs 4 ms, but few drafts are kept
        controller.observe("model", 4, torch.tensor([0]), 5, 0.016, 0.065)
    controller.observe("model", 4, torch.tensor([4]), 5, 0.016, 0.065)
    choices = [controller.choose("model") for _ in range(40)]
    assert [i for i, gamma in enumerate(choices) if gamma] == [3, 11, 27]  # after 4, 8, 16


def test_controller_drafts_long_blocks_when_drafts_are_free_and_kept():
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(20):
        controller.observe("ngram", 8, torch.tensor([8]), 9, 0.0001, 0.090)
    assert controller.choose("ngram") >= 8
    controller.observe("ngram", 32, torch.tensor([32]), 33, 0.0001, 0.114)  # 1.3x the time, 3.7x the tokens
    assert controller.choose("ngram") == MAX_GAMMA  # the longest block anyone may ask for


def test_a_size_not_seen_is_priced_to_be_tried():
    """pricing.between: a size not seen costs the size below plus PRIOR_SLOPE per token unless
    the line to the size above is cheaper; below the sizes seen, the size above less the slope."""
    from exactspec.pricing import PRIOR_SLOPE, between

    seen = {1: 0.030, 8: 0.220, 33: 0.500}
    slope = PRIOR_SLOPE * 0.030
    assert between(seen, 16) == pytest.approx(0.220 + 8 * slope)  # the line would say 0.310
    assert between({1: 0.030, 8: 0.220, 9: 0.225}, 2) == pytest.approx(0.030 + slope)
    assert between({1: 0.030, 3: 0.031}, 2) == pytest.approx(0.0305)  # the line is cheaper
    assert between(seen, 40) == pytest.approx(0.500 + 7 * slope)
    assert between({4: 0.100}, 2) == pytest.approx(0.100 - 2 * PRIOR_SLOPE * 0.100)


def test_controller_finds_a_long_pass_that_costs_less_than_a_shorter_one():
    """On llama.cpp's CPU kernels T(k) is not monotone (a curve shaped like the Qwen 1.5B's on a
    2-core EPYC, docs/drafting.md: T(16) below T(12), T(32) below T(31)): at α near 1 an unseen
    size is tried, and once measured the controller settles on the cheap one."""
    curve = {1: 0.0325, 2: 0.059, 3: 0.082, 4: 0.102, 5: 0.123, 6: 0.143, 7: 0.166, 8: 0.222,
             9: 0.236, 10: 0.254, 11: 0.267, 12: 0.279, 13: 0.296, 14: 0.314, 15: 0.324,
             16: 0.265, 17: 0.313}
    curve.update({k: 0.313 + 0.0125 * (k - 17) for k in range(18, 34)})
    curve[32] = 0.449
    controller = GammaController()
    plain_steps(controller, curve[1])
    tried = []
    for _ in range(60):
        gamma = controller.choose("ngram")
        tried.append(gamma)
        controller.observe("ngram", gamma, torch.tensor([gamma]), gamma + 1, 0.0001, curve[gamma + 1])
    assert 15 in tried[:40] and tried[-10:] == [31] * 10  # T(32): 32 tokens at 0.449 s
    del curve[32]
    controller = GammaController(max_gamma=20)
    plain_steps(controller, curve[1])
    for _ in range(40):
        gamma = controller.choose("ngram")
        controller.observe("ngram", gamma, torch.tensor([gamma]), gamma + 1, 0.0001, curve[gamma + 1])
    assert controller.choose("ngram") == 15  # T(16): 16 tokens at 0.265 s, below T(12)


def test_a_slow_first_pass_does_not_stop_drafting_for_good():
    """A first call's one-time set-up (here a 5 s two-token pass) is an upward outlier: a k-token
    pass slower than k one-token passes is set aside, so free drafts still get drafted."""
    controller = GammaController()
    controller.observe("ngram", 1, torch.tensor([1]), 2, 0.0001, 5.0)
    plain_steps(controller, 0.040)
    assert controller.target_seconds(2) < 0.080
    assert controller.choose("ngram") > 0


def test_draft_cost_is_per_forward_pass_of_the_draft_model():
    """A round whose draft caught up on 100 pending tokens in one pass, then drafted 2 more
    tokens (3 passes in all), costs a third of its draft time per pass, not per drafted token."""
    controller = GammaController()
    controller.observe("model", 3, torch.tensor([3]), 4, 0.090, 0.050, draft_calls=3)
    assert min(controller.draft["model"]) == pytest.approx(0.030)


def test_controller_times_a_plain_step_before_pricing_rounds():
    """A draft not seen yet drafts START_GAMMA; then plain steps time T(1) until it has
    _PLAIN_SAMPLES samples at this batch size, and only then are rounds priced."""
    controller = GammaController()
    assert controller.choose("ngram") == START_GAMMA
    controller.observe("ngram", 4, torch.tensor([4]), 4, 0.0001, 0.060)
    choices = []
    for _ in range(_PLAIN_SAMPLES):
        choices.append(controller.choose("ngram"))
        controller.observe("none", 0, torch.tensor([0]), 1, 0.0, 0.040)
    assert choices == [0] * _PLAIN_SAMPLES and controller.choose("ngram") > 0


def test_timings_are_kept_per_batch_size():
    """T(k) at 8 rows does not price a round of 1 row (a batch's rows end at different rounds),
    while the draft's cost comes from the nearest batch size seen."""
    controller = GammaController()
    for _ in range(_PLAIN_SAMPLES):
        controller.observe("none", 0, torch.zeros(8, dtype=torch.long), 1, 0.0, 0.070)
    controller.observe("model", 4, torch.full((8,), 4), 5, 0.100, 0.130, draft_calls=4)
    assert controller.choose("model", rows=8) > 0
    assert controller.choose("model", rows=1) == 0  # T(1) of one row is not timed yet
    assert controller.target_by_rows[8][1] == [0.070] * _PLAIN_SAMPLES and not controller.target
    assert controller.draft_seconds("model") == pytest.approx(0.025)


def test_a_draft_that_must_catch_up_drafts_only_if_the_tokens_left_repay_it():
    """A model draft that sat out 700 tokens catches up at 2 ms a token (1.4 s): with 30 tokens
    left, drafting's saving (about 25 ms a token) does not repay it, with 500 left it does; with
    80 left it saves 2.0 s, more than the catch-up but not 1.5 times it (`_CATCH_UP_MARGIN`), and with
    120 it saves 3.0 s; a draft in step drafts either way, and no probe catches up when even
    perfect drafts could not repay it."""
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(5):
        controller.observe("model", 4, torch.tensor([4]), 5, 0.024, 0.060)
    controller.observe_catch_up("model", 1.4, 700)
    assert controller.choose("model", lag=700, tokens_left=30) == 0
    assert controller.choose("model", lag=700, tokens_left=500) > 0
    assert controller.choose("model", lag=700, tokens_left=80) == 0
    assert controller.choose("model", lag=700, tokens_left=120) > 0
    assert controller.choose("model", lag=0, tokens_left=30) > 0
    assert set(controller.choose("model", lag=7000, tokens_left=30) for _ in range(200)) == {0}


def test_a_short_catch_up_is_priced_as_one_decode_in_step_plus_its_tokens():
    """A catch-up feeds the lag with a round in step's own tokens: a lag of 2 that took 16 ms,
    with 10 ms a decode in step, prices a token at 3 ms, not 8, so a lag of 44 with 32 tokens left
    (0.13 s against 0.64 s saved) is worth catching up on; at 8 ms a token it would not be."""
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(5):
        controller.observe("model", 4, torch.tensor([4]), 5, 0.040, 0.060, draft_calls=4)
    for _ in range(3):
        controller.observe_catch_up("model", 0.016, 2)
    assert controller.catch_up["model"] == [pytest.approx(0.003)] * 3
    assert controller.choose("model", lag=44, tokens_left=32) > 0
    assert controller.choose("model", lag=150, tokens_left=32) == 0


def test_a_grammar_rounds_forced_drafts_are_priced_as_kept_and_say_nothing_of_alpha():
    """A round whose first 4 drafts are forced (free: p = 1 under the mask) drafts them whatever
    γ is; γ is the tail after them, and α counts the tail only. Grammar rounds that kept their 4
    forced drafts and none of the 6 after them leave α at 0 kept (counting the forced ones it
    would read 4 kept per rejection and price a long tail), so the tail is 0; a tail kept whole
    prices a long one; and a round with free drafts has none too few to pay for its pass."""
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(10):
        controller.observe("grammar", 10, torch.tensor([4]), 11, 0.0001, 0.060, free=4)
    assert (controller.acceptance["grammar"].accepted, controller.acceptance["grammar"].rejected) == (0, 10)
    assert controller.choose("grammar", free=4) == 0
    assert controller.min_drafts("grammar", 0, free=4) == 0
    for _ in range(40):
        controller.observe("grammar", 10, torch.tensor([10]), 11, 0.0001, 0.060, free=4)
    assert controller.choose("grammar", free=4) >= 4


def test_a_lockstep_batch_counts_each_round_as_its_least_kept_row():
    """In a fixed batch (done when its slowest row is) a round counts as the row that kept the
    fewest drafts; a row that drafted nothing counts as a rejection."""
    batch, served = GammaController(lockstep=True), GammaController()
    for controller in (batch, served):
        controller.observe("ngram", [4, 4, 0], torch.tensor([4, 3, 0]), 5, 0.0001, 0.060)
    assert (batch.acceptance["ngram"].accepted, batch.acceptance["ngram"].rejected) == (0, 1)
    assert (served.acceptance["ngram"].accepted, served.acceptance["ngram"].rejected) == (7, 2)


def test_the_auto_draft_reads_the_first_token_before_the_models_catch_up(tiny_pair):
    """With no lookup match and the prompt still to read into its model, the auto draft's first
    round is source "none", which the γ controller makes a plain step; at a fixed γ its model
    drafts that round (as it would alone or in a batch). Later rounds are the model's again."""
    from exactspec.engine import Decoder
    from exactspec.sampling import SamplingConfig

    target, draft = tiny_pair
    prompt = torch.tensor([[5, 6, 7, 8]])  # no token repeats: no lookup match
    drafter = AutoDrafter(ModelDrafter(draft))
    decoder = Decoder(target, drafter, prompt, None, max_new_tokens=6, sampling=SamplingConfig(0.0),
                      seed=0, eos_token_id=[], verify="token", on_tokens=None)
    assert drafter.next_source() == "none" and GammaController().choose("none") == 0
    assert decoder.step(2).drafted == 2 and drafter.calls > 0  # a fixed γ: the model drafted
    assert drafter.next_source() != "none"
    out = es.speculative_generate(target, drafter, prompt, gamma="auto", max_new_tokens=6,
                                  temperature=0, seed=0, eos_token_id=[])
    assert out.rounds_by_source.get("plain", 0) >= 1 and "none" not in out.rounds_by_source


def test_a_lookup_round_must_promise_a_margin_over_a_plain_step():
    """A source that scores itself (which the guard does not judge) takes a plain step where a
    round's price beats a plain step by less than _MARGIN (its price is made of medians; rounds
    cost more on average), and drafts where it beats it by more; a model draft, which the guard
    judges, drafts wherever the price beats a plain step."""
    for alpha, drafts in ((0.15, False), (0.5, True)):
        controller = GammaController()
        plain_steps(controller, 0.040)
        for source in ("ngram", "model"):  # free drafts, a 2-token pass: 44 ms
            for _ in range(5):
                controller.observe(source, 1, torch.tensor([1]), 2, 1e-5, 0.044)
        controller.acceptance.clear()  # α from 1000 scored positions instead
        kept = int(1000 * alpha)
        controller.observe_evidence({"ngram": [(kept, 1000 - kept)]})
        controller._count("model", kept, 1000 - kept)
        gain = controller.rate("ngram", alpha, 1) / controller.rate("ngram", alpha, 0)
        assert gain > 1.0 and (gain > _MARGIN) == drafts
        assert (controller.choose("ngram") > 0) == drafts and controller.choose("model") > 0


def test_prompt_lookup_alpha_comes_from_its_scores_of_itself():
    """A source that scores itself (`observe_evidence`) takes α from its hits and misses at every
    committed position, and no longer from one-row rounds' counts (the same positions), and it
    is not probed; a batch's evidence is not used (its rounds count rows without a match)."""
    controller = GammaController()
    controller.observe_evidence({"ngram": [(9, 1)], "ngram-1": [(0, 0)]})
    controller.observe("ngram", 4, torch.tensor([0]), 5, 0.0001, 0.060)  # not counted again
    stats = controller.acceptance["ngram"]
    assert (stats.accepted, stats.rejected) == (9, 1) and stats.alpha() > 0.8
    assert controller.past["ngram"] == [9, 1]
    controller.observe("model", 4, torch.tensor([0]), 5, 0.001, 0.060)  # counted: no evidence
    assert controller.acceptance["model"].rejected == 1
    for source in ("ngram", "model"):  # a source scored at every token needs no probes
        for _ in range(20):
            controller.observe(source, 4, torch.tensor([0]), 5, 1e-5, 0.065)
    controller.observe_evidence({"ngram": [(0, 300)]})  # α ≈ 0.03: plain steps pay
    plain_steps(controller, 0.040)
    assert [controller.choose("ngram") for _ in range(100)] == [0] * 100
    assert any(controller.choose("model") for _ in range(100))  # probes after 4, 8, ... steps
    batch = GammaController()
    batch.observe_evidence({"ngram": [(9, 1), (0, 0)]})
    batch.observe("ngram", 4, torch.tensor([4, 0]), 5, 0.0001, 0.060)  # a row without a match
    assert (batch.acceptance["ngram"].accepted, batch.acceptance["ngram"].rejected) == (4, 1)


def test_the_guard_stops_a_draft_whose_rounds_deliver_less_than_a_plain_step():
    """Rounds the price says pay but that delivered fewer tokens per second than a plain step
    (T(1) = 40 ms: 25 tokens/s) stop the source's drafting in this generation; a probe round that
    beats a plain step lifts it."""
    controller = GammaController()
    plain_steps(controller, 0.040)
    for _ in range(3):  # cheap drafts, all kept: the price says draft
        controller.observe("model", 4, torch.tensor([4]), 5, 0.004, 0.050)
    assert controller.delivers("model") and controller.choose("model") > 0
    controller.delivered["model"] += [(1.0, 0.2)] * 4  # four rounds that stalled: 19.7 tokens/s
    assert not controller.delivers("model") and controller.choose("model") == 0
    controller._deliver("model", 5.0, 0.054, probe=True)
    assert controller.delivers("model") and controller.choose("model") > 0


def test_an_overpriced_round_re_times_a_plain_step():
    """A drafting round that took more than 1.5x its price drops T(1)'s samples: the next
    rounds are plain steps that time it again."""
    controller = GammaController()
    plain_steps(controller, 0.040)
    controller.observe("model", 4, torch.tensor([4]), 5, 0.004, 0.050)
    assert controller.plain_timed()
    controller.observe("model", 4, torch.tensor([4]), 5, 0.004, 0.300)
    assert not controller.plain_timed() and controller.choose("model") == 0


def test_timings_belong_to_the_loaded_model_and_a_bare_model_starts_afresh(tiny_loaded_pair):
    """What a generation learns is kept in the target's `Memory` (held by its LoadedModel): the
    pass timings, the drafter's costs and, on the CPU, the faster products of both models. Two
    loaded models remember apart; a model passed bare gets a fresh memory each time."""
    target, draft = tiny_loaded_pair
    es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma="auto", max_new_tokens=12, seed=0)
    assert target.memory.passes and set(target.memory.drafters) == {"tiny-draft"}
    assert draft.memory.passes == {} and draft.memory.drafters == {}  # a draft's: no γ timings
    assert target.memory.runner is not None and draft.memory.runner is not None
    assert target.memory.shapes and draft.memory.shapes
    assert memory_of(target) is target.memory and memory_of(target.model) is not memory_of(target.model)
    fresh = GammaController.shared(Memory(), "tiny-draft")
    assert fresh.target_by_rows == {} and fresh.draft_by_rows == {} and fresh.past == {}


def test_a_source_that_scores_itself_is_not_probed_in_a_later_generation_either():
    """Which sources score themselves is kept in the memory, like the timings: a later
    generation's first rounds, before its first scores, do not probe prompt lookup (each such
    probe was a failed block at the start of a generation; a source not scored still is)."""
    key = Memory()
    first = GammaController.shared(key, "lookup")
    plain_steps(first, 0.040)
    for _ in range(20):
        first.observe("model", 4, torch.tensor([0]), 5, 1e-5, 0.065)
        first.observe("ngram", 4, torch.tensor([0]), 5, 1e-5, 0.065)
    first.observe_evidence({"ngram": [(0, 300)]})
    later = GammaController.shared(key, "lookup")
    assert [later.choose("ngram") for _ in range(100)] == [0] * 100
    assert any(later.choose("model") for _ in range(100))


def test_plain_steps_count_towards_a_probe_across_generations():
    """Generations shorter than the probe schedule still probe: the plain steps since the last
    probe are kept in the memory, like the timings (here 4 split 2 + 2 over two generations)."""
    key = Memory()
    choices = []
    for _ in range(2):
        controller = GammaController.shared(key, "test")
        if not controller.plain_timed():
            plain_steps(controller, 0.040)
            for _ in range(20):  # a draft token costs 4 ms, but few drafts are kept
                controller.observe("model", 4, torch.tensor([0]), 5, 0.016, 0.065)
        choices += [controller.choose("model") for _ in range(2)]
    assert choices[:3] == [0, 0, 0] and choices[3] > 0
