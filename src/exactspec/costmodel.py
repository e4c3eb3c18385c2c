"""The cost model: does drafting pay for itself?

Words: α (alpha) is the chance that one draft token is accepted, γ (gamma) the block length,
c the cost of one draft token in units of one target pass.

    E[N]        = Σ_{k=0..γ} α^k                   expected output tokens per round
    S(α, γ, c)  = E[N] / (1 + c·γ)                  speedup over plain decoding

The measured form replaces the idealized costs with timings: a round costs γ draft tokens plus
one target pass over γ+1 tokens, while plain decoding costs one target pass over one token per
output token.
"""
from __future__ import annotations

import math

import torch


def _check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return float(alpha)


def _check_gamma(gamma: int) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma}")
    return gamma


def _check_cost(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return float(value)


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[N] = Σ_{k=0..γ} α^k: output tokens per round when each draft survives with prob. α."""
    alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
    return sum(alpha**k for k in range(gamma + 1))


def speedup(alpha: float, gamma: int, c: float) -> float:
    """S(α, γ, c) = E[N] / (1 + c·γ), with a target pass costing 1 and a draft token c."""
    c = _check_cost("c", c)
    return expected_tokens(alpha, gamma) / (1.0 + c * _check_gamma(gamma))


def best_gamma(alpha: float, c: float, max_gamma: int = 32) -> tuple[int, float]:
    """The γ in 0..max_gamma with the largest S(α, γ, c), and that speedup (smallest γ on ties)."""
    max_gamma = _check_gamma(max_gamma)
    speedups = [speedup(alpha, g, c) for g in range(max_gamma + 1)]
    gamma = max(range(max_gamma + 1), key=lambda g: (speedups[g], -g))
    return gamma, speedups[gamma]


def speedup_measured(alpha: float, gamma: int, t_target_1: float, t_target_block: float,
                     t_draft: float) -> float:
    """Predicted speedup from measured costs (seconds).

    t_target_1: one target pass over one token (plain decoding's cost per output token);
    t_target_block: one target pass over γ+1 tokens; t_draft: one draft token.
    S = E[N] · t_target_1 / (γ · t_draft + t_target_block). With t_target_block = t_target_1
    and t_draft = c · t_target_1 this is S(α, γ, c).
    """
    t_target_1 = _check_cost("t_target_1", t_target_1)
    t_target_block = _check_cost("t_target_block", t_target_block)
    t_draft = _check_cost("t_draft", t_draft)
    if t_target_1 == 0 or t_target_block == 0:
        raise ValueError("t_target_1 and t_target_block must be > 0")
    round_cost = _check_gamma(gamma) * t_draft + t_target_block
    return expected_tokens(alpha, gamma) * t_target_1 / round_cost


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """α = Σ_x min(p(x), q(x)) over the last dimension: the overlap of target and draft."""
    p, q = torch.as_tensor(p), torch.as_tensor(q)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    return torch.minimum(p, q).sum(dim=-1)


def coupled_acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The coupled rule's α: P(x = y) when the draft's x and the target's y are races over q and
    p with the same noise (`exactspec.noise`). Given E(a) = t, both races pick a when every other
    E(x) ≥ t · m(x) with m(x) = max(q(x)/q(a), p(x)/p(a)); integrating over t,
    α = Σ_a 1 / Σ_x m(x) over the tokens a with p(a) > 0 and q(a) > 0 — at most Σ min(p, q),
    which only a maximal coupling reaches. O(V²) memory: for small vocabularies."""
    p, q = torch.as_tensor(p, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    both = (p > 0) & (q > 0)  # [..., V], the tokens both races can pick
    m = torch.maximum(q.unsqueeze(-2) / q.unsqueeze(-1), p.unsqueeze(-2) / p.unsqueeze(-1))  # [..., a, x]
    return torch.where(both, 1 / m.sum(dim=-1), 0.0).sum(dim=-1)  # [...]


def ceiling(pass_seconds) -> tuple[int, float]:
    """The most any speculation can give on this machine: max over k of k · T(1) / T(k), and the
    k that reaches it (smallest on ties), from the target's pass times T(1..K) (seconds, T(k) at
    index k − 1). A round whose k − 1 drafts are all kept emits k tokens for one pass over k,
    where plain decoding pays k passes over one, at no draft cost: no draft does better."""
    times = list(pass_seconds)
    if not times:
        raise ValueError("pass_seconds is empty: need T(1..K), the target's pass over 1..K tokens")
    for k, t in enumerate(times, start=1):
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"pass_seconds must be finite numbers > 0, got T({k}) = {t}")
    gains = [k * times[0] / t for k, t in enumerate(times, start=1)]
    k = max(range(1, len(times) + 1), key=lambda n: (gains[n - 1], -n))
    return k, gains[k - 1]
