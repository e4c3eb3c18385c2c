"""The verification rule: accept / correct / bonus, for one position and for a block.

Vocabulary (used verbatim below):

- p: the target's decoding distribution at a position; q: the draft's, at the same prefix.
  Both come from `probs_from_logits` with the same settings.
- A round verifies γ draft tokens x_1..x_γ, with q_i and p_i the distributions they were scored
  under, plus p_{γ+1}, the target's distribution after the whole block.
- accepted draft: x_i is kept with probability a_i = min(1, p_i(x_i) / q_i(x_i)).
- correction: after the first rejection (at position n), a token drawn from normalized
  max(p_n − q_n, 0) — the mass that accepted drafts cannot supply.
- bonus: when all γ drafts are kept, a token drawn from p_{γ+1}.
- point-mass draft (q is None): the draft proposed x deterministically, so q is one-hot at x:
  a_i = p_i(x_i), and the correction is drawn from p_n with x_n removed, renormalized.
- τ (num_accepted): the number of drafts kept; a round emits τ + 1 tokens.

Why it is exact: for each token y, P(emit y) = min(p(y), q(y)) + max(p(y) − q(y), 0) = p(y).

`verify_block(verify="block")` judges the block jointly (Sun et al. 2024); see `_block_stop_probs`.
`verify="coupled"` draws the target's own token at each position from the row's noise for that
position and keeps drafts while they equal it (`verify_coupled`): the same law, and the same
tokens as plain decoding with that noise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from exactspec.noise import RowNoise
from exactspec.sampling import all_finite, sample
from exactspec.sampling import uniforms as draw_uniforms

VERIFY_RULES = ("token", "block", "coupled")

# How far a probability vector's sum may stray from 1 before it is refused, per dtype.
_SUM_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclass
class BlockResult:
    """One round's outcome per row.

    tokens: LongTensor[B, γ+1] — the emitted tokens first, then -1 padding.
    num_accepted: LongTensor[B] in 0..γ (τ); each row emitted num_accepted + 1 tokens.
    """

    tokens: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


# --------------------------------------------------------------------------- input checks


def _check_probs(name: str, probs: torch.Tensor) -> None:
    """Refuse anything that is not a probability vector over the last dimension.
    (NaN and ±inf make a row's sum non-finite, so one sum and one minimum cover every case.)"""
    if not torch.is_floating_point(probs):
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {probs.dtype}")
    if probs.numel() == 0:
        return
    wide = torch.float64 if probs.dtype == torch.float64 else torch.float32
    sums = probs.sum(dim=-1, dtype=wide)  # [...]
    if not all_finite(sums):
        raise ValueError(f"{name} must be finite, got NaN or inf")
    lowest = probs.amin().item()
    if lowest < 0:
        raise ValueError(f"{name} must be non-negative, got minimum {lowest:.3g}")
    worst = (sums - 1).abs().max().item()
    if worst > _SUM_TOLERANCE.get(probs.dtype, 1e-4):
        raise ValueError(f"{name} must sum to 1 over the vocabulary, off by up to {worst:.3g}")


def _check_block_inputs(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                        verify: str) -> None:
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {VERIFY_RULES}, got {verify!r}")
    if draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a LongTensor[B, γ], got {draft_tokens.dtype} "
                         f"of shape {tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if p.dim() != 3 or p.shape[:2] != (batch, gamma + 1):
        raise ValueError(f"p must have shape [B, γ+1, V] = [{batch}, {gamma + 1}, V], "
                         f"got {tuple(p.shape)}")
    vocab = p.size(-1)
    if q is not None and q.shape != (batch, gamma, vocab):
        raise ValueError(f"q must have shape [B, γ, V] = [{batch}, {gamma}, {vocab}], "
                         f"got {tuple(q.shape)}")
    if draft_tokens.numel() and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        bad = draft_tokens[(draft_tokens < 0) | (draft_tokens >= vocab)][0].item()
        raise ValueError(f"draft_tokens must be in [0, {vocab}), got {bad}")
    _check_probs("p", p)
    if q is not None:
        _check_probs("q", q)


# --------------------------------------------------------------------------- the rule


def _draft_probs(draft_tokens: torch.Tensor, q: torch.Tensor | None,
                 p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """p_i(x_i) and q_i(x_i) for each draft token; q_i(x_i) = 1 for a point-mass draft."""
    index = draft_tokens.unsqueeze(-1)  # [B, γ, 1]
    p_x = p[:, :-1].gather(-1, index).squeeze(-1)  # [B, γ]
    if q is None:
        return p_x, torch.ones_like(p_x)
    q_x = q.gather(-1, index).squeeze(-1)  # [B, γ]
    if (q_x == 0).any():
        row, pos = (q_x == 0).nonzero()[0].tolist()
        raise ValueError(f"draft_tokens[{row}, {pos}] = {draft_tokens[row, pos].item()} has zero "
                         "probability under q: drafts must be sampled from q")
    return p_x, q_x


def acceptance_probs(draft_tokens: torch.Tensor, q: torch.Tensor | None,
                     p: torch.Tensor) -> torch.Tensor:
    """a_i = min(1, p_i(x_i) / q_i(x_i)) for each draft token: [B, γ]."""
    p_x, q_x = _draft_probs(draft_tokens, q, p)
    return (p_x / q_x).clamp(max=1.0)  # [B, γ]


def _block_survival(draft_tokens: torch.Tensor, q: torch.Tensor | None,
                    p: torch.Tensor) -> torch.Tensor:
    """The block rule's a_0..a_γ: a_0 = 1, a_i = min(a_{i−1} · p_i(x_i) / q_i(x_i), 1). [B, γ+1]"""
    p_x, q_x = _draft_probs(draft_tokens, q, p)
    ratios = p_x / q_x  # [B, γ]
    survival = [torch.ones_like(ratios[:, 0]) if ratios.size(1) else p.new_ones(p.size(0))]
    for i in range(ratios.size(1)):
        # A dead block stays dead: 0 · inf (q(x) at the float floor makes p/q overflow) is 0.
        alive = survival[-1] > 0  # [B]
        survival.append(torch.where(alive, survival[-1] * ratios[:, i], 0.0).clamp(max=1.0))  # [B]
    return torch.stack(survival, dim=1)  # [B, γ+1]


def _residual(p_n: torch.Tensor, q_n: torch.Tensor | None, x_n: torch.Tensor,
                  scale: torch.Tensor) -> torch.Tensor:
    """max(scale · p_n − q_n, 0), with q_n one-hot at x_n when q_n is None. [B, V]"""
    scaled = scale.unsqueeze(-1) * p_n  # [B, V]
    if q_n is None:
        # scale · p(x) ≤ 1, so subtracting the one-hot only zeroes the draft's own entry.
        return scaled.scatter(-1, x_n.unsqueeze(-1), 0.0)
    return (scaled - q_n).clamp(min=0)


def next_token_weights(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                       num_accepted: torch.Tensor, verify: str = "block") -> torch.Tensor:
    """Unnormalized distribution of the token emitted after τ = num_accepted kept drafts. [B, V]

    τ = γ: the bonus, from p_{γ+1}. τ < γ: the correction, from max(s · p_{τ+1} − q_{τ+1}, 0)
    with s = 1 for the token rule and s = a_τ (the block's survival) for the block rule.
    A residual whose mass is zero in floating point (p ≈ q, where in exact arithmetic the
    rejection has probability 0) falls back to p itself: the exact-arithmetic limit, not a floor.
    """
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=p.device)  # [B]
    p_n = p[rows, num_accepted]  # [B, V]
    if gamma == 0:
        return p_n
    at = num_accepted.clamp(max=gamma - 1)  # [B], a valid draft index for the rows with τ = γ
    x_n = draft_tokens[rows, at]  # [B]
    q_n = None if q is None else q[rows, at]  # [B, V]
    if verify == "block":
        scale = _block_survival(draft_tokens, q, p)[rows, num_accepted]  # [B]
    else:
        scale = torch.ones_like(p_n[:, 0])  # [B]
    residual = _residual(p_n, q_n, x_n, scale)  # [B, V]
    use_p = (num_accepted == gamma) | (residual.sum(dim=-1) == 0)  # [B]
    return torch.where(use_p.unsqueeze(-1), p_n, residual)  # [B, V]


def _block_stop_probs_h(draft_tokens: torch.Tensor, q: torch.Tensor | None,
                        p: torch.Tensor) -> torch.Tensor:
    """The block rule's h_1..h_γ: h_i = r_i / (r_i + 1 − a_i) for i < γ (1 where that is 0/0),
    h_γ = a_γ, with r_i = Σ_x max(a_i · p_{i+1}(x) − q_{i+1}(x), 0). [B, γ]"""
    batch, gamma = draft_tokens.shape
    survival = _block_survival(draft_tokens, q, p)  # [B, γ+1]
    h = [survival[:, gamma]]
    for i in range(gamma - 1, 0, -1):
        q_next = None if q is None else q[:, i]  # [B, V]
        r = _residual(p[:, i], q_next, draft_tokens[:, i], survival[:, i]).sum(-1)  # [B]
        denominator = r + (1 - survival[:, i])  # [B]; r + 1 first would drop r's low bits
        ratio = r / denominator.where(denominator > 0, 1.0)  # [B]
        h.append(torch.where(denominator > 0, ratio.clamp(0.0, 1.0), 1.0))
    return torch.stack(h[::-1], dim=1) if gamma else survival[:, :0]  # [B, γ]


def stop_distribution(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                      verify: str = "block") -> torch.Tensor:
    """The exact law of τ: P(num_accepted = k) for k = 0..γ, [B, γ+1] (the reference that the
    sampling in `verify_block` is tested against).

    token: P(τ = k) = a_1 ··· a_k · (1 − a_{k+1}), and a_1 ··· a_γ for k = γ.
    block: τ is the largest i with η_i < h_i, so P(τ = k) = h_k · Π_{j>k} (1 − h_j), h_0 = 1.
    """
    _check_block_inputs(draft_tokens, q, p, verify)
    if verify == "coupled":
        raise ValueError("stop_distribution has no closed form for verify 'coupled' (its drafts "
                         "and the target share noise); use verify 'token' for point-mass drafts")
    if verify == "block":
        h = _block_stop_probs_h(draft_tokens, q, p)  # [B, γ]
        h = torch.cat([torch.ones_like(p[:, 0, :1]), h], dim=1)  # [B, γ+1], h_0 = 1
        later_rejects = torch.cat([(1 - h[:, 1:]).flip(1).cumprod(1).flip(1),
                                   torch.ones_like(h[:, :1])], dim=1)  # [B, γ+1]
        return h * later_rejects
    a = acceptance_probs(draft_tokens, q, p)  # [B, γ]
    survive = torch.cat([torch.ones_like(p[:, 0, :1]), a.cumprod(dim=1)], dim=1)  # [B, γ+1]
    stop_here = torch.cat([1 - a, torch.ones_like(p[:, 0, :1])], dim=1)  # [B, γ+1]
    return survive * stop_here


def _sample_num_accepted(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                         verify: str, generator: torch.Generator | None) -> torch.Tensor:
    """Draw τ per row with one uniform per draft position. [B]

    token: keep x_i while u_i < a_i; τ = the number kept before the first rejection.
    block: τ = the largest i with η_i < h_i (0 if none).
    """
    batch, gamma = draft_tokens.shape
    uniforms = draw_uniforms((batch, gamma), generator, p.dtype, p.device)  # [B, γ]
    if verify == "block" and gamma > 0:
        h = _block_stop_probs_h(draft_tokens, q, p)  # [B, γ]
        positions = torch.arange(1, gamma + 1, device=p.device)  # [γ]
        return torch.where(uniforms < h, positions, 0).amax(dim=1)  # [B]; u < h: h = 0 never keeps
    kept = uniforms < acceptance_probs(draft_tokens, q, p)  # [B, γ]
    return kept.long().cumprod(dim=1).sum(dim=1)  # [B]


def verify_block(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                 generator: torch.Generator | None = None, verify: str = "block") -> BlockResult:
    """Verify a block of drafts per row: keep drafts, stop at the first rejection, correct or
    add the bonus.

    draft_tokens: LongTensor[B, γ], sampled from q (or proposed deterministically: q None);
    q: [B, γ, V] the draft's distributions; p: [B, γ+1, V] the target's, the last one after
    the whole block. verify "token" is the reference's rule; "block" judges the block jointly
    (Sun et al. 2024) and never emits fewer tokens per round in expectation; "coupled" is
    `verify_coupled` (generator: one `RowNoise` per row). generator: one torch.Generator, or a
    list of one per row, each row drawing only from its own (rule 8).
    """
    _check_block_inputs(draft_tokens, q, p, verify)
    if verify == "coupled":
        return verify_coupled(draft_tokens, p, generator)
    batch, gamma = draft_tokens.shape
    if gamma == 0:  # no drafts (a round that stepped aside): τ = 0 and the bonus is a draw from p_1
        return BlockResult(tokens=sample(p[:, 0], generator).unsqueeze(1),
                           num_accepted=draft_tokens.new_zeros(batch))
    num_accepted = _sample_num_accepted(draft_tokens, q, p, verify, generator)  # [B]
    weights = next_token_weights(draft_tokens, q, p, num_accepted, verify)  # [B, V]
    next_token = sample(weights, generator)  # [B]
    positions = torch.arange(gamma + 1, device=p.device)  # [γ+1]
    padded = torch.cat([draft_tokens, draft_tokens.new_full((batch, 1), -1)], dim=1)  # [B, γ+1]
    tokens = torch.where(positions < num_accepted.unsqueeze(1), padded, -1)  # [B, γ+1]
    tokens[torch.arange(batch, device=p.device), num_accepted] = next_token
    return BlockResult(tokens=tokens, num_accepted=num_accepted)


def verify_coupled(draft_tokens: torch.Tensor, p: torch.Tensor, noise) -> BlockResult:
    """The coupled rule: y_i, the race over p_i with the row's noise at its position i
    (`exactspec.noise`), is the target's token there; drafts are kept while x_i = y_i, and the
    round emits y_1..y_{τ+1} (the correction at the first x_i ≠ y_i, else the bonus y_{γ+1}).

    Exact: each y_i is a draw from p_i whose noise belongs to position i alone, independent of
    the prefix before it, so the emitted tokens follow the target's law; and they are the tokens
    plain decoding with the same noise emits, whatever was drafted and whatever γ. A point-mass
    draft x is kept with probability p(x), as under the token rule. Positions past a row's first
    mismatch are never raced. draft_tokens [B, γ], p [B, γ+1, V], noise: one `RowNoise` per row.
    """
    batch, gamma = draft_tokens.shape
    if not (isinstance(noise, (list, tuple)) and len(noise) == batch
            and all(isinstance(row, RowNoise) for row in noise)):
        raise ValueError(f"verify 'coupled' needs one RowNoise per row ({batch}) as its "
                         f"generator, got {type(noise).__name__}")
    tokens = [[-1] * (gamma + 1) for _ in range(batch)]  # [B][γ+1]
    num_accepted = [0] * batch  # [B]
    drafts, alive = draft_tokens.tolist(), list(range(batch))
    for i in range(gamma + 1):
        for b in alive:  # y_i of the rows still going
            tokens[b][i] = noise[b].token(p[b, i], i)
        alive = [b for b in alive if i < gamma and tokens[b][i] == drafts[b][i]]
        for b in alive:
            num_accepted[b] += 1
    return BlockResult(tokens=draft_tokens.new_tensor(tokens).view(batch, gamma + 1),
                       num_accepted=draft_tokens.new_tensor(num_accepted))


def verify_rows(draft_tokens: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor,
                generators: list, lengths: list[int], rules: list[str]) -> BlockResult:
    """`verify_block` with each row's own block length, rule and random stream (rule 8).

    Row b verifies only its first lengths[b] drafts (γ_b ≤ γ) with rule rules[b] and draws from
    generators[b]: it is exactly the round that row would have alone with γ_b drafts (the drafts
    after γ_b are ignored and the bonus comes from p_{γ_b+1}). Rows with the same (γ_b, rule)
    are verified together. Returns tokens [B, γ+1] (−1 padded) and num_accepted [B].
    """
    batch, gamma = draft_tokens.shape
    if not len(generators) == len(lengths) == len(rules) == batch:
        raise ValueError(f"generators, lengths and rules need one entry per row ({batch}), got "
                         f"{len(generators)}, {len(lengths)} and {len(rules)}")
    tokens = draft_tokens.new_full((batch, gamma + 1), -1)  # [B, γ+1]
    num_accepted = draft_tokens.new_zeros(batch)  # [B]
    groups: dict[tuple[int, str], list[int]] = {}
    for row, key in enumerate(zip(lengths, rules)):
        if not 0 <= key[0] <= gamma:
            raise ValueError(f"lengths[{row}] must be in [0, {gamma}], got {key[0]}")
        groups.setdefault(key, []).append(row)
    for (length, rule), rows in groups.items():
        index = torch.tensor(rows, device=draft_tokens.device)  # [b]
        part = verify_block(draft_tokens[index, :length], None if q is None else q[index, :length],
                            p[index, : length + 1], [generators[r] for r in rows], rule)
        tokens[index, : length + 1] = part.tokens  # [b, γ_b+1]
        num_accepted[index] = part.num_accepted  # [b]
    return BlockResult(tokens=tokens, num_accepted=num_accepted)


def verify_token(token: int, q: torch.Tensor | None, p: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, bool]:
    """One position (the reference's token rule): keep `token` with probability min(1, p(token)/q(token)),
    otherwise draw the correction from normalized max(p − q, 0). Returns (output_token, accepted).
    """
    vocab = p.size(-1)
    if p.dim() != 1 or (q is not None and q.shape != p.shape):
        raise ValueError(f"p and q must be vectors of the same length, got {tuple(p.shape)} "
                         f"and {None if q is None else tuple(q.shape)}")
    if not isinstance(token, int) or not 0 <= token < vocab:
        raise ValueError(f"token must be an int in [0, {vocab}), got {token!r}")
    # One round with γ = 1; the bonus row of p is never used when the draft is rejected.
    p_round = torch.stack([p, p]).unsqueeze(0)  # [1, 2, V]
    q_round = None if q is None else q.view(1, 1, vocab)  # [1, 1, V]
    result = verify_block(torch.tensor([[token]], device=p.device), q_round, p_round, generator, "token")
    accepted = bool(result.num_accepted.item() == 1)
    return (token if accepted else int(result.tokens[0, 0].item())), accepted
