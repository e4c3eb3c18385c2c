"""Classical rejection sampling: the reference's continuous lab.

Vocabulary (used verbatim below):

- target f: an unnormalized density we can evaluate, zero outside its support [a, b].
  Z = ∫ f is its normalizing constant; the samples we want follow f / Z.
- proposal g: a normalized density we can sample from (a frozen `scipy.stats` distribution).
- envelope C·g: must cover the target everywhere on the support, C·g(x) ≥ f(x).
- candidate x ~ g and height h = u·C·g(x) with u ~ Uniform[0, 1): the candidate is accepted
  when h < f(x), i.e. with probability f(x) / (C·g(x)). Candidates outside the support are
  rejected (f is zero there) and stay in the acceptance-rate denominator.
- acceptance rate: accepted / proposed; in theory ∫ g · f/(C·g) = Z / C.

Randomness comes only from a `numpy.random.Generator` passed in; nothing here touches global
random state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
from scipy import integrate, optimize, stats

REFERENCE_SUPPORT = (-3.0, 3.0)

# Candidates drawn at once by `run` / `rvs`; bounds memory for large runs.
_CHUNK = 1 << 20


def reference_target(x):
    """The reference's f(x) = exp(−x²/2)·[sin²(6+x) + 3cos²(x)sin²(4x) + 1] on [−3, 3], 0 outside.

    Vectorized over NumPy arrays; a scalar in gives a float out.
    """
    x = np.asarray(x, dtype=float)
    bracket = np.sin(6 + x) ** 2 + 3 * np.cos(x) ** 2 * np.sin(4 * x) ** 2 + 1
    inside = (x >= REFERENCE_SUPPORT[0]) & (x <= REFERENCE_SUPPORT[1])
    out = np.where(inside, np.exp(-x**2 / 2) * bracket, 0.0)
    return float(out) if out.ndim == 0 else out


reference_target.support = REFERENCE_SUPPORT  # read by RejectionSampler when support is None
seed_target = reference_target  # its name in the public API contract


class EnvelopeError(ValueError):
    """C·g(x) < f(x) somewhere on the support: the sampler would not follow f / Z."""

    def __init__(self, x: float, target_value: float, envelope_value: float, C: float):
        self.x, self.C = x, C
        self.target_value, self.envelope_value = target_value, envelope_value
        self.shortfall = target_value - envelope_value
        super().__init__(
            f"envelope below the target at x = {x:.6g}: C·g(x) = {envelope_value:.6g} < "
            f"f(x) = {target_value:.6g} (shortfall {self.shortfall:.3g}) with C = {C:g}; "
            "increase C or choose another proposal")


@dataclass(frozen=True)
class RejectionRun:
    """The outcome of `n_proposed` candidates: the accepted ones, in the order drawn."""

    samples: np.ndarray
    n_proposed: int
    n_accepted: int
    acceptance_rate: float

    @property
    def standard_error(self) -> float:
        """Binomial standard error of the observed acceptance rate."""
        r = self.acceptance_rate
        return math.sqrt(r * (1 - r) / self.n_proposed)


@dataclass(frozen=True)
class Proposals:
    """Candidates with their heights h = u·C·g(x); accepted where h < f(x) inside the support."""

    x: np.ndarray
    height: np.ndarray
    accepted: np.ndarray


# --------------------------------------------------------------------------- numerics


def normalizing_constant(f: Callable, support: tuple[float, float] = REFERENCE_SUPPORT) -> float:
    """Z = ∫_a^b f(x) dx by adaptive quadrature (`scipy.integrate.quad`)."""
    a, b = _check_support(support)
    value, _ = integrate.quad(lambda t: float(f(t)), a, b, limit=200, epsabs=1e-12, epsrel=1e-12)
    return value


def refined_minimum(h: Callable, a: float, b: float, *, n_grid: int = 20001,
                    n_refine: int = 8) -> tuple[float, float]:
    """The global minimum of h on [a, b]: (x, h(x)).

    Rule: evaluate h on a dense grid, then refine the `n_refine` lowest local minima of the
    grid with a bounded local optimizer between their neighbours. The grid finds the basin;
    the optimizer finds the bottom of it.
    """
    grid = np.linspace(a, b, n_grid)  # [n_grid]
    values = np.asarray(h(grid), dtype=float)  # [n_grid]
    padded = np.concatenate([[np.inf], values, [np.inf]])
    local = np.flatnonzero((values <= padded[:-2]) & (values <= padded[2:]))
    candidates = local[np.argsort(values[local])[:n_refine]]
    best_x, best_value = grid[np.argmin(values)], float(values.min())
    for i in candidates:
        lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, n_grid - 1)]
        result = optimize.minimize_scalar(lambda t: float(h(np.array([t]))[0]), bounds=(lo, hi),
                                          method="bounded", options={"xatol": 1e-12})
        if result.fun < best_value:
            best_x, best_value = float(result.x), float(result.fun)
    return float(best_x), best_value


def target_maximum(f: Callable, support: tuple[float, float] = REFERENCE_SUPPORT) -> tuple[float, float]:
    """(x, f(x)) at the target's maximum on the support, by `refined_minimum` of −f."""
    a, b = _finite_bounds(_check_support(support), None)
    x, value = refined_minimum(lambda t: -np.asarray(f(t), dtype=float), a, b)
    return x, -value


