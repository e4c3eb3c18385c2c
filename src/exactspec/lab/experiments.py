"""The numbers behind `exactspec lab` and the figures, computed from this project's own code.

Each `*_numbers` function returns what `exactspec lab ... --json` prints and what `figures`
writes to numbers.json: the reference's rejection-sampling table, its cat / dog / fox token
example, its cost model, and the token and block rules compared by exact enumeration.
"""
from __future__ import annotations

import itertools
import math

import torch

from exactspec import costmodel
from exactspec.lab import rejection
from exactspec.sampling import sample
from exactspec.verify import stop_distribution, verify_block

DEFAULT_SEED = 0


def rejection_numbers(n_proposals: int = 300_000, seed: int = DEFAULT_SEED, runs=None) -> dict:
    """The reference's rejection-sampling table: theoretical Z/C and observed acceptance per proposal, plus Z and
    the target's maximum. `runs` (from `run_reference_experiment`) is reused when given."""
    samplers = rejection.reference_samplers()
    runs = runs or rejection.run_reference_experiment(n_proposals, seed, samplers)
    argmax_x, max_f = rejection.target_maximum(rejection.reference_target)
    rows = []
    for name, sampler in samplers.items():
        run, theory = runs[name], sampler.theoretical_acceptance
        standard_error = math.sqrt(theory * (1 - theory) / run.n_proposed)  # under the theory
        rows.append({
            "name": name, "proposal": rejection.REFERENCE_PROPOSALS[name][0], "C": sampler.C,
            "theoretical_acceptance": theory, "acceptance_rate": run.acceptance_rate,
            "n_proposed": run.n_proposed, "n_accepted": run.n_accepted,
            "standard_error": standard_error,
            "z_score": (run.acceptance_rate - theory) / standard_error,
        })
    return {
        "target": "exp(-x^2/2) * [sin^2(6+x) + 3 cos^2(x) sin^2(4x) + 1] on [-3, 3]",
        "support": list(rejection.REFERENCE_SUPPORT), "Z": samplers["uniform"].normalizing_constant,
        "max_f": max_f, "argmax_x": argmax_x, "n_proposals": n_proposals, "seed": seed,
        "proposals": rows,
    }


TOKEN_EXAMPLE = {"tokens": ["cat", "dog", "fox"], "q": [0.60, 0.30, 0.10], "p": [0.30, 0.40, 0.30]}

# Proposals verified in one `verify_block` call; bounds memory for large --n.
_TOKEN_CHUNK = 1_000_000


