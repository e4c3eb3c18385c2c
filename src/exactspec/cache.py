"""A causal language model with its own KV cache over B rows of committed tokens.

Both the target and a model draft use it. The cache is rectangular, [B, heads, T, dim], and a
boolean `valid[B, T]` says which of its T columns hold a kept token of each row; the others are
**holes**: left padding of shorter prompts, and drafts that one row rejected while another kept
its. Holes are masked out of attention, and each row's tokens get contiguous `position_ids`
despite them, so every row computes exactly what it would alone.

Why holes rather than cropping every row to the shortest and re-feeding the rest: a re-feed
costs a forward pass over tokens already scored, every round, in proportion to how unevenly the
rows accepted; a hole costs only its attention column until the next compaction. Holes that
every row shares at the end are cropped at once (so with B = 1 the cache is simply cropped back
to the kept prefix: the stop-at-first-rejection rule), and `compact` squeezes out the rest when they reach half the cache.

`feed` runs only the new tokens, and the counters record every call and token fed, so tests can
show that nothing is recomputed after the prefill.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache

from exactspec.kernels import faster_products
from exactspec.models.loaded import Memory, input_device
from exactspec.sampling import all_finite


def _cache_argument(model: torch.nn.Module) -> str:
    """Transformers 5 names the cache argument `cache`; older releases `past_key_values`."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class CachedModel:
    """One model, one KV cache over B rows, with holes masked out (see the module docstring).
    Its passes run the model with the faster matrix products (`kernels.faster_products`), kept in
    `memory` (the model's own, `models.loaded.Memory`; None: a fresh one)."""

    def __init__(self, model: torch.nn.Module, name: str, vocab_size: int, batch_size: int = 1,
                 memory: Memory | None = None):
        self.model, self.name, self.vocab_size = model, name, vocab_size
        self.memory = Memory() if memory is None else memory
        self.runner = faster_products(model, self.memory)
        self.device = input_device(model)
        self._cache_arg = _cache_argument(model)
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache = DynamicCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)  # [B, T]
        self.calls = 0
        self.tokens_fed = 0
        self.padding_fed = 0  # padding slots run through the model (a cost of batching)
        self.hole_shares: list[float] = []  # share of hole columns after each round

    @property
    def length(self) -> int:
        """Columns in the cache, holes included (T)."""
        return self.valid.size(1)

    @property
    def kept(self) -> torch.Tensor:
        """Kept tokens per row, i.e. the position of each row's next token. [B]"""
        return self.valid.sum(dim=1)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Fill the cache with the prompts tokens[B, n] (left-padded, so the last column is a real
        token in every row) and return the logits after them, [B, V]; keep ≥ 1: after each of the
        last `keep` columns (real in every row), [B, keep, V]. Only those positions' logits are
        computed: a prompt's output layer would otherwise cost more than a step."""
        last = max(keep, 1)
        kept = {"logits_to_keep": last} if self._keeps_logits else {}
        output, positions = self._run(tokens, valid, **kept)
        logits = output.logits[:, -last:, : self.vocab_size].to(self.device)  # [B, last, V]
        check_finite(logits, valid[:, -last:], positions[:, -last:], self.name)
        return logits if keep else logits[:, 0]  # [B, keep, V] or [B, V]

    def feed(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Run tokens[B, n] after the cache; `valid[B, n]` marks padding slots (False) that become
        holes at once. Returns float logits[B, n, V] over the usable vocabulary (embedding rows
        past the tokenizer's vocabulary are dropped: zero probability)."""
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        output, positions = self._run(tokens, valid)
        logits = output.logits[..., : self.vocab_size].to(self.device)  # [B, n, V]
        check_finite(logits, valid, positions, self.name)
        return logits

    def threads(self):
        """The generation runs with torch's threads as they are (see `exactspec.targets`)."""
        return contextlib.nullcontext()

    def join(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """Rows appended last with tokens[n, L] (left-padded): prefilled on their own, then
        merged (`merge`)."""
        other = CachedModel(self.model, self.name, self.vocab_size, tokens.size(0), self.memory)
        if tokens.size(1):
            other.prefill(tokens, valid)
        self.merge(other)

    def _run(self, tokens: torch.Tensor, valid: torch.Tensor, **kwargs):
        positions = self.kept.unsqueeze(1) + valid.long().cumsum(dim=1) - 1  # [B, n]
        self.valid = torch.cat([self.valid, valid], dim=1)  # [B, T + n]
        # One thread count for every pass (torch's, as configured): a reduction split another
        # way can round differently, and a seed names one text. `runner` holds the faster products.
        output = self.runner(
            input_ids=tokens, attention_mask=self.valid.long(), position_ids=positions.clamp(min=0),
            use_cache=True, **{self._cache_arg: self.cache}, **kwargs)
        self.cache = getattr(output, self._cache_arg, None) or getattr(output, "past_key_values")
        self.calls += 1
        kept = int(valid.sum())
        self.tokens_fed += kept
        self.padding_fed += valid.numel() - kept
        return output, positions

    def discard_last(self, counts: torch.Tensor) -> None:
        """Make the last counts[b] columns of row b holes (drafts scored under a prefix that was
        not kept: the stop-at-first-rejection rule); crop the columns that are holes in every row."""
        columns = torch.arange(self.length, device=self.device)  # [T]
        self.valid &= columns < (self.length - counts.to(self.device)).unsqueeze(1)  # [B, T]
        self._crop_shared_holes()
        if self.length > 32 and self.valid.float().mean() < 0.5:
            self.compact()
        if self.valid.numel():
            self.hole_shares.append(1 - self.valid.float().mean().item())

    def _crop_shared_holes(self) -> None:
        live = self.valid.any(dim=0)  # [T]
        keep = int(live.nonzero().max()) + 1 if live.any() else 0
        if keep < self.length:
            if keep:
                self.cache.crop(keep - self.length)
            else:  # a fresh cache: `select` would skip empty layers, leaving their old batch size
                self.cache = DynamicCache()
            self.valid = self.valid[:, :keep]

    def compact(self) -> None:
        """Squeeze the holes out: each row's kept columns, in order, right-aligned (left-padded
        with holes to the longest row). Positions are unchanged: rotary embeddings are already
        applied to the cached keys."""
        kept = self.kept  # [B]
        width = int(kept.max())
        order = torch.argsort((~self.valid).long(), dim=1, stable=True)  # [B, T], kept columns first
        slot = torch.arange(width, device=self.device) - (width - kept).unsqueeze(1)  # [B, T']
        index = order.gather(1, slot.clamp(min=0))  # [B, T']
        new_valid = slot >= 0  # [B, T']
        for layer in self.cache.layers:  # an offloaded target's layers may sit on several devices
            gather = index.to(layer.keys.device)[:, None, :, None].expand(
                -1, layer.keys.size(1), -1, layer.keys.size(3))  # [B, H, T', D]
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = new_valid

    def select(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished rows stop costing compute)."""
        self.cache.batch_select_indices(rows.cpu())  # CPU indices suit layers on any device
        self.valid = self.valid[rows.to(self.device)]
        self._crop_shared_holes()

    def merge(self, other: "CachedModel") -> None:
        """Append the rows of `other` (the same model, prefilled on its own) below this batch's
        rows: rows joining a running batch. The shorter cache is left-padded with hole columns so
        both are rectangular; holes are masked and positions come from `valid`, so every row
        computes exactly what it did before. A side with no columns contributes only holes."""
        width = max(self.length, other.length)
        shapes = self.cache.layers or other.cache.layers  # where a side has none, holes need a shape
        merged = []
        for i, like in enumerate(shapes):
            parts = [_left_padded(side.cache.layers[i] if side.cache.layers else None, like,
                                  side.valid.size(0), width) for side in (self, other)]
            merged.append([torch.cat(kv, dim=0) for kv in zip(*parts)])  # keys, values [B+n, H, T, D]
        cache = self.cache if self.cache.layers else other.cache
        for layer, (keys, values) in zip(cache.layers, merged):
            layer.keys, layer.values = keys, values
        self.cache = cache
        holes = [torch.zeros(side.valid.size(0), width - side.length, dtype=torch.bool,
                             device=self.device) for side in (self, other)]
        self.valid = torch.cat([torch.cat([holes[0], self.valid], dim=1),
                                torch.cat([holes[1], other.valid.to(self.device)], dim=1)])  # [B+n, T]
        self.calls += other.calls
        self.tokens_fed += other.tokens_fed
        self.padding_fed += other.padding_fed


def check_finite(logits: torch.Tensor, valid: torch.Tensor | None, positions, name: str) -> None:
    """No silent NaN (the no-floors rule): NaN or +inf logits[B, n, V], or -inf everywhere (no
    token possible), at a valid[B, n] slot (valid None: every slot) raise an error naming the
    model and the position (positions[b][j]: a tensor or nested lists, read only then)."""
    if all_finite(logits):  # no NaN and no ±inf anywhere: the common case, in one vectorized
        return  # sum (a fiftieth of the checks below at V = 151,936)
    nan = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1)  # [B, n]
    empty = torch.isneginf(logits).all(dim=-1)  # [B, n]
    if valid is not None:
        nan, empty = nan & valid, empty & valid
    for bad, what in ((nan, "NaN or +inf logits"), (empty, "-inf logits for every token")):
        if bad.any():
            row, col = bad.nonzero()[0].tolist()
            raise ValueError(f"model {name!r} produced {what} at position "
                             f"{int(positions[row][col])}" + (f" of row {row}" if bad.size(0) > 1 else ""))


def _left_padded(layer, like, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values [rows, H, width, D], with zero (hole) columns on the left; a
    missing layer (an empty cache) is all holes, shaped like `like`."""
    out = []
    for name in ("keys", "values"):
        ref = getattr(like, name)  # [B, H, T, D]
        have = getattr(layer, name) if layer is not None else ref.new_zeros(rows, ref.size(1), 0, ref.size(3))
        pad = ref.new_zeros(rows, ref.size(1), width - have.size(2), ref.size(3))
        out.append(torch.cat([pad, have], dim=2))  # [rows, H, width, D]
    return out[0], out[1]
