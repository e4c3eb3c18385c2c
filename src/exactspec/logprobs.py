"""Log-probabilities of the emitted tokens, read from the pass that verified them.

Every token a round emits (accepted drafts, the correction, the bonus) sits at a position of the
target's one pass over [last committed token, drafts]: position i holds the target's logits
after the committed prefix and the first i drafts. A token's reported log-probability is the
target's at its own position, whichever way it was chosen: a correction is drawn from the
residual normalized max(p − q, 0), but the residual is how the round samples, not what the
target thinks of the token, so it is never reported.

Two distributions, as vLLM's `logprobs_mode`:

- "raw" (the default): log-softmax of the target's logits as the model gave them, before any
  sampling setting (temperature, top-k, top-p, min-p, penalties, logit_bias, a grammar's mask).
  It is what OpenAI reports (its logprobs do not move with temperature) and vLLM's default; it
  says the same of a text whatever the request's settings, the draft or γ; and at temperature 0
  it still ranks the alternatives, where the processed distribution is a point mass.
- "processed": log p, the decoding distribution the output follows exactly (after every
  setting); tokens the settings exclude get −inf, and at temperature 0 the chosen token gets 0.

Only computed when asked (`logprobs=N`, N alternatives in 0..20): the default path reads nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROBS_MODES = ("raw", "processed")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability at its position, and the `top` N most
    likely tokens there as (id, log-probability), most likely first (lowest id on ties)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def check_logprobs_args(logprobs, mode: str = "raw") -> None:
    """Raise ValueError naming the first bad logprobs setting."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, "
                         f"got {logprobs!r}")
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")


def log_distribution(logits: torch.Tensor, p: torch.Tensor, mode: str) -> torch.Tensor:
    """logits[..., V] (the pass's) and p[..., V] (after the settings) → log-probabilities
    [..., V] in float32 or wider: "raw" the log-softmax of the logits, "processed" log p."""
    if mode == "raw":
        wide = logits if logits.dtype == torch.float64 else logits.float()
        return wide.log_softmax(dim=-1)
    wide = p if p.dtype == torch.float64 else p.float()
    return wide.log()


def emitted(logits: torch.Tensor, p: torch.Tensor, tokens: torch.Tensor, counts: list[int],
            wants: list[int | None], mode: str = "raw") -> list[list[TokenLogprob] | None]:
    """Row b's emitted tokens[b, :counts[b]] with their log-probabilities at positions
    0..counts[b]−1 of the pass (logits[b, i] and p[b, i]: the target's after the prefix and the
    first i drafts) and wants[b] alternatives each; None for rows whose wants[b] is None."""
    out: list[list[TokenLogprob] | None] = [None] * len(wants)
    asked = [b for b, n in enumerate(wants) if n is not None]
    if not asked:
        return out
    index = torch.tensor(asked, device=logits.device)  # [a]
    logs = log_distribution(logits[index], p[index], mode)  # [a, k, V]
    chosen = tokens[index, : logs.size(1)].clamp(min=0)  # [a, k], -1 padding read as id 0, unused
    values = logs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).tolist()  # [a, k]
    widest = max(wants[b] for b in asked)
    top = _top(logs, widest) if widest else None
    for j, b in enumerate(asked):
        n, k = wants[b], counts[b]
        out[b] = [TokenLogprob(int(chosen[j, i]), values[j][i],
                               tuple(top[j][i][:n]) if n else ()) for i in range(k)]
    return out


def _top(logs: torch.Tensor, n: int) -> list:
    """The n most likely (id, log-probability) at each position of logs[a, k, V], lowest id first
    on ties (a stable descending sort), as nested lists [a][k][n]."""
    n = min(n, logs.size(-1))
    kth = torch.topk(logs, n, dim=-1).values[..., -1:]  # [a, k, 1], the n-th largest
    return [[_top_of(position, threshold, n) for position, threshold in zip(row, row_kth)]
            for row, row_kth in zip(logs, kth)]


def _top_of(logs: torch.Tensor, kth: torch.Tensor, n: int) -> list:
    """The n most likely of logs[V], as a stable descending sort of all V would list them: the
    ids at or above the n-th largest value (ties included), ascending, sorted stably by value."""
    ids = (logs >= kth).nonzero().flatten()  # [m], m >= n, ascending
    values, order = torch.sort(logs[ids], descending=True, stable=True)  # [m]
    return list(zip(ids[order][:n].tolist(), values[:n].tolist()))
