"""The continuous rejection sampler (the reference's continuous lab).

Statistical tests use fixed seeds, so they are deterministic; the thresholds (4 standard errors,
p-value > 0.001) say how often a correct sampler would fail them under a fresh seed
(about 6e-5 and 1e-3).
"""
import math

import numpy as np
import pytest
from scipy import stats

from exactspec.lab import rejection
from exactspec.lab.rejection import (EnvelopeError, RejectionRun, RejectionSampler, normalizing_constant,
                                 numerical_cdf, reference_samplers, reference_target, target_maximum)

N_PROPOSALS = 300_000


@pytest.fixture(scope="module")
def samplers():
    return reference_samplers()


@pytest.fixture(scope="module")
def runs(samplers):
    return rejection.run_reference_experiment(N_PROPOSALS, seed=20240611, samplers=samplers)


# --------------------------------------------------------------------------- the target


def test_reference_target_formula_vectorized_and_zero_outside():
    x = np.array([-4.0, -3.0, -0.5, 0.0, 1.7, 3.0, 3.01])
    expected = np.exp(-x**2 / 2) * (np.sin(6 + x) ** 2 + 3 * np.cos(x) ** 2 * np.sin(4 * x) ** 2 + 1)
    expected[(x < -3) | (x > 3)] = 0.0
    np.testing.assert_allclose(reference_target(x), expected, rtol=1e-15)
    assert isinstance(reference_target(0.25), float)
    assert reference_target(0.0) == pytest.approx(1 + math.sin(6) ** 2)


def test_normalizing_constant_matches_the_seed():
    assert abs(normalizing_constant(reference_target, (-3, 3)) - 5.73807) < 1e-4


def test_target_maximum_matches_the_seed():
    x, value = target_maximum(reference_target)
    assert value == pytest.approx(3.696, abs=5e-4)
    assert reference_target(np.linspace(-3, 3, 100_001)).max() <= value + 1e-12
    assert x == pytest.approx(-0.3634, abs=1e-3)


def test_numerical_cdf_is_a_cdf_of_f_over_z():
    cdf = numerical_cdf(reference_target)
    assert cdf(-3.5) == 0 and cdf(3.5) == 1
    z = normalizing_constant(reference_target)
    for point in (-1.0, 0.0, 0.4, 2.2):
        assert cdf(point) == pytest.approx(normalizing_constant(reference_target, (-3, point)) / z,
                                           abs=1e-9)


# --------------------------------------------------------------------------- theory and runs


def test_theoretical_acceptance_matches_the_seed(samplers):
    assert round(100 * samplers["uniform"].theoretical_acceptance, 2) == 22.95
    assert round(100 * samplers["gaussian"].theoretical_acceptance, 2) == 52.16


@pytest.mark.parametrize("name", ["uniform", "gaussian"])
def test_observed_acceptance_within_four_standard_errors(samplers, runs, name):
    theory, run = samplers[name].theoretical_acceptance, runs[name]
    standard_error = math.sqrt(theory * (1 - theory) / N_PROPOSALS)
    assert run.n_proposed == N_PROPOSALS
    assert run.n_accepted == run.samples.size
    assert run.acceptance_rate == run.n_accepted / N_PROPOSALS
    assert abs(run.acceptance_rate - theory) < 4 * standard_error


@pytest.mark.parametrize("name", ["uniform", "gaussian"])
def test_accepted_samples_follow_f_over_z(runs, name):
    """Cramér–von Mises against the numerically integrated CDF of f / Z."""
    samples = runs[name].samples
    assert samples.min() >= -3 and samples.max() <= 3
    result = stats.cramervonmises(samples, numerical_cdf(reference_target))
    assert result.pvalue > 1e-3


def test_goodness_of_fit_detects_a_wrong_sampler(runs):
    """The same test rejects samples of the proposal instead of the target: it has power."""
    wrong = np.random.default_rng(1).uniform(-3, 3, size=20_000)
    assert stats.cramervonmises(wrong, numerical_cdf(reference_target)).pvalue < 1e-6


def test_candidates_outside_the_support_count_as_rejected():
    """f = 1 on [-1, 1] (Z = 2) under a standard normal envelope with C = 6: every candidate
    outside [-1, 1] is rejected, and acceptance is Z / C = 1/3, not the in-support rate."""
    def flat(x):
        return np.ones_like(np.asarray(x, dtype=float))

    sampler = RejectionSampler(flat, stats.norm(), 6.0, support=(-1, 1))
    assert sampler.theoretical_acceptance == pytest.approx(1 / 3)
    run = sampler.run(200_000, np.random.default_rng(5))
    assert np.all(np.abs(run.samples) <= 1)
    assert abs(run.acceptance_rate - 1 / 3) < 4 * math.sqrt(2 / 9 / 200_000)


def test_run_is_reproducible_from_the_generator(samplers):
    a = samplers["gaussian"].run(1000, np.random.default_rng(3))
    b = samplers["gaussian"].run(1000, np.random.default_rng(3))
    np.testing.assert_array_equal(a.samples, b.samples)
    assert isinstance(a, RejectionRun)