def numerical_cdf(f: Callable, support: tuple[float, float] = REFERENCE_SUPPORT, *,
                  n_grid: int = 200001) -> Callable:
    """F(x) = ∫_a^x f / Z, by cumulative Simpson integration on a fine grid and linear
    interpolation between grid points (0 left of the support, 1 right of it)."""
    a, b = _check_support(support)
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"support must be finite for numerical_cdf, got {support}")
    grid = np.linspace(a, b, n_grid)  # [n_grid]
    cumulative = integrate.cumulative_simpson(np.asarray(f(grid), dtype=float), x=grid, initial=0)
    cdf = cumulative / cumulative[-1]

    def cdf_function(x):
        return np.interp(x, grid, cdf, left=0.0, right=1.0)

    return cdf_function


# --------------------------------------------------------------------------- argument checks


def _check_support(support) -> tuple[float, float]:
    try:
        a, b = (float(v) for v in support)
    except (TypeError, ValueError):
        raise ValueError(f"support must be a pair (a, b), got {support!r}") from None
    if not a < b:
        raise ValueError(f"support must have a < b, got {support!r}")
    return a, b


def _finite_bounds(support: tuple[float, float], proposal) -> tuple[float, float]:
    """The part of the support the envelope check can grid: an unbounded end is cut at the
    proposal's 1e-12 tail quantile."""
    a, b = support
    if math.isfinite(a) and math.isfinite(b):
        return a, b
    if proposal is None:
        raise ValueError(f"support must be finite here, got {support}")
    lo, hi = proposal.ppf(1e-12), proposal.ppf(1 - 1e-12)
    return (a if math.isfinite(a) else float(lo)), (b if math.isfinite(b) else float(hi))


def _check_count(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_rng(name: str, rng) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"{name} must be a numpy.random.Generator, got {type(rng).__name__}")
    return rng


# --------------------------------------------------------------------------- the sampler


