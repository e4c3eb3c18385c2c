"""`exactspec lab ...` and `exactspec figures`: the seed's numbers, run from this project's code.

    exactspec lab rejection [--n 300000] [--seed S] [--json]   Parts 1–3: the continuous sampler
    exactspec lab tokens    [--n 10000]  [--seed S] [--json]   Part 5: cat / dog / fox
    exactspec lab cost [--alpha 0.7] [--c 0.1] [--max-gamma 12] [--json]   Part 8
    exactspec lab block [--vocab 5] [--gamma 4] [--n 100000] [--seed S] [--json]   block verification
    exactspec figures --out DIR [--seed S]                     figures 1–5 and numbers.json

Each lab command is a `LabCommand` in `LAB_COMMANDS`: a name, its arguments, and a handler.
Add one by appending an entry. The `*_numbers` functions compute what `--json` prints (and
what `figures` writes to numbers.json); the handlers only check input and print.
Options arrive as text and are checked here, so bad input is one line naming the option.
Heavy imports (NumPy, SciPy, torch, Matplotlib) happen inside the functions that need them.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable

from exactspec.cli import CliError, print_json, print_table

DEFAULT_SEED = 0


# --------------------------------------------------------------------------- option parsing


def parse_int(option: str, text: str, minimum: int) -> int:
    """An integer option >= minimum, or a CliError naming the option and the value."""
    kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    try:
        value = int(str(text).strip())
    except ValueError:
        raise CliError(f"{option} must be {kind}, got {text}") from None
    if value < minimum:
        raise CliError(f"{option} must be {kind}, got {text}")
    return value


def parse_float(option: str, text: str, low: float, high: float = math.inf) -> float:
    """A finite float option in [low, high], or a CliError naming the option and the value."""
    where = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
    try:
        value = float(str(text).strip())
    except ValueError:
        raise CliError(f"{option} must be a number {where}, got {text}") from None
    if not (math.isfinite(value) and low <= value <= high):
        raise CliError(f"{option} must be a number {where}, got {text}")
    return value


def parse_seed(text: str) -> int:
    return parse_int("--seed", text, minimum=0)


def show_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """print_table with readable headers: columns are (header, field, format)."""
    print_table([{header: row.get(field) for header, field, _ in columns} for row in rows],
                [header for header, _, _ in columns],
                {header: fmt for header, _, fmt in columns})


# --------------------------------------------------------------------------- lab rejection


def rejection_numbers(n_proposals: int = 300_000, seed: int = DEFAULT_SEED, runs=None) -> dict:
    """The seed's Part 3 table: theoretical Z/C and observed acceptance per proposal, plus Z and
    the target's maximum. `runs` (from `run_seed_experiment`) is reused when given."""
    from exactspec import rejection

    samplers = rejection.seed_samplers()
    runs = runs or rejection.run_seed_experiment(n_proposals, seed, samplers)
    argmax_x, max_f = rejection.target_maximum(rejection.seed_target)
    rows = []
    for name, sampler in samplers.items():
        run, theory = runs[name], sampler.theoretical_acceptance
        standard_error = math.sqrt(theory * (1 - theory) / run.n_proposed)  # under the theory
        rows.append({
            "name": name, "proposal": rejection.SEED_PROPOSALS[name][0], "C": sampler.C,
            "theoretical_acceptance": theory, "acceptance_rate": run.acceptance_rate,
            "n_proposed": run.n_proposed, "n_accepted": run.n_accepted,
            "standard_error": standard_error,
            "z_score": (run.acceptance_rate - theory) / standard_error,
        })
    return {
        "target": "exp(-x^2/2) * [sin^2(6+x) + 3 cos^2(x) sin^2(4x) + 1] on [-3, 3]",
        "support": list(rejection.SEED_SUPPORT), "Z": samplers["uniform"].normalizing_constant,
        "max_f": max_f, "argmax_x": argmax_x, "n_proposals": n_proposals, "seed": seed,
        "proposals": rows,
    }


def _rejection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="300000", help="proposals per sampler (default 300000)")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="random seed (default 0)")


