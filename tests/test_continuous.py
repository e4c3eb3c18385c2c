"""Continuous batching in the engine: rows joining a running Decoder at a round boundary, rows
leaving (budget, EOS, cancel), per-row settings and per-row random streams (rule 8)."""
import pytest
import torch

from conftest import ALPHA, chi_square_pvalue
from exactspec.batch_controller import BatchController
from exactspec.batching import RowSettings
from exactspec.driver import Driver
from exactspec.policy import AUTO
from exactspec.drafters import AutoDrafter, ModelDrafter, NGramDrafter, NoDraft
from exactspec.engine import Decoder, pad_prompts
from exactspec.sampling import SamplingConfig
from test_decoding import NGRAM_PROMPT, hf_greedy, target_joint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 5, 9, 5], [1, 20, 21, 22, 20, 21], [1, 7], [3], [1, 4, 3, 10, 7, 24]]


def start(target, drafter, prompts, settings, on_tokens=None):
    """A per-row Decoder over `prompts` with one RowSettings each."""
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    decoder = Decoder(target, drafter, ids, mask, max_new_tokens=max(s.max_new_tokens for s in settings),
                      sampling=SamplingConfig(), seed=None, eos_token_id=[], verify="block",
                      on_tokens=on_tokens)
    decoder.use_row_settings(settings)
    return decoder


def join(decoder, prompts, settings):
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    return decoder.join(ids, mask, settings)


def drafters(draft):
    return {"model": lambda: ModelDrafter(draft), "ngram": NGramDrafter, "none": NoDraft,
            "auto": lambda: AutoDrafter(ModelDrafter(draft))}


@pytest.mark.parametrize("kind", ["model", "ngram", "none", "auto"])
def test_joined_rows_match_greedy_alone(tiny_pair, kind):
    """Greedy rows that join mid-batch (different γ, rules and budgets; one prompt of a single
    token) equal Transformers' greedy decoding of each prompt alone; rows leave as they finish.
    The auto draft's model takes joining rows lazily (its cache catches up when it drafts)."""
    target, draft = tiny_pair
    greedy = lambda n, **kw: RowSettings(max_new_tokens=n, temperature=0, **kw)
    decoder = start(target, drafters(draft)[kind](), PROMPTS[:2], [greedy(5), greedy(20, gamma=2)])
    decoder.step(4)
    rows = [0, 1] + join(decoder, PROMPTS[2:4], [greedy(16, gamma=6), greedy(9, verify="token")])
    decoder.step(4)
    rows += join(decoder, PROMPTS[4:], [greedy(12, gamma=1)])
    while not decoder.done:
        decoder.step(4)
    budgets = [5, 20, 16, 9, 12]
    for row, prompt, n in zip(rows, PROMPTS, budgets):
        assert prompt + decoder.rows.new[row] == hf_greedy(target, prompt, n)


def test_cancelled_row_leaves_the_caches(tiny_pair):
    target, draft = tiny_pair
    settings = [RowSettings(max_new_tokens=30, temperature=0)] * 3
    decoder = start(target, ModelDrafter(draft), PROMPTS[:3], settings)
    decoder.step(4)
    decoder.cancel([1])
    assert decoder.rows.active.tolist() == [0, 2]
    assert decoder.lm.valid.size(0) == decoder.drafter.lm.valid.size(0) == 2
    while not decoder.done:
        decoder.step(4)
    assert PROMPTS[2] + decoder.rows.new[2] == hf_greedy(target, PROMPTS[2], 30)


