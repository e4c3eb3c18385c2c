"""Exactness of the token sampler: enumeration in float64, statistical tests, and input checks."""
import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import exactspec as es
from exactspec.verify import next_token_weights, stop_distribution
from conftest import ALPHA, chi_square_pvalue, round_ends

# Statistical tests fail by chance with probability ALPHA each (fixed seeds make them repeatable).


# --------------------------------------------------------------------------- probs_from_logits


def hf_probs(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("top_k", [None, 1, 5, 40])
@pytest.mark.parametrize("top_p", [None, 0.3, 0.9, 1.0])
def test_probs_from_logits_matches_transformers_warpers(dtype, temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen, dtype=dtype) * 3
    tied = logits.round()  # many ties, some at the top-k / top-p cut-off
    for x in (logits, tied):
        ours = es.probs_from_logits(x, temperature, top_k, top_p)
        torch.testing.assert_close(ours, hf_probs(x, temperature, top_k, top_p), rtol=0, atol=1e-7)


def test_greedy_is_one_hot_at_lowest_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    probs = es.probs_from_logits(logits, temperature=0, top_k=2, top_p=0.5)
    assert probs.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_sample_follows_the_weights_and_a_single_positive_weight_draws_nothing():
    """Inverse-CDF draws against w / Σ w (chi-square, α = ALPHA; 20,000 weighted rows in one call,
    each beside a one-hot row). A row with a single positive weight is that token and takes no
    uniform from its generator, so each other row draws what it would draw alone (rule 8)."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.5, 0.0, 2.5])
    one_hot = torch.tensor([0.0, 0.0, 0.0, 7.0, 0.0, 0.0])
    tokens = es.sampling.sample(torch.stack([weights, one_hot]).repeat(20_000, 1),
                                torch.Generator().manual_seed(0))  # [40,000]
    assert (tokens[1::2] == 3).all()
    counts = torch.bincount(tokens[0::2], minlength=6).float()
    assert chi_square_pvalue(counts, weights / weights.sum()) > ALPHA
    generators = [torch.Generator().manual_seed(seed) for seed in (1, 2, 3)]
    mixed = es.sampling.sample(torch.stack([one_hot, weights, one_hot]), generators)
    alone = es.sampling.sample(weights.unsqueeze(0), [torch.Generator().manual_seed(2)])
    assert mixed.tolist() == [3, int(alone), 3]
    assert torch.equal(generators[0].get_state(), torch.Generator().manual_seed(1).get_state())


@pytest.mark.parametrize("vocab", [6, 10_000])
def test_single_positive_rows_are_found_alike_in_short_and_long_rows(vocab):
    """`sample`'s rows with one positive weight are found row by row in NumPy for long rows and
    all at once in torch for short ones: the same tokens, -1 for rows with none or several."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.zeros(5, vocab)
    flat[0, vocab - 1] = 2.0  # lone, last entry
    flat[1, 0] = 1e-30  # lone, first entry, tiny
    flat[2, [1, 3]] = 0.5  # two positive weights
    flat[4] = torch.rand(vocab, generator=gen)  # dense; row 3 stays all zero
    assert es.sampling._lone_positives(flat).tolist() == [vocab - 1, 0, -1, -1, -1]


@pytest.mark.parametrize("verify", ["token", "block"])
def test_a_round_without_drafts_draws_from_p(verify):
    """γ = 0 (a round that stepped aside): τ = 0 and the token follows p_1 (chi-square over
    20,000 rows in one call)."""
    p = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4])
    rows = 20_000
    result = es.verify_block(torch.empty(rows, 0, dtype=torch.long), None, p.expand(rows, 1, 5),
                             torch.Generator().manual_seed(0), verify)
    assert result.tokens.shape == (rows, 1) and not result.num_accepted.any()
    assert chi_square_pvalue(torch.bincount(result.tokens[:, 0], minlength=5).float(), p) > ALPHA


