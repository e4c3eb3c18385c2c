"""Linear layers on the CPU in the faster of two matrix products, chosen per shape by timing.

A decode multiplies a few rows x[M, K] by a large weight W[N, K]; on the CPU, torch's x @ Wᵀ can
be far slower at that shape than the same product turned around, (W @ xᵀ)ᵀ (docs/design.md:
the faster product). Which wins depends on the BLAS, the CPU, M and the threads, so each is timed.
Both compute the same sums (float rounding aside), so exactness does not depend on the choice.
They round differently, though, so once made a shape's choice is kept: a seed names one text,
and it would not if a layer could change its product between generations (docs/design.md).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F

from exactspec.models.loaded import Memory, input_device
from exactspec.threads import size_class

ROWS, COLUMNS = "rows", "columns"  # x @ Wᵀ (torch's own) and (W @ xᵀ)ᵀ
MAX_ROWS = 64  # beyond this many rows both products are compute-bound alike: torch's own runs
TRIALS = 3  # timings of each product before the choice


def rows_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def columns_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(W @ xᵀ)ᵀ (+ bias), one row padded to two (a matrix-vector product is the slow case)."""
    flat = x.reshape(-1, x.size(-1))  # [M, K]
    rows = flat.size(0)
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.size(1))])  # [2, K]
    out = torch.mm(weight, flat.t())[:, :rows].t().contiguous()  # [M, N]
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.size(0))  # [..., N]


PRODUCTS = {ROWS: rows_product, COLUMNS: columns_product}


class _Shape:
    """One (weight shape, dtype, size class of the rows, threads): each product timed TRIALS
    times in turn, in seconds per row, as the pass's calls come; then the faster by median, kept.
    The trials of a size class end within its first pass (a pass calls a layer of each shape
    dozens of times)."""

    def __init__(self):
        self.seconds = {ROWS: [], COLUMNS: []}
        self.best: str | None = None

    def next_product(self) -> str:
        if self.best is None:  # both tried TRIALS times first, in turn
            return min(self.seconds, key=lambda name: len(self.seconds[name]))
        return self.best

    def record(self, name: str, seconds: float) -> None:
        if self.best is not None:
            return
        self.seconds[name].append(seconds)
        if all(len(s) >= TRIALS for s in self.seconds.values()):
            self.best = min(self.seconds, key=lambda n: statistics.median(self.seconds[n]))


class FasterLinear(torch.nn.Module):
    """An `nn.Linear` run as the product measured faster for its shape on CPU tensors of up to
    MAX_ROWS rows, and as torch runs it otherwise. It holds the layer (and so its weights) and
    changes nothing in it. `shapes` holds the timings, one `_Shape` per (N, K, dtype, size class
    of the rows, threads)."""

    def __init__(self, layer: torch.nn.Linear, shapes: dict, clock=time.perf_counter):
        super().__init__()
        self.layer, self.shapes, self.clock = layer, shapes, clock

    weight = property(lambda self: self.layer.weight)
    bias = property(lambda self: self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.layer.weight, self.layer.bias
        if not _plain_cpu(x, weight, bias) or x.numel() > MAX_ROWS * x.size(-1):
            return F.linear(x, weight, bias)
        rows = x.numel() // x.size(-1)
        key = (*weight.shape, weight.dtype, size_class(rows), torch.get_num_threads())
        shape = self.shapes.get(key) or self.shapes.setdefault(key, _Shape())
        if shape.best is not None:  # chosen and kept: nothing more to time
            return PRODUCTS[shape.best](x, weight, bias)
        name = shape.next_product()
        started = self.clock()
        out = PRODUCTS[name](x, weight, bias)
        shape.record(name, (self.clock() - started) / rows)
        return out


def faster_model(model: torch.nn.Module, shapes: dict, clock=time.perf_counter) -> torch.nn.Module:
    """`model` with each `nn.Linear` run as a `FasterLinear`: a twin of every module on the way to
    one (a shallow copy sharing its parameters, buffers and hooks, with its own children), the
    rest the model's own modules. The model itself is not changed. Left as they are: subclasses
    (quantized, LoRA: they keep their product), layers with hooks, and whatever is below a module
    with a forward of its own (accelerate's device-map hooks set one)."""
    if type(model) is torch.nn.Linear:
        hooked = "forward" in model.__dict__ or model._forward_hooks or model._forward_pre_hooks
        return model if hooked else FasterLinear(model, shapes, clock)
    if "forward" in model.__dict__:
        return model
    children = {name: None if child is None else faster_model(child, shapes, clock)
                for name, child in model._modules.items()}
    if all(children[name] is child for name, child in model._modules.items()):
        return model
    twin = copy.copy(model)
    twin.__dict__["_modules"] = children
    return twin


def faster_products(model, memory: Memory):
    """What a CPU pass of `model` runs: its `faster_model`, made once and kept in `memory` (the
    model's own, `models.loaded.Memory`) with the timings; anything else (a model on an
    accelerator, a llama.cpp model) as it is."""
    if not isinstance(model, torch.nn.Module) or input_device(model).type != "cpu":
        return model
    if memory.runner is None or memory.runner[0] is not model:
        memory.runner = (model, faster_model(model, memory.shapes))
    return memory.runner[1]


def _plain_cpu(x, weight, bias) -> bool:
    """Dense CPU tensors of one floating dtype (no tensor subclass: a sharded weight runs as is)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
                for t in tensors)
            and x.dim() >= 1 and x.size(-1) == weight.size(1) and x.is_floating_point()
            and x.dtype == weight.dtype and x.numel() > 0)