def _rejection_handler(args: argparse.Namespace) -> int:
    numbers = rejection_numbers(parse_int("--n", args.n, 1), parse_seed(args.seed))
    if args.json:
        print_json(numbers)
        return 0
    print(f"target f(x) = {numbers['target']}")
    print(f"Z = integral of f = {numbers['Z']:.6f}    max f = {numbers['max_f']:.4f} at x = "
          f"{numbers['argmax_x']:.4f}")
    print(f"{numbers['n_proposals']:,} proposals per sampler, seed {numbers['seed']}; "
          "candidates outside [-3, 3] count as rejected\n")
    show_table(numbers["proposals"], [
        ("proposal", "proposal", "{}"), ("C", "C", "{:g}"),
        ("theoretical Z/C", "theoretical_acceptance", "{:.2%}"),
        ("observed", "acceptance_rate", "{:.2%}"), ("accepted", "n_accepted", "{:,}"),
        ("std. error", "standard_error", "{:.3%}"), ("z", "z_score", "{:+.2f}")])
    return 0


# --------------------------------------------------------------------------- lab tokens

TOKEN_EXAMPLE = {"tokens": ["cat", "dog", "fox"], "q": [0.60, 0.30, 0.10], "p": [0.30, 0.40, 0.30]}

# Proposals verified in one `verify_block` call; bounds memory for large --n.
_TOKEN_CHUNK = 1_000_000


def simulate_tokens(q, p, n: int, seed: int):
    """n proposals x ~ q at one fixed prefix, each verified by `verify_block` with γ = 1.

    Returns (accepted, replacement): LongTensor[V] counts of kept drafts and of corrections,
    by output token. One torch.Generator seeded with `seed` drives drafts and verification.
    """
    import torch

    from exactspec.sampling import verify_block

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
        result = verify_block(drafts, q_block, p_block, generator=generator)
        first = result.tokens[:, 0]  # [B], the kept draft or its correction
        kept = result.num_accepted == 1  # [B]
        accepted += torch.bincount(first[kept], minlength=vocab)
        replacement += torch.bincount(first[~kept], minlength=vocab)
    return accepted, replacement


def token_numbers(n: int = 10_000, seed: int = DEFAULT_SEED, example: dict = TOKEN_EXAMPLE) -> dict:
    """The seed's Part 5: acceptance min(1, p/q), residual max(p − q, 0), expected and simulated
    counts of accepted drafts and replacements, and the final frequencies against p."""
    import torch
    from scipy import stats

    q = torch.tensor(example["q"], dtype=torch.float64)  # [V]
    p = torch.tensor(example["p"], dtype=torch.float64)  # [V]
    residual = (p - q).clamp(min=0)  # [V]
    accepted, replacement = simulate_tokens(q, p, n, seed)
    total = accepted + replacement  # [V]
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


def _tokens_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="10000", help="draft proposals (default 10000)")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="random seed (default 0)")


def _by_token(numbers: dict, fields: list[str]) -> list[dict]:
    return [{"token": token, **{f: numbers[f][i] for f in fields}}
            for i, token in enumerate(numbers["tokens"])]


def _tokens_handler(args: argparse.Namespace) -> int:
    numbers = token_numbers(parse_int("--n", args.n, 1), parse_seed(args.seed))
    if args.json:
        print_json(numbers)
        return 0
    print("One fixed prefix: draft q, target p. Keep a draft x with probability min(1, p(x)/q(x));")
    print("on rejection draw the replacement from normalized max(p - q, 0).\n")
    show_table(_by_token(numbers, ["q", "p", "acceptance_probability", "residual",
                                   "residual_normalized"]), [
        ("token", "token", "{}"), ("draft q", "q", "{:.2f}"), ("target p", "p", "{:.2f}"),
        ("keep min(1, p/q)", "acceptance_probability", "{:.2f}"),
        ("residual max(p-q, 0)", "residual", "{:.2f}"),
        ("normalized", "residual_normalized", "{:.4f}")])
    print(f"\n{numbers['n']:,} proposals (seed {numbers['seed']}): {numbers['n_accepted']:,} accepted "
          f"drafts, {numbers['n_replaced']:,} replacements; alpha = sum min(p, q) = "
          f"{numbers['alpha']:.2f}\n")
    show_table(_by_token(numbers, ["expected_accepted", "accepted", "expected_replacement",
                                   "replacement", "total", "frequency", "p"]), [
        ("token", "token", "{}"), ("accepted (expected)", "expected_accepted", "{:,.0f}"),
        ("accepted", "accepted", "{:,}"),
        ("replacement (expected)", "expected_replacement", "{:,.0f}"),
        ("replacement", "replacement", "{:,}"), ("total", "total", "{:,}"),
        ("frequency", "frequency", "{:.3%}"), ("target p", "p", "{:.0%}")])
    print(f"\nchi-square of the totals against n*p: {numbers['chi_square']:.3f} "
          f"(p-value {numbers['chi_square_pvalue']:.3f})")
    return 0


