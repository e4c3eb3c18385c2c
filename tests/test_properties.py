"""Property-based tests (hypothesis) of the sampler: the distributions nobody thought of.

- The law of a round: for random V ≤ 6, γ ≤ 5, prefix-dependent p and q (exact zeros, one-hot
  rows, p = q, entries at the float32 floor, spikes near 1), both rules, with q and point-mass,
  the round's law (`stop_distribution` and `next_token_weights`) followed by the target extends
  to the target's joint distribution of γ+1 tokens, to 1e-9 in float64 (dense enumeration).
- The block rule never emits fewer tokens in expectation than the token rule.
- `verify_block` / `verify_token` outputs: in range, −1 padded, τ ≤ γ, accepted drafts are the
  drafts, and no emitted token has zero target probability; float32 and float64, inputs
  unnormalized by rounding within the documented tolerance; the sampled τ and next token follow
  the law (chi-square, α = 1e-6 per example).
- Bad input raises ValueError with the documented message, and nothing else.
- `probs_from_logits` against Transformers' warpers on logits with ties, −inf entries,
  top-k ≥ V, top-p of 1 (and 0, which is refused).

Every test is derandomized with no example database, so a run is reproducible.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import exactspec as es
from exactspec.verify import next_token_weights, stop_distribution

ALPHA = 1e-6  # false-failure rate of each statistical check (derandomized: repeatable)
RULES = ("token", "block")


def reproducible(max_examples: int):
    """Hypothesis settings shared by every test here: fixed examples, no database, no deadline."""
    return settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------- strategies

# Awkward weights: exact zeros, the float32 floor (smallest subnormal and smallest normal), tiny
# values, and ordinary ones.
FLOOR_VALUES = (0.0, 1e-45, 1.1754944e-38, 1e-30, 1e-12, 1e-7)
WEIGHT = st.one_of(st.sampled_from(FLOOR_VALUES + (0.25, 0.5, 1.0)),
                   st.floats(0.0, 1.0, width=32))


@st.composite
def distributions(draw, vocab: int) -> tuple[float, ...]:
    """A float64 probability vector of one awkward kind: one-hot, a spike near 1 over a floor of
    tiny values, or arbitrary weights (zeros and float32-floor values included)."""
    kind = draw(st.sampled_from(("weights", "one_hot", "spike")))
    top = draw(st.integers(0, vocab - 1))
    if kind == "one_hot":
        weights = [float(i == top) for i in range(vocab)]
    elif kind == "spike":
        floor = draw(st.sampled_from((1e-45, 1.1754944e-38, 1e-9, 1e-7)))
        weights = [1.0 if i == top else floor for i in range(vocab)]
    else:
        weights = draw(st.lists(WEIGHT, min_size=vocab, max_size=vocab))
        if math.fsum(weights) == 0:
            weights[top] = 1.0
    total = math.fsum(weights)
    return tuple(w / total for w in weights)


@dataclass(frozen=True)
class Tables:
    """The target's p and the draft's q at every prefix of one round, drawn from small pools (so
    hypothesis can shrink them) and assigned to prefixes by a salted hash of the prefix (an int
    tuple: the same in every process). A q entry None means q = p at that prefix.
    point_block: the deterministic proposal of a point-mass draft, else None."""

    vocab: int
    gamma: int
    p_pool: tuple
    q_pool: tuple
    salt: int
    point_block: tuple | None

    def p(self, prefix: tuple) -> tuple:
        return self.p_pool[hash((self.salt, 0, prefix)) % len(self.p_pool)]

    def q(self, prefix: tuple) -> tuple:
        q = self.q_pool[hash((self.salt, 1, prefix)) % len(self.q_pool)]
        return self.p(prefix) if q is None else q


@st.composite
def tables(draw, max_vocab: int = 6, max_gamma: int = 5) -> Tables:
    vocab = draw(st.integers(1, max_vocab))
    gamma = draw(st.integers(0, max_gamma))
    dist = distributions(vocab)
    p_pool = draw(st.lists(dist, min_size=1, max_size=3))
    q_pool = draw(st.lists(st.one_of(st.none(), dist), min_size=1, max_size=3))
    point = draw(st.booleans())
    block = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=gamma, max_size=gamma)))
    return Tables(vocab, gamma, tuple(p_pool), tuple(q_pool), draw(st.integers(0, 2**16)),
                  block if point else None)


# --------------------------------------------------------------------------- dense enumeration


def prefix_table(tab: Tables, which: str, k: int) -> torch.Tensor:
    """p (or q) at every prefix of length k, as a float64 tensor [V]*k + [V]."""
    lookup = tab.p if which == "p" else tab.q
    rows = [lookup(prefix) for prefix in itertools.product(range(tab.vocab), repeat=k)]
    return torch.tensor(rows, dtype=torch.float64).view(*[tab.vocab] * k, tab.vocab)


def at_prefixes(table: torch.Tensor, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """table[x_1..x_k] for each block: [N, V]."""
    if k == 0:
        return table.expand(blocks.size(0), -1)  # [N, V]
    return table[tuple(blocks[:, i] for i in range(k))]  # [N, V]


@dataclass
class RoundLaw:
    """A round enumerated over every draft block: emitted[k] [V]*(k+1) is the probability that
    the round emits exactly those k+1 tokens; p_tables[k] [V]*k + [V] is p at each prefix."""

    emitted: list[torch.Tensor]
    p_tables: list[torch.Tensor]
    expected_tokens: float


def round_law(tab: Tables, verify: str) -> RoundLaw:
    """Enumerate one round with the library's exact law: the weight of each block (Π q_i(x_i),
    or 1 for the point-mass proposal), `stop_distribution` for τ, `next_token_weights` for the
    correction or bonus."""
    vocab, gamma = tab.vocab, tab.gamma
    every = list(itertools.product(range(vocab), repeat=gamma))
    blocks = torch.tensor(every, dtype=torch.long).view(len(every), gamma)  # [N, γ]
    p_tables = [prefix_table(tab, "p", k) for k in range(gamma + 1)]
    p = torch.stack([at_prefixes(p_tables[k], blocks, k) for k in range(gamma + 1)], 1)  # [N, γ+1, V]
    if tab.point_block is None:
        q_rows = [at_prefixes(prefix_table(tab, "q", k), blocks, k) for k in range(gamma)]
        q = torch.stack(q_rows, 1) if gamma else p[:, :0]  # [N, γ, V]
        weight = q.gather(-1, blocks.unsqueeze(-1)).squeeze(-1).prod(-1)  # [N]
    else:
        q = None
        weight = (blocks == torch.tensor(tab.point_block)).all(-1).double()  # [N]
    keep = weight > 0  # [N], the blocks that can be proposed
    d, p_k = blocks[keep], p[keep]  # [M, γ], [M, γ+1, V]
    q_k = None if q is None else q[keep]  # [M, γ, V]
    law = stop_distribution(d, q_k, p_k, verify)  # [M, γ+1]
    assert (law >= -1e-12).all() and torch.allclose(law.sum(-1), law.new_ones(len(d)), atol=1e-12)
    emitted = []
    for tau in range(gamma + 1):
        nxt = next_token_weights(d, q_k, p_k, torch.full((len(d),), tau), verify)  # [M, V]
        mass = weight[keep, None] * law[:, tau, None] * nxt / nxt.sum(-1, keepdim=True)  # [M, V]
        dense = torch.zeros(len(blocks), vocab, dtype=torch.float64)  # [N, V]
        dense[keep] = mass
        dense = dense.view(*[vocab] * gamma, vocab)  # [V]*γ + [V]
        unused = tuple(range(tau, gamma))  # drafts after the first rejection
        emitted.append(dense.sum(unused) if unused else dense)  # [V]*(τ+1)
    expected = float((weight[keep, None] * law * torch.arange(1, gamma + 2)).sum())
    return RoundLaw(emitted, p_tables, expected)


def extend_with_target(law: RoundLaw) -> tuple[torch.Tensor, torch.Tensor]:
    """(one round then the target to γ+1 tokens, the target alone): two [V]*(γ+1) tensors."""
    extended, joint = law.emitted[0], law.p_tables[0]  # [V], [V]
    for k in range(1, len(law.p_tables)):
        extended = extended.unsqueeze(-1) * law.p_tables[k] + law.emitted[k]  # [V]*(k+1)
        joint = joint.unsqueeze(-1) * law.p_tables[k]  # [V]*(k+1)
    return extended, joint


# --------------------------------------------------------------------------- the law of a round


@reproducible(max_examples=200)
@given(tab=tables(), verify=st.sampled_from(RULES))
def test_round_law_extends_to_target_joint(tab, verify):
    """Rule 1 (exactness): a round then plain target sampling is the target's joint, to 1e-9."""
    extended, joint = extend_with_target(round_law(tab, verify))
    worst = (extended - joint).abs().max().item()
    assert worst <= 1e-9, f"round ∘ target differs from the target's joint by {worst:.3g}"


