"""Noise that belongs to a position: the coupled rule's randomness.

Vocabulary (used verbatim below):

- E_t: row's noise at absolute position t (prompt tokens, then new tokens, counted from 0): one
  Exp(1) draw per vocabulary entry, a function of (row seed, t) alone — a counter-based stream,
  so it does not depend on how many draws came before, on γ, on the draft or on other rows.
- the race: the token of weights w at position t is argmax_x w(x) / E_t(x). Since E_t(x) / w(x)
  is exponential with rate w(x), the smallest of them is x with probability w(x) / Σ w: the
  race is one exact draw from w (normalized or not; zero weights never win).

Plain decoding and the coupled rule both draw the target's token at t by the race over p with
E_t, so a seeded row emits the same tokens whatever was drafted. A model draft drawing its x_t by
the race over q with the same E_t agrees with the target's token as often as this coupling
allows (`exactspec.costmodel.coupled_acceptance_rate`).
"""
from __future__ import annotations

import numpy as np
import torch

_MASK = (1 << 64) - 1
NOISE = 3  # the purpose of a position's noise among a row's streams (see `exactspec.batching`)
CHOICE = 4  # the purpose of a request's choice seeds (`choice_seed`)


def mix(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps): nearby inputs give unrelated seeds."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK
        state ^= state >> 29
    return state >> 1


def row_seed(seed: int, row: int = 0) -> int:
    """The noise seed of row `row` of a generation seeded `seed` (a server request is row 0 of
    its own): unrelated for different rows, so batches seeded s and s + 1 share no row's noise."""
    return mix(seed, row)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded `seed` that asks for several choices (the
    server's `n`): choice 0 keeps `seed` itself (so n = 1 is unchanged), choice i > 0 gets
    mix(seed, i, CHOICE), unrelated to the seed's own streams (purposes 1-3). Each choice is then
    decoded as its own request with that seed: plain decoding with `choice_seed(seed, i)`
    reproduces it under the coupled rule."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be an integer >= 0, got {index!r}")
    return seed if index == 0 else mix(seed, index, CHOICE)


def noise_key(seed: int, position: int) -> int:
    """The seed of E_t's stream: (row seed, absolute position), nothing else."""
    return mix(seed, position, NOISE)


def uniforms_at(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The float64 uniforms u ∈ [0, 1) that E_t is made from, on the CPU: NumPy's PCG64 seeded
    with `noise_key` (twice as fast as torch's generator). [V]"""
    generator = np.random.Generator(np.random.PCG64(noise_key(seed, position)))
    return torch.from_numpy(generator.random(vocab))  # [V], float64


def exponentials(seed: int, position: int, vocab: int) -> torch.Tensor:
    """E_t: vocab Exp(1) draws in float64 on the CPU (the same values on every device), as
    −log(1 − u) of float64 uniforms u ∈ [0, 1). [V]"""
    return -torch.log1p(-uniforms_at(seed, position, vocab))  # [V]


def argmax(values: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum over the last dimension, as `torch.argmax(values, -1)`;
    through NumPy for float32 and float64 on the CPU, where torch's takes ten times as long. [...]"""
    if values.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(values.detach().numpy().argmax(-1))
    return values.argmax(-1)


def lone_positive(weights: torch.Tensor) -> int | None:
    """The index of the only positive entry of weights[V] (non-negative), or None when there are
    none or several. (In NumPy: a plain greedy step calls it once per token.)"""
    w = _cpu_array(weights)  # [V]
    top = int(w.argmax())
    if not w[top] > 0:
        return None
    return None if w[:top].max(initial=0) > 0 or w[top + 1:].max(initial=0) > 0 else top


def _cpu_array(weights: torch.Tensor) -> np.ndarray:
    """weights as a float32 or float64 NumPy array on the CPU (other float types widened, exactly)."""
    w = weights.detach().cpu()
    return (w if w.dtype in (torch.float32, torch.float64) else w.float()).numpy()


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_x w(x) / E(x) over the last dimension (weights [..., V], noise [..., V]); a zero
    weight never wins, and E(x) = 0 (probability 2⁻⁵³ per entry) makes a positive w(x) win. [...]"""
    wide = weights.to(torch.float64)  # [..., V]
    scores = torch.where(wide > 0, wide / noise.to(wide.device), -1.0)  # [..., V]
    return scores.argmax(dim=-1)  # [...]


def race_uniforms(weights: torch.Tensor, uniforms: torch.Tensor) -> int:
    """`race` over weights[V] with E = −log(1 − u) from uniforms[V], E made only where it may win.

    −log(1 − u) ≥ u, so w(x) / u(x) bounds x's score w(x) / E(x) from above: the bound's leader
    scores s, and only x with w(x) / u(x) ≥ s can reach s (a 1e-9 margin covers rounding). The
    first best score among those is the race's: the same token. In NumPy on the CPU: a tenth of
    `race`'s time at Qwen's vocabulary (docs/coupled.md, "What the noise costs")."""
    w, u = _cpu_array(weights), uniforms.numpy()  # [V] each, u float64
    with np.errstate(divide="ignore", invalid="ignore"):  # u = 0: inf, as E = 0 makes w win
        bounds = w / u  # [V], float64
        bounds[w <= 0] = -1.0
        lead = int(bounds.argmax())
        reach = w[lead] / -np.log1p(-u[lead])
        near = np.flatnonzero(bounds >= reach * (1 - 1e-9))  # [c], in index order, lead among them
        scores = w[near] / -np.log1p(-u[near])  # [c]
    return int(near[scores.argmax()])


class RowNoise:
    """One row's noise for one round, from absolute position `start` on.

    A model draft calls `draw` once per draft, in order (its i-th draft races at start + i);
    the coupled rule calls `token(weights, i)` for the target's token at start + i. E_t's
    uniforms are drawn once per round and shared by both; E_t itself is made only where it may
    win (`race_uniforms`)."""

    def __init__(self, seed: int, start: int):
        self.seed, self.start = seed, start
        self.drawn = 0  # draws made by `draw` (the draft's)
        self._uniforms: dict[int, torch.Tensor] = {}

    def uniforms(self, offset: int, vocab: int) -> torch.Tensor:
        """The uniforms of E at position start + offset. [V]"""
        if offset not in self._uniforms:
            self._uniforms[offset] = uniforms_at(self.seed, self.start + offset, vocab)
        return self._uniforms[offset]

    def token(self, weights: torch.Tensor, offset: int) -> int:
        """The race over weights[V] at position start + offset. A single positive weight (greedy
        decoding, a token the grammar forces) wins whatever the noise, which is then not made:
        E_t is counter-based, so skipping it changes no other position's."""
        lone = lone_positive(weights)
        if lone is not None:
            return lone
        return race_uniforms(weights, self.uniforms(offset, weights.size(-1)))

    def draw(self, weights: torch.Tensor) -> int:
        """The race over weights[V] at the next draft position."""
        self.drawn += 1
        return self.token(weights, self.drawn - 1)


def is_noise(generator) -> bool:
    """True when `generator` is a list of per-row noise streams (the coupled rule's)."""
    return isinstance(generator, (list, tuple)) and any(isinstance(g, RowNoise) for g in generator)
