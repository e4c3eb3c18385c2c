"""The coupled rule (verify="coupled"): noise that belongs to (row seed, position), exact by
enumeration and by chi-square, and token-identical to plain decoding with the same seed whatever
the draft, γ, batch or company."""
import copy
import itertools
import math

import pytest
import torch

import exactspec as es
from conftest import ALPHA, chi_square_pvalue, first_tokens
from exactspec import noise as noise_module
from exactspec.batching import RowSettings
from exactspec.costmodel import acceptance_rate, coupled_acceptance_rate
from exactspec.drafters import AutoDrafter, ModelDrafter, NGramDrafter
from exactspec.engine import pad_prompts
from exactspec.noise import RowNoise, exponentials, race, race_uniforms, uniforms_at
from exactspec.sampling import sample
from test_continuous import join, start
from test_decoding import NGRAM_PROMPT, PROMPTS, ids, target_joint
from test_sampling import PrefixTables

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- the noise


def test_noise_belongs_to_seed_and_position_only():
    """E_t is the same however it is reached (another round's start, draws made before it), and
    differs between positions and seeds."""
    late = RowNoise(7, 3)
    late.draw(torch.ones(50))  # a draft's race at position 3 first
    assert torch.equal(late.uniforms(2, 50), uniforms_at(7, 5, 50))
    assert torch.equal(RowNoise(7, 5).uniforms(0, 50), uniforms_at(7, 5, 50))
    assert not torch.equal(exponentials(7, 5, 50), exponentials(7, 6, 50))
    assert not torch.equal(exponentials(7, 5, 50), exponentials(8, 5, 50))
    assert (exponentials(7, 5, 50) >= 0).all()


