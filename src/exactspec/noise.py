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


def exponentials(seed: int, position: int, vocab: int) -> torch.Tensor:
    """E_t: vocab Exp(1) draws in float64 on the CPU (the same values on every device), as
    −log(1 − u) of float64 uniforms u ∈ [0, 1). [V]"""
    generator = torch.Generator()
    generator.manual_seed(noise_key(seed, position))
    uniforms = torch.rand(vocab, dtype=torch.float64, generator=generator)  # [V]
    return -torch.log1p(-uniforms)  # [V]


def race(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_x w(x) / E(x) over the last dimension (weights [..., V], noise [..., V]); a zero
    weight never wins, and E(x) = 0 (probability 2⁻⁵³ per entry) makes a positive w(x) win. [...]"""
    wide = weights.to(torch.float64)  # [..., V]
    scores = torch.where(wide > 0, wide / noise.to(wide.device), -1.0)  # [..., V]
    return scores.argmax(dim=-1)  # [...]


class RowNoise:
    """One row's noise for one round, from absolute position `start` on.

    A model draft calls `draw` once per draft, in order (its i-th draft races at start + i);
    the coupled rule calls `token(weights, i)` for the target's token at start + i. E_t is made
    once per round and shared by both (its cost: about 1 ms per position at V = 49,152)."""

    def __init__(self, seed: int, start: int):
        self.seed, self.start = seed, start
        self.drawn = 0  # draws made by `draw` (the draft's)
        self._noise: dict[int, torch.Tensor] = {}

    def noise(self, offset: int, vocab: int) -> torch.Tensor:
        """E at position start + offset. [V]"""
        if offset not in self._noise:
            self._noise[offset] = exponentials(self.seed, self.start + offset, vocab)
        return self._noise[offset]

    def token(self, weights: torch.Tensor, offset: int) -> int:
        """The race over weights[V] at position start + offset. A single positive weight (greedy
        decoding, a token the grammar forces) wins whatever the noise, which is then not made:
        E_t is counter-based, so skipping it changes no other position's."""
        if int((weights > 0).sum()) == 1:
            return int(weights.argmax())
        return int(race(weights, self.noise(offset, weights.size(-1))))

    def draw(self, weights: torch.Tensor) -> int:
        """The race over weights[V] at the next draft position."""
        self.drawn += 1
        return self.token(weights, self.drawn - 1)


def is_noise(generator) -> bool:
    """True when `generator` is a list of per-row noise streams (the coupled rule's)."""
    return isinstance(generator, (list, tuple)) and any(isinstance(g, RowNoise) for g in generator)
