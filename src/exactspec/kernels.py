"""Linear layers on the CPU in the faster of two matrix products, chosen per shape by timing.

A decode feeds a few tokens, so every linear layer of the model multiplies a few rows x[M, K]
by a large weight W[N, K]. torch computes x @ Wᵀ (one row: a matrix-vector product), and on
the CPU its BLAS is far slower at that shape than at the same product turned around, (W @ xᵀ)ᵀ,
with one row padded to two. Measured on a 2-core AMD EPYC: the bundled model's output layer
(W[49152, 576]) takes 7.2 ms for one row and 12.3 ms for four as x @ Wᵀ, 2.6 and 2.8 ms turned
around; a whole pass of the bundled model on a 200-token cache 40–43 → 27 ms for one token and
62–69 → 31 ms for four; the 1.5B target 306 → 211 and 683 → 372 ms (the turned product at up to
8 rows). Which is faster depends on the BLAS, the CPU, M and the thread count, so it is
measured: each weight shape, size class of M (1, 2–3, 4–7, 8–15, ...: on this CPU the winner
changes near those bounds, and a class's few passes soon end its trials) and thread count tries
both products a few times, then runs the faster one per row, and tries the other again now and
then.

Both compute the same sums (float rounding aside, as between a one-token and a k-token pass):
p is whatever a pass computed, so exactness does not depend on the choice.
"""
from __future__ import annotations

import statistics
import time
import weakref

import torch
import torch.nn.functional as F

from exactspec.threads import size_class

ROWS, COLUMNS = "rows", "columns"  # x @ Wᵀ (torch's own) and (W @ xᵀ)ᵀ
MAX_ROWS = 64  # beyond this many rows both products are compute-bound alike: torch's own runs
TRIALS = 3  # timings of each product before a choice, and kept per product afterwards
RECHECK_EVERY = 256  # calls of a shape between two tries of the product not chosen


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
    """One (weight shape, dtype, size class of the rows, threads): each product's last TRIALS
    timings in seconds per row, and the faster. Not a `threads.ThreadChoice`: that one ranks its
    options by their medians at every unit, and a pass calls a layer of each shape dozens of
    times, so here the choice is made again only when the product not chosen has a new timing."""

    def __init__(self):
        self.seconds = {ROWS: [], COLUMNS: []}
        self.best: str | None = None
        self.calls = 0

    def next_product(self) -> str:
        self.calls += 1
        if self.best is None:  # both tried TRIALS times first, in turn
            return min(self.seconds, key=lambda name: len(self.seconds[name]))
        if self.calls % RECHECK_EVERY == 0:
            return ROWS if self.best == COLUMNS else COLUMNS
        return self.best

    def record(self, name: str, seconds: float) -> None:
        recent = self.seconds[name]
        recent.append(seconds)
        del recent[:-TRIALS]
        if self.best is not None and name == self.best:
            return  # the choice changes only once the other product has been timed again
        if all(len(s) >= TRIALS for s in self.seconds.values()):
            self.best = min(self.seconds, key=lambda n: statistics.median(self.seconds[n]))


class FasterLinear:
    """A model's `nn.Linear` layers, run within this context (a pass of exactspec's) as the
    product measured faster for their shape on CPU tensors of up to MAX_ROWS rows (see the module
    docstring); outside it, and for anything else, as torch runs them. Entering sets each layer's
    `forward` on the instance, leaving takes it off again: the model is not changed. `shapes`
    holds the timings, one `_Shape` per (N, K, dtype, size class of the rows, threads)."""

    def __init__(self, model: torch.nn.Module, shapes: dict, clock=time.perf_counter):
        self.shapes, self.clock = shapes, clock
        self.layers = [(layer, self._forward(layer)) for layer in model.modules()
                       if type(layer) is torch.nn.Linear]  # subclasses (quantized, LoRA) keep theirs

    def __enter__(self) -> "FasterLinear":
        # A plain attribute (not nn.Module.__setattr__'s); a forward the layer already has of its
        # own (accelerate's device-map hooks set one) stays.
        for layer, forward in self.layers:
            layer.__dict__.setdefault("forward", forward)
        return self

    def __exit__(self, *exc) -> None:
        for layer, forward in self.layers:
            if layer.__dict__.get("forward") is forward:
                del layer.__dict__["forward"]

    def _forward(self, layer: torch.nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            weight, bias = layer.weight, layer.bias
            if not _plain_cpu(x, weight, bias) or x.numel() > MAX_ROWS * x.size(-1):
                return F.linear(x, weight, bias)
            rows = x.numel() // x.size(-1)
            key = (*weight.shape, weight.dtype, size_class(rows), torch.get_num_threads())
            shape = self.shapes.get(key) or self.shapes.setdefault(key, _Shape())
            name = shape.next_product()
            started = self.clock()
            out = PRODUCTS[name](x, weight, bias)
            shape.record(name, (self.clock() - started) / rows)
            return out
        return forward


def _plain_cpu(x, weight, bias) -> bool:
    """Dense CPU tensors of one floating dtype (no tensor subclass: a sharded weight runs as is)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
                for t in tensors)
            and x.dim() >= 1 and x.size(-1) == weight.size(1) and x.is_floating_point()
            and x.dtype == weight.dtype and x.numel() > 0)


_SHAPES: dict = {}  # the machine's timings, per shape: process-wide (they describe the BLAS)
_MODELS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model → its FasterLinear


def faster_linear(model: torch.nn.Module) -> FasterLinear:
    """The context a model's CPU passes run in (made once per model, freed with it)."""
    if model not in _MODELS:
        _MODELS[model] = FasterLinear(model, _SHAPES)
    return _MODELS[model]
