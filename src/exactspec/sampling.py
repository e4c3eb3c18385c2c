"""Logits → decoding distribution, and one draw from it.

`probs_from_logits` makes both p (the target's) and q (the draft's) with the same settings
(the **same-processing** rule); `SamplingConfig` carries those settings through a generation.
`sample` is the one categorical draw every decoding path uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exactspec.noise import RowNoise, argmax, is_noise, lone_positive
from exactspec.penalties import (Penalized, add_bias, check_penalty_args, logit_bias_pairs,
                                 min_p_filter, penalize)


def check_sampling_args(temperature: float = 1.0, top_k: int | None = None,
                        top_p: float | None = None) -> None:
    """Raise ValueError naming the first bad sampling setting."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Transformers' TopKLogitsWarper: drop scores below the k-th largest (ties at it survive)."""
    top_k = min(top_k, scores.size(-1))
    kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return scores.masked_fill(scores < kth, -math.inf)


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Transformers' TopPLogitsWarper: drop the least likely tokens whose cumulative probability
    is <= 1 − top_p (ascending order), always keeping the most likely one."""
    sorted_scores, sorted_ids = torch.sort(scores, descending=False, dim=-1)  # [..., V]
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # [..., V]
    sorted_remove = cumulative <= (1 - top_p)  # [..., V]
    sorted_remove[..., -1:] = False
    remove = sorted_remove.scatter(-1, sorted_ids, sorted_remove)  # [..., V]
    return scores.masked_fill(remove, -math.inf)


def all_finite(values: torch.Tensor) -> bool:
    """No NaN and no ±inf in `values`. A finite sum clears them all in one reduction (torch.isfinite
    is several operations); a sum that overflows is checked entry by entry."""
    return math.isfinite(float(values.sum())) or bool(torch.isfinite(values).all())


def probs_from_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, *, min_p: float | None = None) -> torch.Tensor:
    """The decoding distribution over the last dimension: temperature, then top-k, then top-p,
    then min-p (Transformers' order and definitions), then softmax.

    Temperature 0 means greedy: a one-hot at the argmax (lowest index on ties). The same function
    with the same settings makes both p and q. Half-precision logits are computed in float32.
    """
    check_sampling_args(temperature, top_k, top_p)
    check_penalty_args(min_p=min_p)
    if logits.size(-1) == 0:
        raise ValueError("logits: the vocabulary dimension is empty, so no token is possible")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    greedy = argmax(logits).unsqueeze(-1) if temperature == 0 else None  # [..., 1], the first maximum
    # each row's maximum: NaN where a row has one (argmax and amax both take NaN as the maximum),
    # +inf or -inf where the checks fail
    top = logits.amax(dim=-1) if greedy is None else logits.gather(-1, greedy).squeeze(-1)  # [...]
    if not all_finite(top):
        if torch.isnan(top).any() or torch.isposinf(top).any():
            raise ValueError("logits contain NaN or +inf")
        raise ValueError("logits: a row is -inf everywhere, so no token is possible")
    if greedy is not None:
        return torch.zeros_like(logits).scatter_(-1, greedy, 1.0)
    scores = logits / temperature  # [..., V]
    if top_k is not None:
        scores = _top_k_filter(scores, top_k)
    if top_p is not None and top_p < 1:
        scores = _top_p_filter(scores, top_p)
    if min_p:
        scores = min_p_filter(scores, min_p)
    return scores.softmax(dim=-1)


def _one_per_row(generator, rows: int) -> bool:
    """Whether `generator` is a list of one stream per row; a list of another length is refused."""
    if not isinstance(generator, (list, tuple)):
        return False
    if len(generator) != rows:
        raise ValueError(f"generator must be one torch.Generator or one per row ({rows}), "
                         f"got a list of {len(generator)}")
    return True


def uniforms(shape, generator, dtype: torch.dtype, device) -> torch.Tensor:
    """U[0, 1) draws of `shape`. `generator`: one torch.Generator (or None) draws them all; a list
    of shape[0] generators gives each row its own stream (a row owns its randomness, rule 8):
    row b's shape[1:] draws come from generator[b] alone, whatever the other rows are."""
    if not _one_per_row(generator, shape[0] if len(shape) else 0):
        return torch.rand(shape, generator=generator, dtype=dtype, device=device)
    rows = [torch.rand(tuple(shape[1:]), generator=g, dtype=dtype, device=device) for g in generator]
    return torch.stack(rows) if rows else torch.empty(tuple(shape), dtype=dtype, device=device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One categorical draw per row of probs[..., V] (weights need not be normalized);
    `generator` may be a list of one generator per probs.shape[0] row (see `uniforms`).

    Inverse-CDF sampling: the first index whose float64 cumulative weight exceeds u · total,
    u ~ U[0, 1). A zero-weight token never has a cumulative weight above its predecessor's, so it
    is never chosen. (torch.multinomial gives the same law but takes ~1 ms at V = 49,152.)
    A row whose generator is a `RowNoise` (the coupled rule) draws by the race with the noise
    of its next position instead (`exactspec.noise`): the same law. A row with a single positive
    weight (greedy p, a token the grammar forces) is that token and draws nothing.
    """
    if is_noise(generator):
        return _sample_rows(probs, generator)
    flat = probs.reshape(-1, probs.size(-1))  # [N, V]
    rows = probs.shape[0] if probs.dim() > 1 else 1
    per_row = _one_per_row(generator, rows)
    tokens = _lone_positives(flat)  # [N], -1 where a row has several positive weights (or none)
    drawing = (tokens < 0).nonzero().squeeze(1)  # [n]
    if drawing.numel():
        width = flat.size(0) // rows  # draws per row of probs
        streams = [generator[i // width] for i in drawing.tolist()] if per_row else generator
        tokens[drawing] = _inverse_cdf(flat[drawing], streams)
    return tokens.reshape(probs.shape[:-1])  # [...]


_NUMPY_ROW = 8_192  # rows at least this long are scanned one by one in NumPy (`_lone_positives`)


def _lone_positives(flat: torch.Tensor) -> torch.Tensor:
    """Each row's only positive entry of flat[N, V], or -1 where it has none or several. [N]
    Long rows on the CPU go one by one through NumPy's single pass (a model's vocabulary: a
    tenth of torch's time at V = 151,936); short rows, as many as the lab draws, go through
    torch at once (a NumPy call per row costs ~9 µs: 186 ms against 1 ms for 20,000 rows of 6;
    the two cross between V = 4,096 and 16,384 on a 2-core EPYC)."""
    if flat.device.type == "cpu" and flat.size(-1) >= _NUMPY_ROW:
        return torch.tensor([-1 if (token := lone_positive(row)) is None else token for row in flat],
                            dtype=torch.long)
    positive = flat > 0  # [N, V]
    return torch.where(positive.sum(dim=-1) == 1, positive.int().argmax(dim=-1), -1)


def _inverse_cdf(flat: torch.Tensor, generator) -> torch.Tensor:
    """`sample`'s draw over flat[N, V] with one uniform per row. [N]"""
    cdf = flat.cumsum(dim=-1, dtype=torch.float64)  # [N, V]
    total = cdf[:, -1:]  # [N, 1]
    if not (total > 0).all():
        raise ValueError("cannot sample from a distribution with zero total weight")
    u = uniforms((flat.size(0),), generator, torch.float64, flat.device).reshape(-1, 1)  # [N, 1]
    tokens = torch.searchsorted(cdf, u * total, right=True).squeeze(-1)  # [N]
    overflow = tokens == flat.size(-1)  # u · total rounded up to total: take the last positive weight
    if overflow.any():
        last_positive = flat.size(-1) - 1 - (flat.flip(-1) > 0).int().argmax(-1)  # [N]
        tokens = torch.where(overflow, last_positive, tokens)
    return tokens  # [N]


def _sample_rows(probs: torch.Tensor, generators) -> torch.Tensor:
    """`sample` over probs[B, V] with one stream per row, some of them `RowNoise`. [B]"""
    if probs.dim() != 2 or probs.size(0) != len(generators):
        raise ValueError(f"per-row noise needs probs [B, V] with one stream per row, got shape "
                         f"{tuple(probs.shape)} for {len(generators)} streams")
    if not (probs.sum(dim=-1) > 0).all():
        raise ValueError("cannot sample from a distribution with zero total weight")
    tokens = [g.draw(row) if isinstance(g, RowNoise) else int(sample(row.unsqueeze(0), [g]))
              for row, g in zip(probs, generators)]
    return torch.tensor(tokens, dtype=torch.long, device=probs.device)  # [B]


@dataclass(frozen=True)
class SamplingConfig:
    """The decoding settings that make both p and q (the same-processing rule): temperature,
    top-k, top-p, and the penalties of `exactspec.penalties` (logit_bias: {token id: bias} or
    (id, bias) pairs, kept as sorted pairs; frequency_penalty and presence_penalty in [-2, 2];
    repetition_penalty > 0; min_p in [0, 1])."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None
    min_p: float | None = None

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p)
        check_penalty_args(self.frequency_penalty, self.presence_penalty, self.repetition_penalty,
                           self.min_p)
        object.__setattr__(self, "logit_bias", logit_bias_pairs(self.logit_bias))

    @property
    def needs_prefix(self) -> bool:
        """Whether the processing reads the tokens before each position (a penalty is set;
        Transformers' logits processors, `exactspec.hf.Processing`, do too): the engine then
        binds the settings to each round's rows with `after` and passes `drafts=` to `probs`."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1)

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """p or q from logits[..., V]; `drafts` (the tokens before each position) is not read."""
        if self.needs_prefix:
            raise ValueError("penalties read each row's tokens: bind the settings with "
                             ".after(rows, committed, prompts=..., generated=...)")
        return self.distribution(logits)

    def after(self, rows: torch.Tensor, committed, *, prompts, generated) -> Penalized:
        """Bound to one round's rows: prompts[b] row b's prompt tokens (no padding), generated[b]
        its new tokens so far (`rows` and `committed`, the prompt row as given then its new
        tokens, are what `exactspec.hf.Processing` reads; not read here)."""
        return Penalized(self, prompts, generated)

    def distribution(self, logits: torch.Tensor, seen: torch.Tensor | None = None,
                     counts: torch.Tensor | None = None) -> torch.Tensor:
        """logits[..., V] → probabilities: logit_bias, the penalties (seen[..., V]: tokens in the
        prompt or generated, counts[..., V]: times generated; None: none), then
        `probs_from_logits`."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        scores = add_bias(logits, self.logit_bias)  # [..., V]
        if seen is not None:
            scores = penalize(scores, seen, counts, self.repetition_penalty,
                              self.frequency_penalty, self.presence_penalty)
        return probs_from_logits(scores, self.temperature, self.top_k, self.top_p, min_p=self.min_p)


class RowSampling:
    """Per-row decoding settings (rule 8: a row owns its settings): row b's p and q are made with
    configs[b], by the same `SamplingConfig.probs` (the same-processing rule holds per row).
    Rows that share settings are processed together; settings with penalties are bound to their
    rows' tokens each round (`after`)."""

    def __init__(self, configs):
        self.configs = tuple(configs)  # one SamplingConfig per row
        self.groups: dict[SamplingConfig, list[int]] = {}  # the rows of each config
        for row, config in enumerate(self.configs):
            self.groups.setdefault(config, []).append(row)
        self.bound = dict(zip(self.groups, self.groups))  # what makes each group's probabilities

    @property
    def needs_prefix(self) -> bool:
        return any(config.needs_prefix for config in self.groups)

    def after(self, rows: torch.Tensor, committed, *, prompts, generated) -> "RowSampling":
        """Each group with penalties bound to its rows (as `SamplingConfig.after`, row b's
        committed[b], prompts[b], generated[b])."""
        bound = RowSampling(self.configs)
        for config, members in self.groups.items():
            if config.needs_prefix:
                bound.bound[config] = config.after(rows[members], [committed[i] for i in members],
                                                   prompts=[prompts[i] for i in members],
                                                   generated=[generated[i] for i in members])
        return bound

    def probs(self, logits: torch.Tensor, **kwargs) -> torch.Tensor:
        """logits[B, ..., V] → probabilities [B, ..., V], row b with configs[b]."""
        if logits.size(0) != len(self.configs):
            raise ValueError(f"logits must have one row per config ({len(self.configs)}), "
                             f"got shape {tuple(logits.shape)}")
        if len(self.groups) == 1:
            return self.bound[self.configs[0]].probs(logits, **kwargs)
        out = None
        for config, rows in self.groups.items():
            index = torch.tensor(rows, device=logits.device)  # [b]
            rows_of = {k: v[index.to(v.device)] if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}
            part = self.bound[config].probs(logits[index], **rows_of)  # [b, ..., V]
            out = part.new_empty(logits.shape) if out is None else out  # [B, ..., V]
            out[index] = part
        return out

    def select(self, rows: torch.Tensor) -> "RowSampling":
        return RowSampling(self.configs[i] for i in rows.tolist())

    def extend(self, configs) -> "RowSampling":
        return RowSampling((*self.configs, *configs))