def test_lazy_draft_cache_emptied_then_joined(tiny_pair):
    """The auto draft's model takes joining rows lazily (all holes in its cache). When the rows it
    holds leave, its cache keeps no column; rows leaving and joining after that still line up
    (Transformers skips empty cache layers when selecting rows: the cache is renewed instead)."""
    target, draft = tiny_pair
    greedy = lambda n: RowSettings(max_new_tokens=n, temperature=0)
    prompts = [[1, 4, 3, 10, 7], [1, 20, 21, 22], [1, 7, 9], [3, 5], [1, 8, 9, 11, 12, 13, 14]]
    decoder = start(target, drafters(draft)["auto"](), prompts[:2], [greedy(30), greedy(30)])
    decoder.step(2)  # the model drafts: its cache holds rows 0 and 1
    rows = join(decoder, prompts[2:4], [greedy(10), greedy(10)])
    decoder.cancel([0, 1])
    decoder.cancel([rows[0]])  # a row leaves while the draft's cache is empty
    assert decoder.drafter.model.lm.length == 0
    rows = rows[1:] + join(decoder, prompts[4:], [greedy(8)])
    while not decoder.done:
        decoder.step(2)
    for row, prompt, n in zip(rows, prompts[3:], [10, 8]):
        assert prompt + decoder.rows.new[row] == hf_greedy(target, prompt, n)


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_seed_reproduces_a_row_whatever_shares_the_batch(tiny_pair, kind):
    """A seeded sampled row gives the same tokens alone and joined into a batch of rows with other
    settings, γ, budgets and seeds that come and go (rule 8)."""
    target, draft = tiny_pair
    mine = RowSettings(max_new_tokens=24, temperature=0.9, top_k=12, seed=7, gamma=3)
    alone = start(target, drafters(draft)[kind](), [PROMPTS[4]], [mine])
    while not alone.done:
        alone.step(4)
    others = [RowSettings(max_new_tokens=n, temperature=t, seed=s, gamma=g)
              for n, t, s, g in ((40, 1.0, 1, 5), (3, 0.0, None, 2), (9, 1.3, 2, 1))]
    decoder = start(target, drafters(draft)[kind](), PROMPTS[:2], others[:2])
    decoder.step(4)
    decoder.step(4)
    row = join(decoder, [PROMPTS[4], PROMPTS[2]], [mine, others[2]])[0]
    while not decoder.done:
        decoder.step(4)
    assert decoder.rows.new[row] == alone.rows.new[0]
    assert len(alone.rows.new[0]) == 24


FILLERS = [RowSettings(max_new_tokens=2, temperature=0, seed=1),
           RowSettings(max_new_tokens=12, temperature=1.5, gamma=4, seed=2),
           RowSettings(max_new_tokens=30, temperature=0.7, top_k=3, gamma=1, seed=3)]  # seeded:
# an unseeded filler draws a random seed, and its acceptance (shared with the joined rows under
# gamma "auto") would make the γ path, and so the tests, differ from run to run


def sample_joining_rows(target, make_drafter, prompt, mine, step):
    """100 batches: 12 rows of settings `mine(seed)` (3 new tokens each) join a running batch of
    FILLERS, 6 after the first round and 6 after the second, beside rows that leave early, late or
    are cancelled; `step(decoder)` runs a round. Returns the counts of the joined rows' first 2
    tokens and their accepted drafts."""
    counts, accepted = {}, 0
    for batch in range(100):
        settings = [mine(batch * 12 + i) for i in range(12)]
        decoder = start(target, make_drafter(), PROMPTS[:3], FILLERS)
        step(decoder)
        rows = join(decoder, [prompt] * 6, settings[:6])
        step(decoder)
        decoder.cancel([2])
        rows += join(decoder, [prompt] * 6, settings[6:])
        while not decoder.done:
            step(decoder)
        for row in rows:
            key = tuple(decoder.rows.new[row][:2])
            counts[key] = counts.get(key, 0) + 1
            accepted += decoder.rows.stats[row].accepted_drafts
    assert sum(counts.values()) == 1200
    return counts, accepted


@pytest.mark.parametrize("kind, settings, verify", [("model", dict(temperature=1.0), "block"),
                                                    ("model", dict(temperature=1.2, top_p=0.8), "token"),
                                                    ("ngram", dict(temperature=0.5, top_k=6), "block")],
                         ids=["model-T1-block", "model-topp-token", "ngram-topk-block"])
