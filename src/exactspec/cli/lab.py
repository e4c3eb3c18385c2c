"""`exactspec lab ...` and `exactspec figures`: the reference's numbers, run from this project's code.

    exactspec lab rejection [--n 300000] [--seed S] [--json]   the continuous sampler
    exactspec lab tokens    [--n 10000]  [--seed S] [--json]   cat / dog / fox
    exactspec lab cost [--alpha 0.7] [--c 0.1] [--max-gamma 12] [--json]   the cost model
    exactspec lab block [--vocab 5] [--gamma 4] [--n 100000] [--seed S] [--json]   block verification
    exactspec figures --out DIR [--seed S]                     figures 1–5 and numbers.json

Each lab command is a `LabCommand` in `LAB_COMMANDS`: a name, its arguments, and a handler.
Add one by appending an entry. The numbers come from `exactspec.lab.experiments`; the handlers only check input and print.
Options arrive as text and are checked here, so bad input is one line naming the option.
Heavy imports (NumPy, SciPy, torch, Matplotlib) happen inside the functions that need them.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Callable

from exactspec.cli.common import CliError, parse_float, parse_int, print_json, print_table

DEFAULT_SEED = 0  # the same as exactspec.lab.experiments.DEFAULT_SEED, without importing torch


# --------------------------------------------------------------------------- lab rejection


def _rejection_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="300000", help="proposals per sampler (default 300000)")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="random seed (default 0)")


def _rejection_handler(args: argparse.Namespace) -> int:
    from exactspec.lab.experiments import rejection_numbers

    numbers = rejection_numbers(parse_int("--n", args.n, 1), parse_int("--seed", args.seed, minimum=0))
    if args.json:
        print_json(numbers)
        return 0
    print(f"target f(x) = {numbers['target']}")
    print(f"Z = integral of f = {numbers['Z']:.6f}    max f = {numbers['max_f']:.4f} at x = "
          f"{numbers['argmax_x']:.4f}")
    print(f"{numbers['n_proposals']:,} proposals per sampler, seed {numbers['seed']}; "
          "candidates outside [-3, 3] count as rejected\n")
    print_table(numbers["proposals"], [
        ("proposal", "proposal", "{}"), ("C", "C", "{:g}"),
        ("theoretical Z/C", "theoretical_acceptance", "{:.2%}"),
        ("observed", "acceptance_rate", "{:.2%}"), ("accepted", "n_accepted", "{:,}"),
        ("std. error", "standard_error", "{:.3%}"), ("z", "z_score", "{:+.2f}")])
    return 0


# --------------------------------------------------------------------------- lab tokens

def _tokens_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", default="10000", help="draft proposals (default 10000)")
    parser.add_argument("--seed", default=str(DEFAULT_SEED), help="random seed (default 0)")


def _by_token(numbers: dict, fields: list[str]) -> list[dict]:
    return [{"token": token, **{f: numbers[f][i] for f in fields}}
            for i, token in enumerate(numbers["tokens"])]


def _tokens_handler(args: argparse.Namespace) -> int:
    from exactspec.lab.experiments import token_numbers

    numbers = token_numbers(parse_int("--n", args.n, 1), parse_int("--seed", args.seed, minimum=0))
    if args.json:
        print_json(numbers)
        return 0
    print("One fixed prefix: draft q, target p. Keep a draft x with probability min(1, p(x)/q(x));")
    print("on rejection draw the replacement from normalized max(p - q, 0).\n")
    print_table(_by_token(numbers, ["q", "p", "acceptance_probability", "residual",
                                   "residual_normalized"]), [
        ("token", "token", "{}"), ("draft q", "q", "{:.2f}"), ("target p", "p", "{:.2f}"),
        ("keep min(1, p/q)", "acceptance_probability", "{:.2f}"),
        ("residual max(p-q, 0)", "residual", "{:.2f}"),
        ("normalized", "residual_normalized", "{:.4f}")])
    print(f"\n{numbers['n']:,} proposals (seed {numbers['seed']}): {numbers['n_accepted']:,} accepted "
          f"drafts, {numbers['n_replaced']:,} replacements; alpha = sum min(p, q) = "
          f"{numbers['alpha']:.2f}\n")
    print_table(_by_token(numbers, ["expected_accepted", "accepted", "expected_replacement",
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


def _cost_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alpha", default="0.7", help="per-token acceptance α in [0, 1] (default 0.7)")
    parser.add_argument("--c", default="0.1", help="draft-token cost per target pass (default 0.1)")
    parser.add_argument("--max-gamma", default="12", help="largest block length γ (default 12)")


def _cost_handler(args: argparse.Namespace) -> int:
    from exactspec.lab.experiments import cost_numbers

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
    print_table(rows, [("gamma", "gamma", "{}"), ("E[N]", "expected_tokens", "{:.3f}"),
                      ("speedup S", "speedup", "{:.3f}x"), ("", "best", "{}")])
    print(f"\nbest gamma = {numbers['best_gamma']}: {numbers['best_speedup']:.2f}x "
          "(an analytical model, not a measurement)")
    return 0


# --------------------------------------------------------------------------- lab block


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
    from exactspec.lab.experiments import block_numbers

    numbers = block_numbers(vocab, gamma, parse_int("--n", args.n, minimum=1),
                            parse_int("--seed", args.seed, minimum=0))
    if args.json:
        print_json(numbers)
        return 0
    print(f"A random draft q and target p, V = {vocab}, γ = {gamma}; per-position overlap "
          "α = " + ", ".join(f"{a:.2f}" for a in numbers["alpha_per_position"]) + ".")
    print("token: keep drafts one by one with min(1, p/q). block: judge the block jointly "
          "(Sun et al. 2024).\n")
    print_table(numbers["rows"], [("verify", "verify", "{}"),
                                 ("tokens/round (exact)", "exact_tokens_per_round", "{:.4f}"),
                                 (f"simulated ({numbers['n']:,} rounds)",
                                  "simulated_tokens_per_round", "{:.4f}")])
    print(f"\nblock verification emits {numbers['block_gain']:.2%} more tokens per round; "
          "both keep p exactly.")
    return 0


# --------------------------------------------------------------------------- figures


def _figures_handler(args: argparse.Namespace) -> int:
    from exactspec.lab import figures

    seed = parse_int("--seed", args.seed, minimum=0)
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
    LabCommand("rejection", "continuous rejection sampling of the reference's f",
               _rejection_arguments, _rejection_handler),
    LabCommand("tokens", "the cat/dog/fox token example: accept, replace, recover p",
               _tokens_arguments, _tokens_handler),
    LabCommand("cost", "the analytical cost model S(alpha, gamma, c) and the best gamma",
               _cost_arguments, _cost_handler),
    LabCommand("block", "token-by-token vs joint block verification: tokens per round",
               _block_arguments, _block_handler),
]


def register(subparsers) -> None:
    """Add `lab` (with one subcommand per `LAB_COMMANDS` entry) and `figures`."""
    lab = subparsers.add_parser("lab", help="reproduce the reference's numbers: rejection, tokens, cost",
                                description="Reproduce the reference document's numbers.")
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
