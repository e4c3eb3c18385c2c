"""`kernels`: a model's CPU linear layers run as the faster of two products, measured per shape."""
import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_llama
from exactspec.cache import CachedModel
from exactspec.kernels import (COLUMNS, MAX_ROWS, ROWS, TRIALS, FasterLinear, _Shape,
                               columns_product, faster_model, faster_products)
from exactspec.models.loaded import Memory
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


def test_both_are_timed_then_the_faster_runs_and_is_kept():
    """Each product timed TRIALS times in turn, then the faster alone, whatever later timings
    would say: the products round differently, and a seed names one text."""
    shape = _Shape()
    ran = drive(shape, {ROWS: 2.0, COLUMNS: 1.0}.get, 1000)
    assert sorted(ran[: 2 * TRIALS]) == [COLUMNS] * TRIALS + [ROWS] * TRIALS and shape.best == COLUMNS
    assert set(ran[2 * TRIALS:]) == {COLUMNS}
    later = drive(shape, {ROWS: 1.0, COLUMNS: 3.0}.get, 1000)  # the machine changed: the choice stays
    assert shape.best == COLUMNS and set(later) == {COLUMNS}


def tiny_model():
    model = make_tiny_llama(0)
    model.eval()
    return model


def linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


def test_the_faster_model_computes_what_the_model_computes_and_changes_nothing_in_it():
    model, shapes = tiny_model(), {}
    before = {name: module for name, module in model.named_modules()}
    ids = torch.tensor([[3, 7, 1, 4]])  # [1, 4]
    with torch.inference_mode():
        plain = model(ids).logits  # [1, 4, V]
        faster = faster_model(model, shapes)
        for _ in range(2 * TRIALS):  # both products run
            torch.testing.assert_close(faster(ids).logits, plain, rtol=1e-5, atol=1e-5)
    wrapped = [m for m in faster.modules() if isinstance(m, FasterLinear)]
    assert len(wrapped) == len(linears(model)) > 0
    assert dict(model.named_modules()) == before  # the model is as it was
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {id(p) for p in faster.parameters()} == {id(p) for p in model.parameters()}  # shared
    classes = {key[3] for key in shapes}
    assert classes == {size_class(4)} and all(s.best is not None for s in shapes.values())


def test_long_inputs_subclasses_hooked_layers_and_errors_stay_as_they_were():
    class Scaled(torch.nn.Linear):
        pass

    hooked = torch.nn.Linear(2, 2)
    hooked.forward = hooked_forward = lambda x: x  # as accelerate's hooks set it
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), Scaled(3, 2), hooked)
    shapes = {}
    faster = faster_model(model, shapes)
    assert faster[1] is model[1] and faster[2] is model[2] and isinstance(faster[0], FasterLinear)
    with torch.inference_mode():
        faster(torch.randn(MAX_ROWS + 1, 4))  # prefill-sized: torch's own product, untimed
        assert shapes == {}
        faster(torch.randn(2, 4))
    assert [key[:2] + key[3:4] for key in shapes] == [(3, 4, size_class(2))]  # the subclass as it is
    assert model[2].forward is hooked_forward and type(model[0]) is torch.nn.Linear
    with pytest.raises(RuntimeError):
        faster(torch.randn(2, 5))  # a wrong width: torch's own error


def test_the_target_and_model_drafts_run_it_on_the_cpu_kept_in_their_memory():
    model, memory = tiny_model(), Memory()
    cached = CachedModel(model, "tiny", model.config.vocab_size, memory=memory)
    with torch.inference_mode():
        cached.prefill(torch.tensor([[3, 7, 1]]), torch.ones(1, 3, dtype=torch.bool))
        cached.feed(torch.tensor([[5, 2]]))
    assert cached.model is model and faster_products(model, memory) is cached.runner  # made once
    head = model.lm_head.weight
    assert any(key[:2] == tuple(head.shape) and key[3] == size_class(2) for key in memory.shapes)
    assert faster_products(model, Memory()) is not cached.runner  # another memory: its own