@reproducible(max_examples=60)
@given(tab=tables(max_gamma=4))
def test_block_rule_never_emits_fewer_tokens(tab):
    """E[tokens per round] under the block rule ≥ under the token rule (Sun et al. 2024)."""
    if tab.gamma == 0:
        return  # nothing to compare
    token, block = (round_law(tab, verify).expected_tokens for verify in RULES)
    assert block >= token - 1e-12, (token, block)


# --------------------------------------------------------------------------- the sampler itself


@st.composite
def rounds(draw, dtypes=(torch.float32, torch.float64), min_batch: int = 0, min_gamma: int = 0):
    """(draft_tokens [B, γ], q [B, γ, V] or None, p [B, γ+1, V]): rows of independent tables
    (q = p at some positions), drafts anywhere in q's support (tokens of tiny q included), p
    scaled off 1 by rounding within the documented tolerance of the dtype."""
    dtype = draw(st.sampled_from(dtypes))
    vocab, gamma = draw(st.integers(1, 6)), draw(st.integers(min_gamma, 5))
    batch = draw(st.integers(min_batch, 3))
    point = draw(st.booleans())
    dist = distributions(vocab)
    p = [[draw(dist) for _ in range(gamma + 1)] for _ in range(batch)]
    q = [[draw(st.one_of(dist, st.just(p[b][i]))) for i in range(gamma)] for b in range(batch)]
    slack = {torch.float32: 5e-5, torch.float64: 5e-10}[dtype]  # half the tolerance
    scale = draw(st.floats(1 - slack, 1 + slack))
    p_t = (torch.tensor(p, dtype=torch.float64) * scale).to(dtype).view(batch, gamma + 1, vocab)
    q_t = torch.tensor(q, dtype=torch.float64).to(dtype).view(batch, gamma, vocab)
    if point:
        drafts = [[draw(st.integers(0, vocab - 1)) for _ in range(gamma)] for _ in range(batch)]
    else:  # from the support of q in its final dtype (tiny entries may round to 0 in float32)
        drafts = [[draw(st.sampled_from(q_t[b, i].nonzero().flatten().tolist()))
                   for i in range(gamma)] for b in range(batch)]
    d_t = torch.tensor(drafts, dtype=torch.long).view(batch, gamma)
    return d_t, None if point else q_t, p_t


