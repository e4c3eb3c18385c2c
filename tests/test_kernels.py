"""`kernels`: a model's CPU linear layers run as the faster of two products, measured per shape."""
import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_llama
from exactspec.cache import CachedModel
from exactspec.kernels import (COLUMNS, MAX_ROWS, RECHECK_EVERY, ROWS, TRIALS, FasterLinear, _Shape,
                               columns_product, faster_linear)
from exactspec.threads import size_class


@pytest.mark.parametrize("shape", [(5,), (1, 5), (3, 5), (2, 4, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_both_products_are_the_linear_layer(shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    weight = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    bias = torch.randn(7, generator=generator, dtype=torch.float64) if with_bias else None
    out = columns_product(x, weight, bias)  # [..., 7]
    assert out.shape == (*shape[:-1], 7) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-12, atol=1e-12)


def drive(shape, seconds_of, calls):
    """Run `calls` calls through a `_Shape` whose products cost seconds_of(name); the names run."""
    ran = []
    for _ in range(calls):
        name = shape.next_product()
        shape.record(name, seconds_of(name))
        ran.append(name)
    return ran


def test_both_are_timed_then_the_faster_runs_and_the_other_is_rechecked():
    shape = _Shape()
    ran = drive(shape, {ROWS: 2.0, COLUMNS: 1.0}.get, 2 * RECHECK_EVERY)
    assert sorted(ran[: 2 * TRIALS]) == [COLUMNS] * TRIALS + [ROWS] * TRIALS and shape.best == COLUMNS
    assert ran[2 * TRIALS:].count(ROWS) == 2  # call RECHECK_EVERY and 2 * RECHECK_EVERY
    slower = drive(shape, {ROWS: 1.0, COLUMNS: 3.0}.get, 3 * RECHECK_EVERY)  # the machine changed
    assert shape.best == ROWS and slower[-RECHECK_EVERY:].count(COLUMNS) <= 1


def tiny_model():
    model = make_tiny_llama(0)
    model.eval()
    return model


def test_a_pass_inside_the_context_computes_what_it_computes_outside():
    model, shapes = tiny_model(), {}
    ids = torch.tensor([[3, 7, 1, 4]])  # [1, 4]
    with torch.inference_mode():
        plain = model(ids).logits  # [1, 4, V]
        with FasterLinear(model, shapes) as faster:
            for _ in range(2 * TRIALS):  # both products run
                torch.testing.assert_close(model(ids).logits, plain, rtol=1e-5, atol=1e-5)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(faster.layers) == len(linears) > 0
    assert all("forward" not in m.__dict__ for m in linears)  # the model is as it was
    classes = {key[3] for key in shapes}
    assert classes == {size_class(4)} and all(s.best is not None for s in shapes.values())


def test_the_context_leaves_long_inputs_subclasses_hooks_and_errors_as_they_were():
    class Scaled(torch.nn.Linear):
        pass

    hooked = torch.nn.Linear(2, 2)
    hooked.forward = hooked_forward = lambda x: x  # as accelerate's hooks set it
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), Scaled(3, 2), hooked)
    shapes = {}
    with torch.inference_mode(), FasterLinear(model, shapes):
        model(torch.randn(MAX_ROWS + 1, 4))  # prefill-sized: torch's own product, untimed
        assert shapes == {}
        model(torch.randn(2, 4))
    assert [key[:2] + key[3:4] for key in shapes] == [(3, 4, size_class(2))]  # the subclass as it is
    assert hooked.forward is hooked_forward
    with pytest.raises(RuntimeError), FasterLinear(model, shapes):
        model(torch.randn(2, 5))  # a wrong width: torch's own error
    assert "forward" not in model[0].__dict__


def test_the_target_and_model_drafts_pass_through_it_on_the_cpu():
    model = tiny_model()
    cached = CachedModel(model, "tiny", model.config.vocab_size)
    with torch.inference_mode():
        cached.prefill(torch.tensor([[3, 7, 1]]), torch.ones(1, 3, dtype=torch.bool))
        cached.feed(torch.tensor([[5, 2]]))
    assert faster_linear(model) is faster_linear(model)  # one per model
    head = model.lm_head.weight
    assert any(key[:2] == tuple(head.shape) and key[3] == size_class(2)
               for key in faster_linear(model).shapes)