def test_race_draws_follow_the_weights():
    """The race over unnormalized weights with zeros, over 20,000 seeds, against w / Σ w
    (chi-square, α = 1e-6); a zero weight never wins, even against E = 0."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.5, 0.0, 2.5])
    counts = torch.zeros(6)
    for seed in range(20_000):
        counts[RowNoise(seed, 11).token(weights, 0)] += 1
    assert chi_square_pvalue(counts, weights / weights.sum()) > ALPHA
    assert int(race(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 5.0]))) == 1
    assert int(race(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 5.0]))) == 0


@pytest.mark.parametrize("case", ["dense", "zeros", "ties", "tiny", "u=0"])
def test_race_from_uniforms_is_the_race(case):
    """`race_uniforms`, which makes E only where its bound lets a token win, picks the token the
    full race picks: 2,000 draws per kind of weights, ties and E = 0 included."""
    vocab = 1_000
    for seed in range(2_000):
        gen = torch.Generator().manual_seed(seed)
        u = uniforms_at(seed, 0, vocab)
        weights = torch.rand(vocab, generator=gen)
        if case == "dense":
            weights = weights.softmax(-1)
        if case == "zeros":
            weights[torch.rand(vocab, generator=gen) < 0.9] = 0
        if case == "ties":
            weights = (weights * 4).floor()
        if case == "tiny":
            weights = weights * 1e-30
        if case == "u=0":
            u[torch.randint(vocab, (3,), generator=gen)] = 0.0
        assert race_uniforms(weights, u) == int(race(weights, -torch.log1p(-u))), seed


def test_a_single_positive_weight_wins_without_noise():
    """Greedy p (or a token the grammar forces) has one positive weight: the race is that token
    whatever E_t is, so E_t is not made; with two positive weights it is."""
    noise = RowNoise(3, 0)
    assert noise.token(torch.tensor([0.0, 0.0, 1.0, 0.0]), 0) == 2 and not noise._uniforms
    assert noise.token(torch.tensor([1.0, 0.0, 0.0]), 0) == 0 and not noise._uniforms
    assert noise.token(torch.tensor([0.0, 0.0, 1.0]), 0) == 2 and not noise._uniforms
    noise.token(torch.tensor([0.0, 0.5, 0.5, 0.0]), 1)
    noise.token(torch.tensor([0.5, 0.0, 0.5]), 2)
    assert list(noise._uniforms) == [1, 2]


def test_sample_refuses_zero_weight_rows_with_noise():
    with pytest.raises(ValueError, match="zero total weight"):
        sample(torch.zeros(1, 4), [RowNoise(0, 0)])


# --------------------------------------------------------------------------- exact enumeration


class CellNoise(RowNoise):
    """V = 2 noise given by u_t = E_t(0) / (E_t(0) + E_t(1)) per position (uniform on (0, 1) for
    Exp(1) noise; the race depends on nothing else): E_t = (u_t, 1 − u_t), made from the
    uniforms 1 − exp(−E_t)."""

    def __init__(self, us):
        super().__init__(seed=0, start=0)
        self.us = us

    def uniforms(self, offset, vocab):
        u = self.us[offset] if offset < len(self.us) else 0.5
        return -torch.expm1(-torch.tensor([u, 1 - u], dtype=torch.float64))


def run_round(tables, gamma, noise):
    """One coupled round through the library: the draft races over q with `noise` (or proposes
    its point mass), then `verify_block(..., "coupled")`. Returns the emitted tokens."""
    drafts = []
    for _ in range(gamma):
        if tables.point_mass:
            drafts.append(tables.draft_token(tuple(drafts)))
        else:
            drafts.append(int(sample(tables.q(tuple(drafts)).unsqueeze(0), [noise])))
    prefixes = [tuple(drafts[:i]) for i in range(gamma + 1)]
    p = torch.stack([tables.p(pre) for pre in prefixes]).unsqueeze(0)  # [1, γ+1, 2]
    q = None if tables.point_mass else torch.stack([tables.q(pre) for pre in prefixes[:-1]]).unsqueeze(0)
    result = es.verify_block(torch.tensor([drafts]).view(1, gamma), q, p, [noise], "coupled")
    return tuple(result.tokens[0, : int(result.num_accepted) + 1].tolist())


def coupled_round_outcomes(tables, gamma):
    """(probability, emitted) of one coupled round at V = 2 with the noise integrated out
    exactly: token 0 wins a race over w iff u < w(0) / Σ w, so a round's outcome is constant
    between the breakpoints p(0) and q(0) of each position (given the prefix so far); one library
    run at each cell's midpoint, weighted by the cell's length, is the exact integral."""
    def cells(prefix, us, weight):
        i = len(us)
        cuts = {0.0, 1.0, tables.p(prefix)[0].item()}
        if i < gamma and not tables.point_mass:
            cuts.add(tables.q(prefix)[0].item())
        cuts = sorted(cuts)
        for low, high in zip(cuts, cuts[1:]):
            u = (low + high) / 2
            y = 0 if u < tables.p(prefix)[0] else 1
            x = (tables.draft_token(prefix) if tables.point_mass
                 else 0 if u < tables.q(prefix)[0] else 1)
            if i == gamma or x != y:
                yield weight * (high - low), us + [u]
            else:
                yield from cells(prefix + (x,), us + [u], weight * (high - low))

    for weight, us in cells((), [], 1.0):
        yield weight, run_round(tables, gamma, CellNoise(us))


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
@pytest.mark.parametrize("gamma, seed", [(g, s) for g in (1, 2, 3, 4) for s in range(6)])
def test_coupled_round_keeps_target_joint_distribution_exactly(gamma, seed, point_mass):
    """One coupled round, then the target, gives the target's joint law of γ+1 tokens (to
    1e-12), with the draft racing over q with the same noise or proposing a point mass."""
    tables = PrefixTables(2, seed, point_mass)
    dist = {}
    for prob, emitted in coupled_round_outcomes(tables, gamma):
        for tail in itertools.product(range(2), repeat=gamma + 1 - len(emitted)):
            seq = emitted + tail
            rest = math.prod(tables.p(seq[:i])[seq[i]].item() for i in range(len(emitted), gamma + 1))
            dist[seq] = dist.get(seq, 0.0) + prob * rest
    for seq in itertools.product(range(2), repeat=gamma + 1):
        assert dist.get(seq, 0.0) == pytest.approx(tables.target_joint(seq), abs=1e-12), seq


@pytest.mark.parametrize("seed", range(6))
def test_coupled_first_draft_is_kept_with_the_coupling_probability(seed):
    """P(x_1 kept) by exact integration of the library's round equals the closed form
    `coupled_acceptance_rate` (to 1e-12), which is at most Σ min(p, q)."""
    tables = PrefixTables(2, seed)
    kept = sum(prob for prob, emitted in coupled_round_outcomes(tables, 1) if len(emitted) == 2)
    p, q = tables.p(()), tables.q(())
    assert kept == pytest.approx(coupled_acceptance_rate(p, q).item(), abs=1e-12)
    assert coupled_acceptance_rate(p, q) <= acceptance_rate(p, q) + 1e-12


def test_coupled_acceptance_rate_against_simulation():
    """V = 5: the closed form against 20,000 races of q and p with shared noise (binomial,
    α = 1e-6)."""
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2], dtype=torch.float64)
    n = 20_000
    agree = sum(RowNoise(s, 0).token(p, 0) == RowNoise(s, 0).token(q, 0) for s in range(n))
    alpha = coupled_acceptance_rate(p, q).item()
    assert abs(agree / n - alpha) < 5.5 * math.sqrt(alpha * (1 - alpha) / n)  # 5.5σ: ≈ 4e-8


# --------------------------------------------------------------------------- whole generations


def coupled_counts(target, drafter, prompt, settings, n=1200):
    """Counts of the first 2 new tokens of n coupled generations (batches of 200 rows: each row
    draws its own noise), and the drafts kept."""
    return first_tokens(lambda batch, seed: es.speculative_generate(
        target, drafter, batch, gamma=2, max_new_tokens=3, seed=seed, eos_token_id=[],
        verify="coupled", **settings), prompt, n=n)


@pytest.mark.parametrize("kind, prompt, settings", [
    ("model", PROMPTS[2], dict(temperature=1.0)),
    ("ngram", NGRAM_PROMPT, dict(temperature=0.5, top_k=6)),
], ids=["model-T1", "ngram-topk"])
def test_coupled_sampling_matches_target_joint(tiny_pair, kind, prompt, settings):
    """The first 2 tokens of coupled speculative sampling (γ = 2) over 1,200 seeds follow the
    target's exact joint (chi-square, α = 1e-6)."""
    target, draft = tiny_pair
    drafter = draft if kind == "model" else NGramDrafter()
    counts, accepted = coupled_counts(target, drafter, prompt, settings)
    assert accepted > 100
    assert chi_square_pvalue(counts, target_joint(target, prompt, 2, es.SamplingConfig(**settings))) > ALPHA