def check_block_result(result, drafts, p, gamma):
    """The layout and support rules of a BlockResult."""
    batch = drafts.size(0)
    tau = result.num_accepted  # [B]
    assert result.tokens.shape == (batch, gamma + 1) and result.tokens.dtype == torch.long
    assert tau.shape == (batch,) and ((tau >= 0) & (tau <= gamma)).all()
    for b in range(batch):
        n = int(tau[b])
        row = result.tokens[b].tolist()
        assert row[:n] == drafts[b, :n].tolist()  # accepted drafts are the drafts
        assert 0 <= row[n] < p.size(-1)  # the correction or bonus is a real token
        assert all(t == -1 for t in row[n + 1:])  # then padding
        for i, token in enumerate(row[: n + 1]):  # no emitted token has zero target probability
            assert p[b, i, token] > 0, f"row {b} emitted token {token} at {i} where p = 0"


@reproducible(max_examples=150)
@given(case=rounds(), verify=st.sampled_from(RULES), seed=st.integers(0, 2**32))
def test_verify_block_outputs_are_valid(case, verify, seed):
    drafts, q, p = case
    result = es.verify_block(drafts, q, p, torch.Generator().manual_seed(seed), verify)
    check_block_result(result, drafts, p, drafts.size(1))
    law = stop_distribution(drafts, q, p, verify)  # [B, γ+1]
    assert torch.isfinite(law).all()  # its range: see test_block_law_stays_a_probability
    assert torch.allclose(law.sum(-1), law.new_ones(drafts.size(0)), atol=1e-4)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Chi-square of counts against probs (flattened), pooling cells expected below min_expected.
    A count where the probability is 0 fails outright."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    assert counts[probs == 0].sum() == 0, "an outcome of probability 0 was sampled"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= min_expected
    observed = torch.cat([counts[big], counts[~big].sum().view(1)])
    expected = torch.cat([expected[big], expected[~big].sum().view(1)])
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    if len(expected) < 2:
        return 1.0
    return stats.chisquare(observed.numpy(), expected.numpy()).pvalue