# --------------------------------------------------------------------------- lab cost


def cost_numbers(alpha: float = 0.7, c: float = 0.1, max_gamma: int = 12) -> dict:
    """The seed's Part 8: E[N] and S(α, γ, c) for γ = 0..max_gamma, and the best γ."""
    from exactspec import costmodel

    rows = [{"gamma": g, "expected_tokens": costmodel.expected_tokens(alpha, g),
             "speedup": costmodel.speedup(alpha, g, c)} for g in range(max_gamma + 1)]
    gamma, best = costmodel.best_gamma(alpha, c, max_gamma)
    return {"alpha": alpha, "c": c, "max_gamma": max_gamma, "rows": rows,
            "best_gamma": gamma, "best_speedup": best}


def _cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alpha", default="0.7", help="per-token acceptance α in [0, 1] (default 0.7)")
    parser.add_argument("--c", default="0.1", help="draft-token cost per target pass (default 0.1)")
    parser.add_argument("--max-gamma", default="12", help="largest block length γ (default 12)")


def _cost_handler(args: argparse.Namespace) -> int:
    numbers = cost_numbers(parse_float("--alpha", args.alpha, 0.0, 1.0),
                           parse_float("--c", args.c, 0.0),
                           parse_int("--max-gamma", args.max_gamma, minimum=0))
    if args.json:
        print_json(numbers)
        return 0
    print(f"S(alpha, gamma, c) = sum_(k=0..gamma) alpha^k / (1 + c*gamma), "
          f"alpha = {numbers['alpha']:g}, c = {numbers['c']:g}\n")
    rows = [{**row, "best": "<- best" if row["gamma"] == numbers["best_gamma"] else ""}
            for row in numbers["rows"]]
    show_table(rows, [("gamma", "gamma", "{}"), ("E[N]", "expected_tokens", "{:.3f}"),
                      ("speedup S", "speedup", "{:.3f}x"), ("", "best", "{}")])
    print(f"\nbest gamma = {numbers['best_gamma']}: {numbers['best_speedup']:.2f}x "
          "(an analytical model, not a measurement)")
    return 0


# --------------------------------------------------------------------------- lab block