def simulate_tokens(q, p, n: int, seed: int):
    """n proposals x ~ q at one fixed prefix, each verified by `verify_block` with γ = 1.

    Returns (accepted, replacement): LongTensor[V] counts of kept drafts and of corrections,
    by output token. One torch.Generator seeded with `seed` drives drafts and verification.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = q.numel()
    accepted = torch.zeros(vocab, dtype=torch.long)
    replacement = torch.zeros(vocab, dtype=torch.long)
    for start in range(0, n, _TOKEN_CHUNK):
        batch = min(_TOKEN_CHUNK, n - start)
        drafts = torch.multinomial(q.expand(batch, vocab), 1, replacement=True,
                                   generator=generator)  # [B, 1]
        q_block = q.expand(batch, 1, vocab)  # [B, γ=1, V]
        p_block = p.expand(batch, 2, vocab)  # [B, γ+1, V]; the bonus row is never emitted here
        result = verify_block(drafts, q_block, p_block, generator, "token")
        first = result.tokens[:, 0]  # [B], the kept draft or its correction
        kept = result.num_accepted == 1  # [B]
        accepted += torch.bincount(first[kept], minlength=vocab)
        replacement += torch.bincount(first[~kept], minlength=vocab)
    return accepted, replacement


def token_numbers(n: int = 10_000, seed: int = DEFAULT_SEED, example: dict = TOKEN_EXAMPLE) -> dict:
    """The reference's token example: acceptance min(1, p/q), residual max(p − q, 0), expected and simulated
    counts of accepted drafts and replacements, and the final frequencies against p."""
    q = torch.tensor(example["q"], dtype=torch.float64)  # [V]
    p = torch.tensor(example["p"], dtype=torch.float64)  # [V]
    residual = (p - q).clamp(min=0)  # [V]
    accepted, replacement = simulate_tokens(q, p, n, seed)
    total = accepted + replacement  # [V]
    from scipy import stats  # scipy loads only when the token lab runs

    chi2 = stats.chisquare(total.numpy(), f_exp=(n * p).numpy())
    return {
        "n": n, "seed": seed, "tokens": list(example["tokens"]),
        "q": q.tolist(), "p": p.tolist(),
        "acceptance_probability": (p / q).clamp(max=1).tolist(),
        "residual": residual.tolist(),
        "residual_normalized": (residual / residual.sum()).tolist(),
        "alpha": torch.minimum(p, q).sum().item(),
        "expected_accepted": (n * torch.minimum(p, q)).tolist(),
        "expected_replacement": (n * residual).tolist(),
        "accepted": accepted.tolist(), "replacement": replacement.tolist(),
        "total": total.tolist(), "frequency": (total.double() / n).tolist(),
        "n_accepted": int(accepted.sum()), "n_replaced": int(replacement.sum()),
        "chi_square": float(chi2.statistic), "chi_square_pvalue": float(chi2.pvalue),
    }


def cost_numbers(alpha: float = 0.7, c: float = 0.1, max_gamma: int = 12) -> dict:
    """The reference's cost model: E[N] and S(α, γ, c) for γ = 0..max_gamma, and the best γ."""
    rows = [{"gamma": g, "expected_tokens": costmodel.expected_tokens(alpha, g),
             "speedup": costmodel.speedup(alpha, g, c)} for g in range(max_gamma + 1)]
    gamma, best = costmodel.best_gamma(alpha, c, max_gamma)
    return {"alpha": alpha, "c": c, "max_gamma": max_gamma, "rows": rows,
            "best_gamma": gamma, "best_speedup": best}


def random_block_example(vocab: int, gamma: int, seed: int):
    """A draft q[γ, V] and target p[γ+1, V] (float64), the same at every prefix."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(1.5 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    return q, p


def exact_tokens_per_round(q, p, verify: str) -> float:
    """E[emitted tokens per round] = Σ over every draft block of Π q_i(x_i) · Σ_k (k+1) P(τ = k)."""
    gamma, vocab = q.shape
    blocks = torch.tensor(list(itertools.product(range(vocab), repeat=gamma)))  # [V^γ, γ]
    weight = q.gather(1, blocks.T).prod(0)  # [V^γ], Π q_i(x_i)
    law = stop_distribution(blocks, q.expand(len(blocks), -1, -1),
                            p.expand(len(blocks), -1, -1), verify)  # [V^γ, γ+1]
    emitted = torch.arange(1, gamma + 2, dtype=law.dtype)  # [γ+1]
    return float((weight * (law * emitted).sum(1)).sum())


def simulated_tokens_per_round(q, p, verify: str, n: int, seed: int) -> float:
    """The mean emitted tokens of n seeded rounds of verify_block."""
    gen = torch.Generator().manual_seed(seed)
    gamma, vocab = q.shape
    drafts = sample(q.expand(n, gamma, vocab), gen)  # [n, γ]
    result = verify_block(drafts, q.expand(n, -1, -1), p.expand(n, -1, -1), gen, verify)
    return float(result.num_emitted.double().mean())


def block_numbers(vocab: int = 5, gamma: int = 4, n: int = 100_000,
                  seed: int = DEFAULT_SEED) -> dict:
    q, p = random_block_example(vocab, gamma, seed)
    rows = [{"verify": verify, "exact_tokens_per_round": exact_tokens_per_round(q, p, verify),
             "simulated_tokens_per_round": simulated_tokens_per_round(q, p, verify, n, seed)}
            for verify in ("token", "block")]
    gain = rows[1]["exact_tokens_per_round"] / rows[0]["exact_tokens_per_round"] - 1
    return {"vocab": vocab, "gamma": gamma, "n": n, "seed": seed,
            "alpha_per_position": costmodel.acceptance_rate(p[:-1], q).tolist(), "rows": rows,
            "block_gain": gain}