@reproducible(max_examples=40)
@given(case=rounds(dtypes=(torch.float64,), min_batch=1, min_gamma=1), verify=st.sampled_from(RULES),
       seed=st.integers(0, 2**32))
def test_verify_block_samples_its_law(case, verify, seed):
    """4,000 copies of one row's round: the sampled (τ, next token) follows the exact law."""
    drafts, q, p = case
    copies, vocab, gamma = 4000, p.size(-1), drafts.size(1)
    d, p1 = drafts[:1].expand(copies, -1), p[:1].expand(copies, -1, -1)  # [N, γ], [N, γ+1, V]
    q1 = None if q is None else q[:1].expand(copies, -1, -1)  # [N, γ, V]
    result = es.verify_block(d, q1, p1, torch.Generator().manual_seed(seed), verify)
    law = stop_distribution(drafts[:1], None if q is None else q[:1], p[:1], verify)[0]  # [γ+1]
    nxt = torch.stack([next_token_weights(drafts[:1], None if q is None else q[:1], p[:1],
                                          torch.tensor([tau]), verify)[0]
                       for tau in range(gamma + 1)])  # [γ+1, V]
    exact = law.unsqueeze(1) * nxt / nxt.sum(-1, keepdim=True)  # [γ+1, V]
    emitted = result.tokens.gather(1, result.num_accepted.unsqueeze(1)).squeeze(1)  # [N]
    counts = torch.bincount(result.num_accepted * vocab + emitted,
                            minlength=(gamma + 1) * vocab).view(gamma + 1, vocab)
    assert chi_square_pvalue(counts, exact) > ALPHA


@reproducible(max_examples=40)
@given(case=rounds(dtypes=(torch.float64,), min_batch=1, min_gamma=1), verify=st.sampled_from(RULES),
       seed=st.integers(0, 2**32))
def test_first_emitted_token_follows_p(case, verify, seed):
    """Independent of the library's law functions: with drafts drawn from q (or one fixed
    point-mass block), the first token a round emits follows p_1 (chi-square over 4,000 rounds)."""
    drafts, q, p = case
    copies, gamma = 4000, drafts.size(1)
    generator = torch.Generator().manual_seed(seed)
    p1 = p[:1].expand(copies, -1, -1)  # [N, γ+1, V]
    if q is None:
        d, q1 = drafts[:1].expand(copies, -1), None  # [N, γ]
    else:
        q1 = q[:1].expand(copies, -1, -1)  # [N, γ, V]
        d = es.sampling.sample(q1, generator) if gamma else drafts[:1].expand(copies, -1)  # [N, γ]
    result = es.verify_block(d, q1, p1, generator, verify)
    counts = torch.bincount(result.tokens[:, 0], minlength=p.size(-1))  # [V]
    assert chi_square_pvalue(counts, p[0, 0]) > ALPHA


@reproducible(max_examples=100)
@given(data=st.data(), dtype=st.sampled_from((torch.float32, torch.float64)),
       seed=st.integers(0, 2**32))
