"""Logit bias, repetition / frequency / presence penalties and min-p: settings that change the
decoding distribution, applied alike to p and q (the same-processing rule).

At a position of a row whose prompt is x and whose generated tokens before that position are
y_1..y_t (its committed new tokens, then the drafts before the position), token j's logit ℓ_j
becomes, in this order:

- logit_bias (OpenAI): ℓ_j + bias_j.
- repetition_penalty r (Transformers' RepetitionPenaltyLogitsProcessor, vLLM's): for j in x or
  y, ℓ_j / r where ℓ_j > 0, else ℓ_j · r.
- frequency_penalty f and presence_penalty s (OpenAI): ℓ_j − c_j · f − [c_j > 0] · s, with c_j
  = #{i : y_i = j}, counted over the generated tokens only, not the prompt.

Then temperature, top-k, top-p (`exactspec.sampling`), then min-p (Transformers'
MinPLogitsWarper: tokens whose probability is below min_p times the largest one are dropped).

The penalties read the tokens before each position, so their settings are bound to a round's rows
(`Penalized`): position j of a block is penalized by the drafts before it, the draft's q as it
draws them and the target's p as it scores them. Each p_i and q_i is then the penalized target's
and the penalized draft's distribution at the same prefix, and the verification rule keeps the
penalized target's law exactly.
"""
from __future__ import annotations

import math

import torch

MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty and presence_penalty: [-2, 2]
MAX_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_penalty_args(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
                       min_p=None) -> None:
    """Raise ValueError naming the first bad penalty setting."""
    for name, value in (("frequency_penalty", frequency_penalty),
                        ("presence_penalty", presence_penalty)):
        if not (_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                             f"got {value!r}")
    if not (_is_number(repetition_penalty) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")
    if min_p is not None and not (_is_number(min_p) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")


def logit_bias_pairs(logit_bias) -> tuple[tuple[int, float], ...] | None:
    """logit_bias (a dict {token id: bias} or (id, bias) pairs; None or empty: none) as sorted
    (id, bias) pairs, hashable. Ids are integers >= 0, biases numbers in [-100, 100]."""
    if not logit_bias:
        return None
    items = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias
    pairs = {}
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"logit_bias must map token ids to biases, got {logit_bias!r}")
        token, bias = item
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if not (_is_number(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise ValueError(f"logit_bias[{token}] must be a number in [-{MAX_BIAS:g}, "
                             f"{MAX_BIAS:g}], got {bias!r}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def add_bias(logits: torch.Tensor, pairs) -> torch.Tensor:
    """logits[..., V] + each (id, bias) of `pairs` at its id (a -inf logit stays -inf)."""
    if not pairs:
        return logits
    vocab = logits.size(-1)
    ids = [token for token, _ in pairs]
    if max(ids) >= vocab:
        raise ValueError(f"logit_bias token id must be in [0, {vocab}), got {max(ids)}")
    bias = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)  # [V]
    bias[ids] = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return logits + bias


def penalize(logits: torch.Tensor, seen: torch.Tensor, counts: torch.Tensor, repetition: float,
             frequency: float, presence: float) -> torch.Tensor:
    """The penalties of the module docstring: logits[..., V]; seen[..., V] (bool: in the prompt or
    generated), counts[..., V] (times generated)."""
    if repetition != 1:
        penalized = torch.where(logits > 0, logits / repetition, logits * repetition)  # [..., V]
        logits = torch.where(seen, penalized, logits)
    if frequency or presence:
        counts = counts.to(logits.dtype)
        logits = logits - counts * frequency - (counts > 0).to(logits.dtype) * presence
    return logits


def min_p_filter(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Transformers' MinPLogitsWarper: drop tokens whose probability is below min_p times the
    largest probability (the most likely token always stays)."""
    probs = scores.softmax(dim=-1)  # [..., V]
    top = probs.amax(dim=-1, keepdim=True)  # [..., 1]
    return scores.masked_fill(probs < min_p * top, -math.inf)


def token_counts(tokens: list[torch.Tensor], vocab: int, device) -> torch.Tensor:
    """counts[b, j] = how often token j occurs in tokens[b]. [b, V] (int64)"""
    counts = torch.zeros(len(tokens), vocab, dtype=torch.long, device=device)  # [b, V]
    for row, ids in enumerate(tokens):
        ids = torch.as_tensor(ids, dtype=torch.long, device=device).flatten()  # [t]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}) to be penalized, got "
                             f"{ids[(ids < 0) | (ids >= vocab)][0].item()}")
        counts[row].scatter_add_(0, ids, torch.ones_like(ids))
    return counts


class Penalized:
    """A `SamplingConfig` with penalties, bound to one round's rows: prompts[b] and generated[b]
    (row b's prompt tokens without padding, and its new tokens so far)."""

    def __init__(self, config, prompts: list[torch.Tensor], generated: list[torch.Tensor]):
        if len(prompts) != len(generated):
            raise ValueError(f"prompts and generated must give one entry per row, got "
                             f"{len(prompts)} and {len(generated)}")
        self.config, self.prompts, self.generated = config, prompts, generated
        self.counted: dict = {}  # (V, device) → (counts [b, V], in_prompt [b, V]), made once a round

    def committed(self, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(times each token was generated [b, V], whether it is in the prompt [b, V])."""
        key = (vocab, str(device))
        if key not in self.counted:
            self.counted[key] = (token_counts(self.generated, vocab, device),
                                 token_counts(self.prompts, vocab, device) > 0)
        return self.counted[key]

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits[b, n, V] (or [b, V], n = 1) → probabilities of the same shape. With k =
        drafts.size(1) ≥ n − 1, position j follows the committed tokens and drafts[:, : k − n + 1 + j]
        (as `exactspec.hf.AtPrefix`)."""
        if drafts is None:
            raise ValueError("drafts is required: penalties read the drafts before each position "
                             "(pass an empty [b, 0] tensor for the first)")
        single = logits.dim() == 2
        scores = logits.unsqueeze(1) if single else logits  # [b, n, V]
        if scores.dtype in (torch.float16, torch.bfloat16):
            scores = scores.float()
        (b, n, vocab), k = scores.shape, drafts.size(1)
        if b != len(self.generated) or drafts.size(0) != b:
            raise ValueError(f"logits and drafts must have one row per bound row ({len(self.generated)}), "
                             f"got {b} and {drafts.size(0)}")
        if k < n - 1:
            raise ValueError(f"drafts must hold at least n - 1 = {n - 1} tokens per row, got {k}")
        device = scores.device
        counts, in_prompt = self.committed(vocab, device)  # [b, V], [b, V]
        drafted = counts.new_zeros(b, k + 1, vocab)  # [b, k+1, V]
        if k:
            hot = torch.nn.functional.one_hot(drafts.to(device), vocab)  # [b, k, V]
            drafted[:, 1:] = hot.cumsum(dim=1)  # drafted[:, i]: counts of drafts[:, :i]
        counts = counts.unsqueeze(1) + drafted[:, k - n + 1:]  # [b, n, V], before each position
        seen = in_prompt.unsqueeze(1) | (counts > 0)  # [b, n, V]
        probs = self.config.distribution(scores, seen, counts)  # [b, n, V]
        return probs[:, 0] if single else probs