def test_probs_from_logits_half_precision_is_float32():
    logits = torch.randn(3, 10).to(torch.bfloat16)
    probs = es.probs_from_logits(logits, 0.8)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, r"temperature must be a finite number >= 0, got -0.1"),
    ({"temperature": math.nan}, r"temperature .* got nan"),
    ({"top_k": 0}, r"top_k must be an integer >= 1 or None, got 0"),
    ({"top_k": 2.5}, r"top_k .* got 2.5"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
])
def test_probs_from_logits_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        es.probs_from_logits(torch.zeros(4), **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_probs_from_logits_rejects_nan_and_inf(bad, temperature):
    """In any row, beside -inf too (a row's maximum is NaN or +inf then, whatever else it holds)."""
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        es.probs_from_logits(torch.tensor([0.0, bad]), temperature)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        es.probs_from_logits(torch.tensor([[0.0, 1.0], [-math.inf, bad]]), temperature)


def test_probs_from_logits_rejects_an_empty_vocabulary():
    with pytest.raises(ValueError, match="vocabulary dimension is empty"):
        es.probs_from_logits(torch.zeros(2, 0))


# --------------------------------------------------------------------------- enumeration


def random_dist(gen, vocab, kind):
    """A float64 distribution of one of the awkward kinds the rule must survive."""
    if kind == "one_hot":
        return torch.nn.functional.one_hot(torch.randint(vocab, (), generator=gen), vocab).double()
    weights = torch.rand(vocab, generator=gen, dtype=torch.float64)
    if kind == "zeros":
        weights[torch.randperm(vocab, generator=gen)[: vocab // 2]] = 0
    return weights / weights.sum()


class PrefixTables:
    """Target and draft distributions that depend on the whole prefix (memoized per prefix)."""

    KINDS = ("dense", "zeros", "one_hot", "equal")

    def __init__(self, vocab, seed, point_mass=False):
        self.vocab, self.point_mass = vocab, point_mass
        self.gen = torch.Generator().manual_seed(seed)
        self.tables = {}

    def _both(self, prefix):
        if prefix not in self.tables:
            kind_p, kind_q = (self.KINDS[int(torch.randint(4, (), generator=self.gen))] for _ in "pq")
            p = random_dist(self.gen, self.vocab, "dense" if kind_p == "equal" else kind_p)
            q = p.clone() if kind_q == "equal" else random_dist(self.gen, self.vocab, kind_q)
            self.tables[prefix] = (p, q)
        return self.tables[prefix]

    def p(self, prefix):
        return self._both(prefix)[0]

    def q(self, prefix):
        return self._both(prefix)[1]

    def draft_token(self, prefix):
        """The point-mass drafter's deterministic proposal."""
        return int(self.q(prefix).argmax())

    def target_joint(self, seq):
        return math.prod(self.p(seq[:i])[t].item() for i, t in enumerate(seq))


def round_outcomes(tables, gamma, verify):
    """Yield (probability, emitted tokens) for every draft block and every outcome of one round,
    using the library's exact law of τ and its next-token weights."""
    vocab = tables.vocab
    blocks = ([()] if gamma == 0 else itertools.product(range(vocab), repeat=gamma))
    if tables.point_mass:
        block, prefix = [], ()
        for _ in range(gamma):
            block.append(tables.draft_token(prefix))
            prefix += (block[-1],)
        blocks = [tuple(block)]
    for block in blocks:
        prefixes = [block[:i] for i in range(gamma + 1)]
        if tables.point_mass:
            q, weight = None, 1.0
        else:
            q = torch.stack([tables.q(pre) for pre in prefixes[:-1]]).unsqueeze(0)  # [1, γ, V]
            weight = math.prod(tables.q(pre)[x].item() for pre, x in zip(prefixes, block))
        if weight == 0:
            continue
        p = torch.stack([tables.p(pre) for pre in prefixes]).unsqueeze(0)  # [1, γ+1, V]
        draft = torch.tensor([block], dtype=torch.long).view(1, gamma)  # [1, γ]
        yield from round_ends(block, weight, draft, q, p, verify)


def round_then_target(tables, gamma, verify):
    """Distribution over length-(γ+1) sequences: one round, then the target samples the rest."""
    dist = {}
    for prob, emitted in round_outcomes(tables, gamma, verify):
        for tail in itertools.product(range(tables.vocab), repeat=gamma + 1 - len(emitted)):
            seq = emitted + tail
            tail_prob = math.prod(tables.p(seq[:i])[seq[i]].item()
                                  for i in range(len(emitted), gamma + 1))
            dist[seq] = dist.get(seq, 0.0) + prob * tail_prob
    return dist


def expected_emitted(tables, gamma, verify):
    return sum(prob * len(emitted) for prob, emitted in round_outcomes(tables, gamma, verify))


CASES = [(vocab, gamma, seed) for vocab in (2, 3, 4) for gamma in (1, 2, 3, 4) for seed in range(3)]


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
@pytest.mark.parametrize("vocab, gamma, seed", CASES)
def test_round_keeps_target_joint_distribution_exactly(vocab, gamma, seed, point_mass, verify):
    tables = PrefixTables(vocab, seed, point_mass)
    dist = round_then_target(tables, gamma, verify)
    for seq in itertools.product(range(vocab), repeat=gamma + 1):
        assert dist.get(seq, 0.0) == pytest.approx(tables.target_joint(seq), abs=1e-12), seq


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
def test_block_rule_emits_at_least_as_many_tokens_as_token_rule(point_mass):
    """Block ≥ token everywhere, and strictly more somewhere when q is a real distribution.
    For a point-mass draft the token rule already keeps a block with its full target
    probability Π p_i(x_i), so the two rules tie."""
    gains = []
    for vocab, gamma, seed in CASES:
        tables = PrefixTables(vocab, seed, point_mass)
        token, block = (expected_emitted(tables, gamma, m) for m in ("token", "block"))
        assert block >= token - 1e-12, (vocab, gamma, seed)
        gains.append(block - token)
    if point_mass:
        assert max(gains) < 1e-12
    else:
        assert max(gains) > 1e-3


def test_reference_example_by_enumeration():
    """q = [0.6, 0.3, 0.1], p = [0.3, 0.4, 0.3]: acceptance [0.5, 1, 1], residual [0, 1/3, 2/3]."""
    q = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    p = torch.tensor([0.3, 0.4, 0.3], dtype=torch.float64)
    drafts = torch.arange(3).view(3, 1)  # [3, 1]
    q_block, p_block = q.expand(3, 1, 3), p.expand(3, 2, 3)
    accept = es.verify.acceptance_probs(drafts, q_block, p_block)[:, 0]
    torch.testing.assert_close(accept, torch.tensor([0.5, 1, 1], dtype=torch.float64))
    residual = next_token_weights(drafts[:1], q_block[:1], p_block[:1], torch.tensor([0]))[0]
    torch.testing.assert_close(residual / residual.sum(), torch.tensor([0, 1 / 3, 2 / 3],
                                                                       dtype=torch.float64))
    expected_accepted = 10_000 * q * accept
    torch.testing.assert_close(expected_accepted, torch.tensor([3000.0, 3000, 1000],
                                                               dtype=torch.float64))


# --------------------------------------------------------------------------- statistics


def test_reference_example_simulation():
    """10,000 proposals: the emitted counts match 3000/4000/3000 (chi-square, α = 1e-6)."""
    gen = torch.Generator().manual_seed(2024)
    q = torch.tensor([0.6, 0.3, 0.1])
    p = torch.tensor([0.3, 0.4, 0.3])
    drafts = es.sampling.sample(q.expand(10_000, 3), gen).view(-1, 1)  # [N, 1]
    result = es.verify_block(drafts, q.expand(10_000, 1, 3), p.expand(10_000, 2, 3), gen)
    counts = torch.bincount(result.tokens[:, 0], minlength=3)
    assert chi_square_pvalue(counts, p) > ALPHA
    accepted = torch.bincount(drafts[result.num_accepted == 1, 0], minlength=3)
    assert chi_square_pvalue(accepted, torch.tensor([0.3, 0.3, 0.1]) / 0.7) > ALPHA


@pytest.mark.parametrize("point_mass", [False, True], ids=["q", "point_mass"])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_verify_block_statistics_large_batch(verify, point_mass):
    """200,000 rows, V = 10, γ = 3: the first emitted token ~ p[0], and among rows that kept
    draft 1 the second emitted token ~ p[1] (chi-square, α = 1e-6 each)."""
    gen = torch.Generator().manual_seed(7)
    rows, vocab, gamma = 200_000, 10, 3
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen), -1)  # [γ+1, V]
    q = torch.softmax(torch.randn(gamma, vocab, generator=gen), -1)  # [γ, V]
    if point_mass:
        drafts, q_rows = q.argmax(-1).expand(rows, gamma), None
    else:
        drafts = es.sampling.sample(q.expand(rows, gamma, vocab), gen)  # [N, γ]
        q_rows = q.expand(rows, gamma, vocab)
    result = es.verify_block(drafts, q_rows, p.expand(rows, gamma + 1, vocab), gen, verify)
    first = torch.bincount(result.tokens[:, 0], minlength=vocab)
    assert chi_square_pvalue(first, p[0]) > ALPHA
    kept_one = result.num_accepted >= 1
    second = torch.bincount(result.tokens[kept_one, 1], minlength=vocab)
    if verify == "token":  # given x_1 was kept, the rule restarts: the next token ~ p[1]
        assert chi_square_pvalue(second, p[1]) > ALPHA
    assert (result.tokens[:, 0] >= 0).all()


@pytest.mark.parametrize("verify", ["token", "block"])
def test_sampled_stop_position_follows_exact_law(verify):
    """The vectorized draw of τ against the enumerated law (chi-square, α = 1e-6)."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab, gamma = 100_000, 6, 4
    p = torch.softmax(torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    draft = q.argmax(-1).view(1, gamma)  # one fixed block, q given
    law = stop_distribution(draft, q.unsqueeze(0), p.unsqueeze(0), verify)[0]
    result = es.verify_block(draft.expand(rows, gamma), q.expand(rows, gamma, vocab),
                             p.expand(rows, gamma + 1, vocab), gen, verify)
    counts = torch.bincount(result.num_accepted, minlength=gamma + 1)
    assert chi_square_pvalue(counts, law) > ALPHA


# --------------------------------------------------------------------------- behaviour


def test_block_result_layout():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, 4, 5, generator=gen), -1)
    q = torch.softmax(torch.randn(64, 3, 5, generator=gen), -1)
    drafts = es.sampling.sample(q, gen)
    result = es.verify_block(drafts, q, p, gen)
    for row in range(64):
        n = result.num_accepted[row].item()
        assert result.tokens[row, :n].tolist() == drafts[row, :n].tolist()
        assert result.tokens[row, n] >= 0
        assert (result.tokens[row, n + 1:] == -1).all()
    assert torch.equal(result.num_emitted, result.num_accepted + 1)


@pytest.mark.parametrize("verify", ["token", "block"])
def test_same_seed_same_result(verify):
    p = torch.softmax(torch.randn(32, 5, 50), -1)
    q = torch.softmax(torch.randn(32, 4, 50), -1)
    drafts = es.sampling.sample(q, torch.Generator().manual_seed(1))
    runs = [es.verify_block(drafts, q, p, torch.Generator().manual_seed(5), verify) for _ in "ab"]
    assert torch.equal(runs[0].tokens, runs[1].tokens)


def test_greedy_accepts_exactly_when_draft_is_target_argmax():
    gen = torch.Generator().manual_seed(3)
    logits_p = torch.randn(500, 4, 7, generator=gen)
    logits_q = logits_p + 0.7 * torch.randn(500, 4, 7, generator=gen)
    p, q = es.probs_from_logits(logits_p, 0), es.probs_from_logits(logits_q[:, :3], 0)
    drafts = q.argmax(-1)  # [B, 3]
    matches = (drafts == p[:, :3].argmax(-1)).long().cumprod(1).sum(1)  # leading agreements
    token = es.verify_block(drafts, q, p, gen, "token")
    block = es.verify_block(drafts, q, p, gen, "block")
    assert torch.equal(token.num_accepted, matches)
    assert torch.equal(token.tokens, block.tokens)
    rows = torch.arange(500)
    assert torch.equal(token.tokens[rows, matches], p.argmax(-1)[rows, matches])


def test_equal_distributions_accept_everything():
    p = torch.softmax(torch.randn(100, 4, 9), -1)
    drafts = es.sampling.sample(p[:, :3], torch.Generator().manual_seed(0))
    result = es.verify_block(drafts, p[:, :3].clone(), p, torch.Generator().manual_seed(1))
    assert (result.num_accepted == 3).all()


def test_verify_token_reference_example():
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.6, 0.3, 0.1])
    p = torch.tensor([0.3, 0.4, 0.3])
    assert es.verify_token(1, q, p, gen) == (1, True)  # dog: p/q > 1, always kept
    outcomes = [es.verify_token(0, q, p, gen) for _ in range(400)]
    rejected = [tok for tok, accepted in outcomes if not accepted]
    assert 100 < len(rejected) < 300  # kept with probability 1/2
    assert set(rejected) <= {1, 2}  # the residual has no mass on cat


def test_verify_block_handles_large_vocab_and_gamma():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1, 33, 256_000, generator=gen), -1)
    q = torch.softmax(torch.randn(1, 32, 256_000, generator=gen), -1)
    drafts = es.sampling.sample(q, gen)
    result = es.verify_block(drafts, q, p, gen)
    assert result.tokens.shape == (1, 33)


@pytest.mark.parametrize("mutate, message", [
    (lambda d, q, p: (d, q, p * float("nan")), r"p must be finite"),
    (lambda d, q, p: (d, -q, p), r"q must be non-negative"),
    (lambda d, q, p: (d, q * 2, p), r"q must sum to 1 over the vocabulary"),
    (lambda d, q, p: (d + 100, q, p), r"draft_tokens must be in \[0, 5\), got 10\d"),
    (lambda d, q, p: (d - 100, q, p), r"draft_tokens must be in \[0, 5\), got -\d+"),
    (lambda d, q, p: (d.float(), q, p), r"draft_tokens must be a LongTensor\[B, γ\]"),
    (lambda d, q, p: (d, q, p[:, :2]), r"p must have shape \[B, γ\+1, V\] = \[2, 3, V\]"),
    (lambda d, q, p: (d, q[:, :1], p), r"q must have shape \[B, γ, V\] = \[2, 2, 5\]"),
    (lambda d, q, p: (d, torch.nn.functional.one_hot((d + 1) % 5, 5).float(), p),
     r"has zero probability under q"),
])
def test_verify_block_rejects_bad_input(mutate, message):
    p = torch.softmax(torch.randn(2, 3, 5), -1)
    q = torch.softmax(torch.randn(2, 2, 5), -1)
    drafts = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match=message):
        es.verify_block(*mutate(drafts, q, p))


def test_verify_block_rejects_unknown_method():
    p = torch.softmax(torch.randn(1, 2, 5), -1)
    with pytest.raises(ValueError, match=r"verify must be one of \('token', 'block', 'coupled'\), got 'tree'"):
        es.verify_block(torch.tensor([[0]]), None, p, verify="tree")