def test_verify_token_outputs_are_valid(data, dtype, seed):
    """verify_token: an accepted token is returned as is; a token with p ≥ q (or p = 1 for a
    point mass) is always kept, one with p = 0 never; the output always has p > 0."""
    vocab = data.draw(st.integers(1, 6))
    p = torch.tensor(data.draw(distributions(vocab)), dtype=dtype)  # [V]
    q = data.draw(st.one_of(st.none(), distributions(vocab)))
    q = None if q is None else torch.tensor(q, dtype=dtype)  # [V]
    support = range(vocab) if q is None else [t for t in range(vocab) if q[t] > 0]
    token = data.draw(st.sampled_from(list(support)))
    out, accepted = es.verify_token(token, q, p, torch.Generator().manual_seed(seed))
    assert isinstance(out, int) and 0 <= out < vocab and p[out] > 0
    assert not accepted or out == token
    q_token = 1.0 if q is None else q[token]
    if p[token] >= q_token:
        assert accepted
    if p[token] == 0:
        assert not accepted


# --------------------------------------------------------------------------- bad input


def _set(tensor: torch.Tensor, value: float) -> torch.Tensor:
    out = tensor.clone()
    out.view(-1)[0] = value
    return out


def _flip_largest(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.clone()
    flat = out.view(-1)
    flat[flat.argmax()] *= -1
    return out


def _zero_q_at_draft(d, q, p):
    """q one-hot away from the draft: the draft has zero probability under q."""
    other = (d + 1) % q.size(-1)  # [B, γ]
    return d, torch.nn.functional.one_hot(other, q.size(-1)).to(q.dtype), p


# name → (a mutation of (draft_tokens, q, p, verify), the documented message); each needs
# B ≥ 1, γ ≥ 1, and "zero_q" V ≥ 2.
BAD_BLOCK_INPUTS = {
    "p_nan": (lambda d, q, p, v: (d, q, _set(p, math.nan), v), r"p must be finite, got NaN or inf"),
    "p_inf": (lambda d, q, p, v: (d, q, _set(p, math.inf), v), r"p must be finite, got NaN or inf"),
    "q_nan": (lambda d, q, p, v: (d, _set(q, math.nan), p, v), r"q must be finite, got NaN or inf"),
    "q_negative": (lambda d, q, p, v: (d, _flip_largest(q), p, v), r"q must be non-negative, got minimum -"),
    "p_unnormalized": (lambda d, q, p, v: (d, q, p * 1.01, v),
                       r"p must sum to 1 over the vocabulary, off by up to 0\.0\d"),
    "p_integer": (lambda d, q, p, v: (d, q, p.long(), v), r"p must be a floating-point tensor"),
    "token_high": (lambda d, q, p, v: (d + p.size(-1), q, p, v), r"draft_tokens must be in \[0, \d+\), got \d+"),
    "token_negative": (lambda d, q, p, v: (d - p.size(-1), q, p, v), r"draft_tokens must be in \[0, \d+\), got -\d+"),
    "tokens_int32": (lambda d, q, p, v: (d.int(), q, p, v), r"draft_tokens must be a LongTensor\[B, γ\]"),
    "tokens_1d": (lambda d, q, p, v: (d[0], q, p, v), r"draft_tokens must be a LongTensor\[B, γ\]"),
    "p_short": (lambda d, q, p, v: (d, q, p[:, :-1], v), r"p must have shape \[B, γ\+1, V\]"),
    "q_wrong_vocab": (lambda d, q, p, v: (d, q[..., :-1], p, v), r"q must have shape \[B, γ, V\]"),
    "zero_q": (lambda d, q, p, v: _zero_q_at_draft(d, q, p) + (v,), r"has zero probability under q"),
    "unknown_rule": (lambda d, q, p, v: (d, q, p, "tree"), r"verify must be one of \('token', 'block', 'coupled'\), got 'tree'"),
}


@reproducible(max_examples=120)
@given(case=rounds(min_batch=1, min_gamma=1), verify=st.sampled_from(RULES),
       bad=st.sampled_from(sorted(BAD_BLOCK_INPUTS)))
def test_verify_block_bad_input_raises_documented_error(case, verify, bad):
    drafts, q, p = case
    if bad == "zero_q" and p.size(-1) < 2:
        return  # with one token, q cannot miss the draft
    if q is None:  # the q mutations need a q: a valid one, sampled-from by construction
        q = torch.nn.functional.one_hot(drafts, p.size(-1)).to(p.dtype)  # [B, γ, V]
    mutate, message = BAD_BLOCK_INPUTS[bad]
    args = mutate(drafts, q, p, verify)
    with pytest.raises(ValueError, match=message):
        es.verify_block(args[0], args[1], args[2], torch.Generator().manual_seed(0), args[3])
    with pytest.raises(ValueError, match=message):  # the law refuses it in the same words
        stop_distribution(args[0], args[1], args[2], args[3])


@pytest.mark.parametrize("token, q, p, message", [
    (5, None, torch.tensor([0.5, 0.5]), r"token must be an int in \[0, 2\), got 5"),
    (-1, None, torch.tensor([0.5, 0.5]), r"token must be an int in \[0, 2\), got -1"),
    (1.0, None, torch.tensor([0.5, 0.5]), r"token must be an int in \[0, 2\), got 1\.0"),
    (0, torch.tensor([1.0]), torch.tensor([0.5, 0.5]), r"p and q must be vectors of the same length"),
    (0, None, torch.tensor([[0.5, 0.5]]), r"p and q must be vectors of the same length"),
    (0, None, torch.tensor([math.nan, 0.5]), r"p must be finite"),
    (0, torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.5]), r"has zero probability under q"),
])
def test_verify_token_bad_input(token, q, p, message):
    with pytest.raises(ValueError, match=message):
        es.verify_token(token, q, p)