def test_run_chunks_large_requests(samplers, monkeypatch):
    """Runs longer than one chunk give the same count and the right length."""
    monkeypatch.setattr(rejection, "_CHUNK", 1000)
    run = samplers["uniform"].run(2500, np.random.default_rng(0))
    assert run.n_proposed == 2500 and run.samples.size == run.n_accepted


def test_propose_heights_lie_under_the_envelope(samplers):
    sampler = samplers["gaussian"]
    batch = sampler.propose(5000, np.random.default_rng(2))
    envelope = sampler.C * sampler.proposal.pdf(batch.x)
    assert np.all((batch.height >= 0) & (batch.height < envelope))
    np.testing.assert_array_equal(batch.accepted, batch.height < reference_target(batch.x))


# --------------------------------------------------------------------------- rvs


@pytest.mark.parametrize("size", [0, 1, 7, 5000])
def test_rvs_returns_exactly_size(samplers, size):
    out = samplers["uniform"].rvs(size, random_state=np.random.default_rng(size))
    assert out.shape == (size,)


def test_rvs_shape_tuple_and_int_seed(samplers):
    a = samplers["gaussian"].rvs((20, 3), random_state=11)
    b = samplers["gaussian"].rvs((20, 3), random_state=11)
    assert a.shape == (20, 3)
    np.testing.assert_array_equal(a, b)
    assert samplers["gaussian"].rvs(4).shape == (4,)  # random_state None: fresh entropy


def test_rvs_rejects_bad_arguments(samplers):
    with pytest.raises(ValueError, match=r"size must be a non-negative integer.*got -2"):
        samplers["uniform"].rvs(-2)
    with pytest.raises(TypeError, match=r"random_state must be a numpy.random.Generator, got RandomState"):
        samplers["uniform"].rvs(3, random_state=np.random.RandomState(0))


# --------------------------------------------------------------------------- the envelope


def test_gaussian_envelope_with_c_9_raises_naming_x():
    with pytest.raises(EnvelopeError, match=r"at x = -0\.37\d+: C·g\(x\) = 3\.3\d+ < f\(x\) = 3\.6\d+") as info:
        RejectionSampler(reference_target, stats.norm(), 9)
    assert info.value.x == pytest.approx(-0.378, abs=1e-3)
    assert info.value.shortfall == pytest.approx(0.3436, abs=1e-3)
    assert isinstance(info.value, ValueError)


def test_envelope_check_is_refined_between_grid_points():
    """A narrow spike between grid points: the refined x is the spike's top, not a grid point."""
    top = 1.234567

    def spiky(x):
        x = np.asarray(x, dtype=float)
        return 0.1 + 3.0 * np.exp(-0.5 * ((x - top) / 2e-3) ** 2)

    with pytest.raises(EnvelopeError) as info:
        RejectionSampler(spiky, stats.uniform(-3, 6), 12.0, support=(-3, 3), n_grid=2001)
    assert info.value.x == pytest.approx(top, abs=1e-6)
    assert info.value.shortfall == pytest.approx(3.1 - 2.0, abs=1e-6)


def test_proposal_that_misses_part_of_the_support_raises():
    with pytest.raises(EnvelopeError, match=r"at x = -2"):
        RejectionSampler(reference_target, stats.uniform(-2, 5), 100)


def test_valid_envelopes_report_their_closest_approach(samplers):
    gaussian = samplers["gaussian"]
    assert gaussian.envelope_margin > 0
    assert gaussian.envelope_x == pytest.approx(2.7758, abs=1e-3)
    RejectionSampler(reference_target, stats.norm(), 9.93)  # max f/g ≈ 9.9252: still covers


@pytest.mark.parametrize("C", [0, -1, math.inf, math.nan, "25", True])
def test_bad_c_is_named(C):
    with pytest.raises(ValueError, match=r"C must be a finite number > 0, got"):
        RejectionSampler(reference_target, stats.norm(), C)


def test_bad_proposal_and_support_are_named():
    with pytest.raises(TypeError, match=r"proposal must be a frozen scipy.stats distribution"):
        RejectionSampler(reference_target, "normal", 11)
    with pytest.raises(ValueError, match=r"support must have a < b, got \(3, -3\)"):
        RejectionSampler(reference_target, stats.norm(), 11, support=(3, -3))


def test_negative_target_is_refused():
    with pytest.raises(ValueError, match=r"target must be finite and >= 0, got f\(-3\) = -1"):
        RejectionSampler(lambda x: np.full_like(np.asarray(x, float), -1.0), stats.norm(), 11,
                         support=(-3, 3))


@pytest.mark.parametrize("n", [0, -5, 2.5, True])
def test_bad_counts_are_named(samplers, n):
    with pytest.raises(ValueError, match=rf"n_proposals must be a positive integer, got {n!r}"):
        samplers["uniform"].run(n, np.random.default_rng(0))


def test_run_requires_a_numpy_generator(samplers):
    with pytest.raises(TypeError, match=r"rng must be a numpy.random.Generator, got int"):
        samplers["uniform"].run(10, 0)