def test_rows_joining_and_leaving_stay_exact(tiny_pair, kind, settings, verify):
    """Whole generations under continuous batching: 1200 rows (γ = 2, 3 new tokens each) join
    running batches, 6 after the first round and 6 after the second, beside rows with other
    settings that leave early, late or are cancelled. Their first 2 tokens follow the target's
    exact joint distribution: chi-square, false-failure rate α = 1e-6 per case (fixed seeds
    make it repeatable)."""
    target, draft = tiny_pair
    prompt = NGRAM_PROMPT if kind == "ngram" else PROMPTS[4]
    joint = target_joint(target, prompt, 2, SamplingConfig(**settings))
    mine = lambda seed: RowSettings(max_new_tokens=3, seed=seed, gamma=2, verify=verify, **settings)
    counts, accepted = sample_joining_rows(target, drafters(draft)[kind], prompt, mine,
                                           lambda decoder: decoder.step(4))
    assert accepted > 100  # drafts were really kept: the accept and correction paths both ran
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_batch_controller_times_each_batch_size_apart(tiny_pair):
    """A batch's controller keeps timings per batch size (a pass over 3 rows is not a pass over
    2), and one acceptance for the whole batch."""
    target, draft = tiny_pair
    settings = [RowSettings(max_new_tokens=n, temperature=0, gamma=AUTO) for n in (4, 30, 30)]
    decoder = start(target, drafters(draft)["model"](), PROMPTS[:3], settings)
    controller = BatchController.shared(decoder.memory, decoder.drafter.name)
    driver = Driver(decoder, controller)
    while decoder.rows.active.numel() == 3:
        driver.step()
    driver.step()
    assert controller.target_by_rows[3] and controller.target_by_rows[2]
    assert "model" in controller.acceptance and controller.past["model"] == [
        controller.acceptance["model"].accepted, controller.acceptance["model"].rejected]


class FlatCosts(BatchController):
    """Measured timings replaced by a nearly flat T(k): drafting pays, so γ follows acceptance
    (the tiny draft costs about what the tiny target does, so real timings mostly choose 0)."""

    def target_seconds(self, k: int) -> float:
        return 1.0 + 0.05 * k

    def plain_timed(self) -> bool:
        return True


class RecordingPolicy:
    """Rounds driven as the server drives them (one controller over every batch, `Driver`),
    recording the γ given to the "auto" rows in each round."""

    def __init__(self, controller_type):
        self.controller_type, self.controller, self.chosen = controller_type, None, []

    def step(self, decoder):
        if self.controller is None:
            self.controller = self.controller_type.shared(decoder.memory, decoder.drafter.name)
        report = Driver(decoder, self.controller).step()
        self.chosen.append(decoder.settings.auto_gamma)
        return report


@pytest.mark.parametrize("kind, costs, settings, verify", [
    ("auto", BatchController, dict(temperature=1.0), "block"),
    ("auto", FlatCosts, dict(temperature=0.9, top_p=0.9), "block"),
    ("model", FlatCosts, dict(temperature=0.8, top_k=10), "token")],
    ids=["auto-measured-T1-block", "auto-flat-topp-block", "model-flat-topk-token"])
def test_rows_with_gamma_auto_stay_exact(tiny_pair, kind, costs, settings, verify):
    """The same whole-generation test with the joined rows' gamma "auto": each round's γ comes
    from the server's policy (`BatchController`: timings per batch size, acceptance shared by the rows that come
    and go; the fillers keep their fixed γ), and with the auto draft the batch switches between
    prompt lookup and the model draft. With measured timings γ is mostly 0 on these tiny models
    (whatever path it takes, the test must hold); with flat costs it follows acceptance. Chi-square of the first 2 tokens against the target's
    exact joint, false-failure rate α = 1e-6 per case. The γ path follows timings, so runs may
    differ, but every path gives an exact sample: the test holds whichever is taken."""
    target, draft = tiny_pair
    prompt = NGRAM_PROMPT if kind == "auto" else PROMPTS[4]
    joint = target_joint(target, prompt, 2, SamplingConfig(**settings))
    make = drafters(draft)[kind]
    mine = lambda seed: RowSettings(max_new_tokens=3, seed=seed, gamma=AUTO, verify=verify, **settings)
    driver = RecordingPolicy(costs)
    counts, accepted = sample_joining_rows(target, make, prompt, mine, driver.step)
    assert chi_square_pvalue(counts, joint) > ALPHA
    if costs is FlatCosts:  # γ followed acceptance and changed from round to round (with the
        # fillers seeded, the model draft's path here is 0s and 1s: its α on these tiny models
        # is low; γ >= 2 had shown up only with some of the fillers' seeds, once drawn at random)
        assert accepted > 100 and max(driver.chosen) >= 1 and 0 in driver.chosen