# --------------------------------------------------------------------------- probs_from_logits


LOGIT = st.one_of(st.integers(-3, 3).map(float),  # ties
                  st.just(-math.inf),
                  st.floats(-30, 30, allow_nan=False),
                  st.sampled_from([-1e4, 1e4]))


@st.composite
def logits(draw):
    """logits [B, V] with ties and −inf entries, at least one finite entry per row."""
    dtype = draw(st.sampled_from((torch.float32, torch.float64)))
    batch, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    rows = []
    for _ in range(batch):
        row = draw(st.lists(LOGIT, min_size=vocab, max_size=vocab))
        if not any(math.isfinite(x) for x in row):
            row[draw(st.integers(0, vocab - 1))] = 0.0
        rows.append(row)
    return torch.tensor(rows, dtype=dtype)


def hf_probs(x: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """Transformers' warpers in Transformers' order, then softmax (top-p applied even at 1)."""
    scores = TemperatureLogitsWarper(temperature)(None, x.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


@reproducible(max_examples=300)
@given(x=logits(),
       temperature=st.one_of(st.sampled_from([0.0, 1e-3, 0.5, 1.0, 2.5]), st.floats(0.05, 5.0)),
       top_k=st.one_of(st.none(), st.integers(1, 12)),
       top_p=st.one_of(st.none(), st.sampled_from([1.0, 1e-9, 0.5]), st.floats(0.01, 1.0)))
def test_probs_from_logits_matches_transformers(x, temperature, top_k, top_p):
    ours = es.probs_from_logits(x, temperature, top_k, top_p)  # [B, V]
    assert ours.dtype == x.dtype and torch.isfinite(ours).all() and (ours >= 0).all()
    assert (ours[torch.isneginf(x)] == 0).all()  # −inf logits get zero probability
    if temperature == 0:  # greedy: one-hot at the lowest argmax, whatever top-k / top-p say
        expected = torch.nn.functional.one_hot(x.argmax(-1), x.size(-1)).to(x.dtype)
        assert torch.equal(ours, expected)
        return
    theirs = hf_probs(x, temperature, top_k, top_p)
    atol = 1e-6 if x.dtype == torch.float32 else 1e-12
    torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
    assert torch.equal(ours == 0, theirs == 0)  # the same support


@reproducible(max_examples=30)
@given(x=logits(), top_k=st.integers(1, 20))
def test_top_k_at_least_vocab_changes_nothing(x, top_k):
    top_k = max(top_k, x.size(-1))
    assert torch.equal(es.probs_from_logits(x, 0.7, top_k), es.probs_from_logits(x, 0.7))


@pytest.mark.parametrize("kwargs, message", [
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
    ({"top_p": -0.5}, r"top_p must be in \(0, 1\], got -0\.5"),
    ({"top_p": 1.0000001}, r"top_p must be in \(0, 1\], got 1\.0000001"),
    ({"top_p": math.nan}, r"top_p must be in \(0, 1\], got nan"),
    ({"top_k": 0}, r"top_k must be an integer >= 1 or None, got 0"),
    ({"top_k": True}, r"top_k must be an integer >= 1 or None, got True"),
    ({"temperature": -1e-9}, r"temperature must be a finite number >= 0, got -1e-09"),
    ({"temperature": math.inf}, r"temperature must be a finite number >= 0, got inf"),
])
def test_probs_from_logits_refuses_bad_settings(kwargs, message):
    """Transformers would accept top_p = 0 (keeping only the top token); exactspec documents
    (0, 1] and refuses 0 by name."""
    with pytest.raises(ValueError, match=message):
        es.probs_from_logits(torch.zeros(2, 4), **kwargs)


# --------------------------------------------------------------------------- regressions
# Found by the properties above (float32-floor values, γ = 0) and by forcing u = 0.


@pytest.mark.parametrize("verify", RULES)
def test_zero_probability_draft_is_never_kept_even_at_u_zero(verify, monkeypatch):
    """torch.rand draws from [0, 1), so u = 0 happens (2^-24 per draw in float32). A draft with
    p(x) = 0 must still be rejected: the block rule compares η < h, not η ≤ h."""
    real_rand = torch.rand

    def zeros(*args, **kwargs):  # the same call, every uniform exactly 0
        return real_rand(*args, **kwargs).zero_()

    monkeypatch.setattr(torch, "rand", zeros)
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])  # [1, 2, 2]: p_1(0) = 0
    q = torch.tensor([[[1.0, 0.0]]])  # [1, 1, 2]: the draft proposed token 0
    result = es.verify_block(torch.tensor([[0]]), q, p, torch.Generator().manual_seed(0), verify)
    assert result.num_accepted.item() == 0 and result.tokens[0, 0].item() == 1