def test_noise_reused_across_positions_goes_red(tiny_pair, monkeypatch):
    """A broken coupling, the same noise at every position of a row, makes neighbouring tokens
    agree too often: the same chi-square rejects it."""
    monkeypatch.setattr(noise_module, "noise_key", lambda seed, position: noise_module.mix(seed))
    target, draft = tiny_pair
    counts, _ = coupled_counts(target, draft, PROMPTS[2], dict(temperature=1.0), n=600)
    assert chi_square_pvalue(counts, target_joint(target, PROMPTS[2], 2, es.SamplingConfig())) < ALPHA


# --------------------------------------------------------------------------- the same text


def bf16_copy(model):
    return copy.deepcopy(model).to(torch.bfloat16)


def ragged(batch):
    """`batch` prompts of different lengths, left-padded, and their attention mask."""
    prompts = [torch.tensor(PROMPTS[i % 3][: 2 + i % 5] or [1]) for i in range(batch)]
    return pad_prompts(prompts)


DRAFTS = {"model": lambda target, draft: draft, "bf16": lambda target, draft: bf16_copy(target),
          "ngram": lambda target, draft: "ngram", "auto": lambda target, draft: "auto"}
SETTINGS = [dict(temperature=0.8, top_k=8), dict(temperature=1.0, top_p=0.9)]