def random_block_example(vocab: int, gamma: int, seed: int):
    """A draft q[γ, V] and target p[γ+1, V] (float64), the same at every prefix."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(gamma + 1, vocab, generator=gen, dtype=torch.float64), -1)
    q = torch.softmax(1.5 * torch.randn(gamma, vocab, generator=gen, dtype=torch.float64), -1)
    return q, p


def exact_tokens_per_round(q, p, method: str) -> float:
    """E[emitted tokens per round] = Σ over every draft block of Π q_i(x_i) · Σ_k (k+1) P(τ = k)."""
    import itertools

    import torch

    from exactspec.sampling import stop_distribution

    gamma, vocab = q.shape
    blocks = torch.tensor(list(itertools.product(range(vocab), repeat=gamma)))  # [V^γ, γ]
    weight = q.gather(1, blocks.T).prod(0)  # [V^γ], Π q_i(x_i)
    law = stop_distribution(blocks, q.expand(len(blocks), -1, -1),
                            p.expand(len(blocks), -1, -1), method)  # [V^γ, γ+1]
    emitted = torch.arange(1, gamma + 2, dtype=law.dtype)  # [γ+1]
    return float((weight * (law * emitted).sum(1)).sum())


def simulated_tokens_per_round(q, p, method: str, n: int, seed: int) -> float:
    """The mean emitted tokens of n seeded rounds of verify_block."""
    import torch

    from exactspec.sampling import sample, verify_block

    gen = torch.Generator().manual_seed(seed)
    gamma, vocab = q.shape
    drafts = sample(q.expand(n, gamma, vocab), gen)  # [n, γ]
    result = verify_block(drafts, q.expand(n, -1, -1), p.expand(n, -1, -1), gen, method)
    return float(result.num_emitted.double().mean())


def block_numbers(vocab: int = 5, gamma: int = 4, n: int = 100_000,
                  seed: int = DEFAULT_SEED) -> dict:
    from exactspec.costmodel import acceptance_rate

    q, p = random_block_example(vocab, gamma, seed)
    rows = [{"method": method, "exact_tokens_per_round": exact_tokens_per_round(q, p, method),
             "simulated_tokens_per_round": simulated_tokens_per_round(q, p, method, n, seed)}
            for method in ("token", "block")]
    gain = rows[1]["exact_tokens_per_round"] / rows[0]["exact_tokens_per_round"] - 1
    return {"vocab": vocab, "gamma": gamma, "n": n, "seed": seed,
            "alpha_per_position": acceptance_rate(p[:-1], q).tolist(), "rows": rows,
            "block_gain": gain}


def _block_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--vocab", default="5", help="vocabulary size V (default 5)")
    parser.add_argument("--gamma", default="4", help="block length γ (default 4)")
    parser.add_argument("--n", default="100000", help="simulated rounds (default 100000)")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="seed of the example and the simulation")


def _block_handler(args: argparse.Namespace) -> int:
    vocab = parse_int("--vocab", args.vocab, minimum=2)
    gamma = parse_int("--gamma", args.gamma, minimum=1)
    if vocab ** gamma > 2_000_000:
        raise CliError(f"--vocab ** --gamma must be at most 2,000,000 blocks to enumerate, "
                       f"got {vocab}**{gamma}")
    numbers = block_numbers(vocab, gamma, parse_int("--n", args.n, minimum=1),
                            parse_seed(args.seed))
    if args.json:
        print_json(numbers)
        return 0
    print(f"A random draft q and target p, V = {vocab}, γ = {gamma}; per-position overlap "
          "α = " + ", ".join(f"{a:.2f}" for a in numbers["alpha_per_position"]) + ".")
    print("token: keep drafts one by one with min(1, p/q). block: judge the block jointly "
          "(Sun et al. 2024).\n")
    show_table(numbers["rows"], [("method", "method", "{}"),
                                 ("tokens/round (exact)", "exact_tokens_per_round", "{:.4f}"),
                                 (f"simulated ({numbers['n']:,} rounds)",
                                  "simulated_tokens_per_round", "{:.4f}")])
    print(f"\nblock verification emits {numbers['block_gain']:.2%} more tokens per round; "
          "both keep p exactly.")
    return 0


# --------------------------------------------------------------------------- figures


def _figures_handler(args: argparse.Namespace) -> int:
    from exactspec import figures

    seed = parse_seed(args.seed)
    started = time.perf_counter()
    try:
        paths = figures.write_figures(args.out, seed=seed)
    except OSError as err:
        raise CliError(f"--out: {err}") from None
    for path in paths.values():
        print(path)
    print(f"wrote {len(paths)} files in {time.perf_counter() - started:.1f} s")
    return 0


# --------------------------------------------------------------------------- registration


@dataclass(frozen=True)
class LabCommand:
    """One `exactspec lab NAME` subcommand; `--json` is added to every one."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


LAB_COMMANDS: list[LabCommand] = [
    LabCommand("rejection", "continuous rejection sampling of the seed's f (Parts 1-3)",
               _rejection_arguments, _rejection_handler),
    LabCommand("tokens", "the cat/dog/fox token example: accept, replace, recover p (Part 5)",
               _tokens_arguments, _tokens_handler),
    LabCommand("cost", "the analytical cost model S(alpha, gamma, c) and the best gamma (Part 8)",
               _cost_arguments, _cost_handler),
    LabCommand("block", "token-by-token vs joint block verification: tokens per round",
               _block_arguments, _block_handler),
]


def register(subparsers) -> None:
    """Add `lab` (with one subcommand per `LAB_COMMANDS` entry) and `figures`."""
    lab = subparsers.add_parser("lab", help="reproduce the seed's numbers: rejection, tokens, cost",
                                description="Reproduce the seed document's numbers.")
    lab_commands = lab.add_subparsers(dest="lab_command", required=True, metavar="EXPERIMENT")
    for command in LAB_COMMANDS:
        parser = lab_commands.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.set_defaults(func=command.handler)

    figures = subparsers.add_parser("figures", help="write figures 1-5 (PNG) and numbers.json",
                                    description="Write figures 1-5 as PNG files and numbers.json.")
    figures.add_argument("--out", default="figures", help="output folder (default ./figures)")
    figures.add_argument("--seed", default=str(DEFAULT_SEED), help="random seed (default 0)")
    figures.set_defaults(func=_figures_handler)
