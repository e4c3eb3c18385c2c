"""The reference's cost-model numbers and the measured-cost form."""
import pytest
import torch

from exactspec import costmodel


def test_expected_tokens_is_geometric_sum():
    for alpha in (0.0, 0.3, 0.7, 1.0):
        for gamma in range(6):
            assert costmodel.expected_tokens(alpha, gamma) == pytest.approx(
                sum(alpha**k for k in range(gamma + 1)))
    assert costmodel.expected_tokens(1.0, 4) == 5


def test_seed_part8_numbers():
    assert costmodel.speedup(0.7, 4, 0.1) == pytest.approx(1.98, abs=0.005)
    assert costmodel.best_gamma(0.7, 0.1) == (4, pytest.approx(1.9808, abs=1e-4))
    assert costmodel.best_gamma(0.9, 0.1)[0] > costmodel.best_gamma(0.7, 0.1)[0]
    assert costmodel.best_gamma(0.5, 0.1)[0] < 4


def test_best_gamma_respects_max_and_zero():
    assert costmodel.best_gamma(0.99, 0.01, max_gamma=3)[0] == 3
    assert costmodel.best_gamma(0.0, 0.1) == (0, 1.0)  # drafting never pays when nothing is kept


def test_measured_form_reduces_to_idealized_one():
    for gamma in range(8):
        assert costmodel.speedup_measured(0.8, gamma, 0.04, 0.04, 0.004) == pytest.approx(
            costmodel.speedup(0.8, gamma, 0.1))
    # a target pass over γ+1 tokens that costs more lowers the prediction
    assert costmodel.speedup_measured(0.8, 4, 0.04, 0.06, 0.004) < costmodel.speedup(0.8, 4, 0.1)


def test_acceptance_rate_is_overlap():
    p = torch.tensor([0.3, 0.4, 0.3])
    q = torch.tensor([0.6, 0.3, 0.1])
    assert costmodel.acceptance_rate(p, q).item() == pytest.approx(0.7)
    assert costmodel.acceptance_rate(p, p).item() == pytest.approx(1.0)


@pytest.mark.parametrize("call, message", [
    (lambda: costmodel.expected_tokens(1.5, 2), r"alpha must be in \[0, 1\], got 1.5"),
    (lambda: costmodel.expected_tokens(-0.1, 2), r"alpha must be in \[0, 1\], got -0.1"),
    (lambda: costmodel.expected_tokens(0.5, -1), r"gamma must be an integer >= 0, got -1"),
    (lambda: costmodel.expected_tokens(0.5, 2.5), r"gamma must be an integer >= 0, got 2.5"),
    (lambda: costmodel.speedup(0.5, 2, -0.1), r"c must be a finite number >= 0, got -0.1"),
    (lambda: costmodel.speedup_measured(0.5, 2, 0.0, 0.1, 0.1), r"t_target_1 .* must be > 0"),
    (lambda: costmodel.acceptance_rate(torch.ones(3), torch.ones(4)), r"same shape"),
])
def test_bad_arguments_name_themselves(call, message):
    with pytest.raises(ValueError, match=message):
        call()