def test_block_rule_survives_subnormal_q():
    """A float32 q at the subnormal floor makes p/q overflow to inf; after an earlier zero
    survival the block rule must keep 0 (not 0 · inf = NaN)."""
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5], [0.5, 0.5]]])  # [1, 3, 2]: x_1 = 0 has p = 0
    q = torch.tensor([[[0.5, 0.5], [1.0 - 1e-45, 1e-45]]])  # [1, 2, 2]: x_2 = 1 has q = 1e-45
    drafts = torch.tensor([[0, 1]])
    law = stop_distribution(drafts, q, p, "block")
    assert torch.isfinite(law).all() and law[0, 0] == 1
    result = es.verify_block(drafts, q, p, torch.Generator().manual_seed(0), "block")
    assert result.num_accepted.item() == 0


def test_all_minus_inf_logits_are_refused():
    """A row with no finite logit has no distribution: an error, not silent NaN (rule 2)."""
    with pytest.raises(ValueError, match="-inf everywhere"):
        es.probs_from_logits(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]))


@pytest.mark.parametrize("verify", RULES)
def test_law_at_gamma_zero(verify):
    """γ = 0 (plain decoding's round): τ = 0 with probability 1, shape [B, 1]."""
    p = torch.tensor([[[0.25, 0.75]]])  # [1, 1, 2]
    law = stop_distribution(torch.zeros(1, 0, dtype=torch.long), None, p, verify)
    assert law.tolist() == [[1.0]]


def test_block_law_stays_a_probability():
    """float32 p off 1 by 2.5e-5 (inside the documented 1e-4 tolerance): a_1 = 1 and x_2 has
    p = 0, so in exact arithmetic h_1 = r / r = 1 and the law is [0, 1, 0]."""
    p = torch.tensor([[[1.000025, 0.0], [1.000025, 0.0], [0.5, 0.5]]])  # [1, 3, 2]
    q = torch.tensor([[[1.0, 0.0], [1 - 1e-6, 1e-6]]])  # [1, 2, 2]
    law = stop_distribution(torch.tensor([[0, 1]]), q, p, "block")[0]  # [3]
    assert (law >= 0).all() and (law <= 1).all(), law.tolist()  # got [-0.0023, 1.0023, 0]