class RejectionSampler:
    """Sample f / Z by proposing from g and accepting where u·C·g(x) < f(x).

    target: f, vectorized over NumPy arrays, non-negative.
    proposal: a frozen `scipy.stats` distribution (needs `pdf` and `rvs`; `ppf` for an
        unbounded support).
    C: the envelope constant. The constructor checks C·g(x) ≥ f(x) over the support with
        `refined_minimum` and raises `EnvelopeError`, naming the worst x, where it fails.
    support: (a, b); None means `target.support` if the target has one, else the proposal's.
    """

    def __init__(self, target: Callable, proposal, C: float, support=None, *, n_grid: int = 20001):
        if not (callable(getattr(proposal, "pdf", None)) and callable(getattr(proposal, "rvs", None))):
            raise TypeError("proposal must be a frozen scipy.stats distribution with pdf and rvs, "
                            f"got {type(proposal).__name__}")
        if isinstance(C, bool) or not isinstance(C, (int, float)) or not (math.isfinite(C) and C > 0):
            raise ValueError(f"C must be a finite number > 0, got {C!r}")
        if support is None:
            support = getattr(target, "support", None) or tuple(float(v) for v in proposal.support())
        self.target, self.proposal, self.C = target, proposal, float(C)
        self.support = _check_support(support)
        self.envelope_x, self.envelope_margin = self._check_envelope(n_grid)

    def _target_on_support(self, x: np.ndarray) -> np.ndarray:
        """f(x) inside the support, 0 outside (f is only evaluated inside)."""
        inside = (x >= self.support[0]) & (x <= self.support[1])
        fx = np.zeros_like(x, dtype=float)
        fx[inside] = self.target(x[inside])
        return fx

    def _check_envelope(self, n_grid: int) -> tuple[float, float]:
        """Rule: C·g(x) − f(x) ≥ 0 at its refined minimum over the support, up to rounding
        (1e-12 of the target's scale). Returns that minimum's (x, margin)."""
        a, b = _finite_bounds(self.support, self.proposal)
        grid = np.linspace(a, b, n_grid)
        fx = np.asarray(self.target(grid), dtype=float)
        if not np.all(np.isfinite(fx) & (fx >= 0)):
            i = int(np.flatnonzero(~(np.isfinite(fx) & (fx >= 0)))[0])
            raise ValueError(f"target must be finite and >= 0, got f({grid[i]:.6g}) = {fx[i]}")

        def margin(x):
            x = np.asarray(x, dtype=float)
            return self.C * self.proposal.pdf(x) - np.asarray(self.target(x), dtype=float)

        x, worst = refined_minimum(margin, a, b, n_grid=n_grid)
        if worst < -1e-12 * max(1.0, float(fx.max())):
            envelope = float(self.C * self.proposal.pdf(x))
            raise EnvelopeError(x, envelope - worst, envelope, self.C)
        return x, worst

    @cached_property
    def normalizing_constant(self) -> float:
        """Z = ∫ f over the support."""
        return normalizing_constant(self.target, self.support)

    @property
    def theoretical_acceptance(self) -> float:
        """P(accept) = Z / C."""
        return self.normalizing_constant / self.C

    def propose(self, n: int, rng: np.random.Generator) -> Proposals:
        """Draw n candidates x ~ g and heights h = u·C·g(x); accept where h < f(x)."""
        n, rng = _check_count("n", n), _check_rng("rng", rng)
        x = np.asarray(self.proposal.rvs(size=n, random_state=rng), dtype=float)  # [n]
        height = rng.random(n) * self.C * self.proposal.pdf(x)  # [n]
        accepted = height < self._target_on_support(x)  # [n], False outside the support
        return Proposals(x=x, height=height, accepted=accepted)

    def run(self, n_proposals: int, rng: np.random.Generator) -> RejectionRun:
        """Propose n_proposals candidates (in chunks) and keep the accepted ones."""
        n_proposals, rng = _check_count("n_proposals", n_proposals), _check_rng("rng", rng)
        kept = []
        for start in range(0, n_proposals, _CHUNK):
            batch = self.propose(min(_CHUNK, n_proposals - start), rng)
            kept.append(batch.x[batch.accepted])
        samples = np.concatenate(kept)
        return RejectionRun(samples=samples, n_proposed=n_proposals, n_accepted=samples.size,
                            acceptance_rate=samples.size / n_proposals)

    def rvs(self, size=1, random_state=None) -> np.ndarray:
        """Exactly `size` samples of f / Z (an int or a shape tuple), scipy-style.

        random_state: a numpy Generator, an int seed, or None (fresh OS entropy).
        """
        shape = (size,) if isinstance(size, (int, np.integer)) else tuple(size)
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise ValueError(f"size must be a non-negative integer or a tuple of them, got {size!r}")
        if random_state is None or isinstance(random_state, (int, np.integer)):
            random_state = np.random.default_rng(random_state)
        rng = _check_rng("random_state", random_state)
        total = math.prod(shape)
        rate = self.theoretical_acceptance
        if not rate > 0:
            raise ValueError(f"the target has no mass on the support (Z = {self.normalizing_constant})")
        kept, have = [], 0
        while have < total:
            need = total - have
            batch = min(_CHUNK, int(need / rate * 1.1) + 16)
            samples = self.run(batch, rng).samples
            kept.append(samples)
            have += samples.size
        return (np.concatenate(kept)[:total] if kept else np.empty(0)).reshape(shape)


# --------------------------------------------------------------------------- the reference's experiment

REFERENCE_PROPOSALS = {
    # name: (label, frozen proposal, C)
    "uniform": ("Uniform on [-3, 3]", stats.uniform(loc=-3, scale=6), 25.0),
    "gaussian": ("Standard Gaussian", stats.norm(), 11.0),
}


def reference_samplers() -> dict[str, RejectionSampler]:
    """The reference's two samplers for f: uniform on [−3, 3] with C = 25, standard normal with C = 11."""
    return {name: RejectionSampler(reference_target, proposal, C)
            for name, (_, proposal, C) in REFERENCE_PROPOSALS.items()}


def run_reference_experiment(n_proposals: int, seed: int,
                        samplers: dict[str, RejectionSampler] | None = None) -> dict[str, RejectionRun]:
    """Run each reference sampler for n_proposals candidates, each on its own stream spawned from seed."""
    samplers = samplers or reference_samplers()
    streams = np.random.SeedSequence(seed).spawn(len(samplers))
    return {name: sampler.run(n_proposals, np.random.default_rng(stream))
            for (name, sampler), stream in zip(samplers.items(), streams)}