@pytest.mark.parametrize("settings", SETTINGS, ids=["T0.8-topk", "T1-topp"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", sorted(DRAFTS))
def test_coupled_output_is_plain_decoding_with_the_same_seed(tiny_pair, kind, batch, settings):
    """Token for token, for every γ: plain decoding with seed s and coupled speculative decoding
    with seed s emit the same rows (ragged prompts, rows ending at EOS at different rounds)."""
    target, draft = tiny_pair
    input_ids, mask = ragged(batch)
    plain = es.autoregressive_generate(target, input_ids, attention_mask=mask, max_new_tokens=24,
                                       seed=1234, **settings)
    drafter, accepted = DRAFTS[kind](target, draft), 0
    for gamma in (1, 4, 16, "auto"):
        out = es.speculative_generate(target, drafter, input_ids, attention_mask=mask, gamma=gamma,
                                      max_new_tokens=24, seed=1234, verify="coupled", **settings)
        assert [row.tolist() for row in out.sequences] == [row.tolist() for row in plain.sequences], gamma
        accepted += out.stats.accepted_drafts
    if kind in ("bf16", "auto"):  # (the tiny draft and lookup agree with the target rarely here)
        assert accepted > 0  # drafts were kept: not plain decoding in disguise


def test_coupled_rows_keep_their_text_when_joining_a_batch(tiny_pair):
    """Per-row decoding with seeded coupled rows of different γ (and a block-rule row beside
    them): rows that join mid-run emit what plain decoding of their prompt alone with their seed
    emits."""
    target, draft = tiny_pair
    row = lambda n, seed, gamma, **kw: RowSettings(max_new_tokens=n, temperature=0.9, seed=seed,
                                                   gamma=gamma, verify="coupled", **kw)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [3], NGRAM_PROMPT]
    settings = [row(20, 5, 4), RowSettings(max_new_tokens=15, seed=6), row(16, 7, 1),
                row(12, 8, 16, top_p=0.8), row(18, 9, 0)]
    decoder = start(target, AutoDrafter(ModelDrafter(draft)), prompts[:2], settings[:2])
    decoder.step(4)
    rows = [0, 1] + join(decoder, prompts[2:4], settings[2:4])
    decoder.step(4)
    rows += join(decoder, prompts[4:], settings[4:])
    while not decoder.done:
        decoder.step(4)
    for r, prompt, s in zip(rows, prompts, settings):
        if s.verify != "coupled":
            continue
        alone = es.autoregressive_generate(target, ids(prompt), max_new_tokens=s.max_new_tokens,
                                           temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                           eos_token_id=[])
        assert decoder.rows.new[r] == alone.sequences[0, len(prompt):].tolist(), r


def test_batches_with_neighbouring_seeds_share_no_row(tiny_pair):
    """Row b's noise comes from (seed, b): a batch seeded 1 is not the batch seeded 0 shifted by
    one row (which would make 7 of 8 samples repeats in a seed sweep)."""
    target, _ = tiny_pair
    ids_ = torch.tensor([PROMPTS[2]]).expand(8, -1)
    rows = [set(map(tuple, es.autoregressive_generate(target, ids_, max_new_tokens=12, seed=s,
                                                      eos_token_id=[]).sequences.tolist()))
            for s in (0, 1)]
    assert not rows[0] & rows[1]


def test_generate_plug_in_coupled_equals_its_plain_decoding(tiny_pair):
    """Through Transformers' generate() with a repetition penalty (processing that reads the
    prefix): the coupled rule's rows are those of draft=None with the same seed."""
    import exactspec.hf as eh

    target, _ = tiny_pair
    draft = copy.deepcopy(target)
    draft.lm_head.weight.add_(0.3 * draft.lm_head.weight.std() * torch.randn(draft.lm_head.weight.shape,
                                                                             generator=torch.Generator().manual_seed(0)))
    ids_, mask = ragged(4)
    call = dict(attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=0.9,
                repetition_penalty=1.3, pad_token_id=2, custom_generate=eh.generate, seed=5)
    plain = target.generate(ids_, **call)
    out = target.generate(ids_, draft=draft, gamma=4, verify="coupled", return_dict_in_generate=True, **call)
    assert torch.equal(out.sequences, plain) and out.exactspec_stats.accepted_drafts > 0
