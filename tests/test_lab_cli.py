"""`exactspec lab rejection | tokens | cost`: tables, --json, and one-line errors."""
import json
import math
import re
import subprocess
import sys

import pytest

from exactspec import cli
from exactspec.cli import lab as cli_lab
from exactspec.lab import experiments


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


# --------------------------------------------------------------------------- lab rejection


def test_lab_rejection_json(capsys):
    numbers = run_json(capsys, "lab", "rejection", "--n", "40000", "--seed", "3")
    assert abs(numbers["Z"] - 5.73807) < 1e-4
    assert numbers["max_f"] == pytest.approx(3.696, abs=5e-4)
    assert (numbers["n_proposals"], numbers["seed"]) == (40000, 3)
    rows = {row["name"]: row for row in numbers["proposals"]}
    assert rows["uniform"]["C"] == 25 and rows["gaussian"]["C"] == 11
    assert round(100 * rows["uniform"]["theoretical_acceptance"], 2) == 22.95
    assert round(100 * rows["gaussian"]["theoretical_acceptance"], 2) == 52.16
    for row in rows.values():
        assert row["n_proposed"] == 40000
        assert row["acceptance_rate"] == row["n_accepted"] / 40000
        assert abs(row["z_score"]) < 4


def test_lab_rejection_table_is_seeded(capsys):
    code, out, _ = run_cli(capsys, "lab", "rejection", "--n", "5000", "--seed", "9")
    assert code == 0
    for text in ("Z = integral of f = 5.738073", "max f = 3.6958", "Uniform on [-3, 3]",
                 "Standard Gaussian", "22.95%", "52.16%", "theoretical Z/C", "observed"):
        assert text in out
    assert run_cli(capsys, "lab", "rejection", "--n", "5000", "--seed", "9")[1] == out


# --------------------------------------------------------------------------- lab tokens


def test_lab_tokens_json_recovers_p(capsys):
    numbers = run_json(capsys, "lab", "tokens", "--seed", "4")
    n = numbers["n"]
    assert n == 10_000 and numbers["tokens"] == ["cat", "dog", "fox"]
    assert numbers["acceptance_probability"] == pytest.approx([0.5, 1.0, 1.0])
    assert numbers["residual"] == pytest.approx([0.0, 0.1, 0.2])
    assert numbers["residual_normalized"] == pytest.approx([0, 1 / 3, 2 / 3])
    assert numbers["expected_accepted"] == pytest.approx([3000, 3000, 1000])
    assert numbers["expected_replacement"] == pytest.approx([0, 1000, 2000])
    assert numbers["alpha"] == pytest.approx(0.7)
    assert numbers["replacement"][0] == 0  # cat is never a replacement: q(cat) > p(cat)
    assert numbers["n_accepted"] + numbers["n_replaced"] == n
    assert sum(numbers["total"]) == n
    for freq, p in zip(numbers["frequency"], numbers["p"]):
        assert abs(freq - p) < 4 * math.sqrt(p * (1 - p) / n)
    # Accepted drafts alone follow n·min(p, q): binomial counts within 4 standard errors.
    for count, expected in zip(numbers["accepted"], numbers["expected_accepted"]):
        assert abs(count - expected) < 4 * math.sqrt(expected * (1 - expected / n))


def test_lab_tokens_table(capsys):
    code, out, _ = run_cli(capsys, "lab", "tokens", "--n", "2000")
    assert code == 0
    for text in ("cat", "dog", "fox", "min(1, p/q)", "max(p-q, 0)", "0.3333", "replacement",
                 "frequency", "2,000 proposals", "chi-square"):
        assert text in out


def test_lab_tokens_chunks_large_runs(monkeypatch):
    monkeypatch.setattr(experiments, "_TOKEN_CHUNK", 700)
    numbers = experiments.token_numbers(2000, seed=1)
    assert sum(numbers["total"]) == 2000


# --------------------------------------------------------------------------- lab cost


def test_lab_cost_default_peaks_at_gamma_4(capsys):
    numbers = run_json(capsys, "lab", "cost")
    assert (numbers["alpha"], numbers["c"], numbers["max_gamma"]) == (0.7, 0.1, 12)
    assert numbers["best_gamma"] == 4
    assert round(numbers["best_speedup"], 2) == 1.98
    assert [row["gamma"] for row in numbers["rows"]] == list(range(13))
    assert numbers["rows"][0] == {"gamma": 0, "expected_tokens": 1.0, "speedup": 1.0}


def test_lab_cost_table_and_options(capsys):
    code, out, _ = run_cli(capsys, "lab", "cost", "--alpha", "0.9", "--c", "0.1",
                           "--max-gamma", "16")
    assert code == 0
    assert "<- best" in out and "best gamma = 10: 3.43x" in out


# --------------------------------------------------------------------------- bad input


def test_lab_block_exact_and_simulated_agree(capsys):
    """Block verification emits more tokens per round than token verification (exactly
    enumerated), and the seeded simulations land within 5 standard errors of the exact values."""
    numbers = run_json(capsys, "lab", "block", "--n", "40000", "--seed", "2")
    token, block = numbers["rows"]
    assert (token["verify"], block["verify"]) == ("token", "block")
    assert block["exact_tokens_per_round"] > token["exact_tokens_per_round"]
    assert numbers["block_gain"] > 0.01
    for row in numbers["rows"]:  # emitted tokens per round lie in [1, γ+1]: sd <= γ/2
        standard_error = (numbers["gamma"] / 2) / math.sqrt(numbers["n"])
        assert abs(row["simulated_tokens_per_round"] - row["exact_tokens_per_round"]) < 5 * standard_error


def test_lab_block_table(capsys):
    code, out, _ = run_cli(capsys, "lab", "block", "--n", "2000")
    assert code == 0 and "tokens/round (exact)" in out and "more tokens per round" in out


@pytest.mark.parametrize("argv, message", [
    (["lab", "rejection", "--n", "-5"], r"--n must be a positive integer, got -5"),
    (["lab", "rejection", "--n", "0"], r"--n must be a positive integer, got 0"),
    (["lab", "rejection", "--n", "lots"], r"--n must be a positive integer, got lots"),
    (["lab", "rejection", "--seed", "-1"], r"--seed must be an integer >= 0, got -1"),
    (["lab", "tokens", "--n", "-5"], r"--n must be a positive integer, got -5"),
    (["lab", "tokens", "--n", "1.5"], r"--n must be a positive integer, got 1.5"),
    (["lab", "cost", "--alpha", "1.5"], r"--alpha must be a number in \[0, 1\], got 1.5"),
    (["lab", "cost", "--alpha", "nan"], r"--alpha must be a number in \[0, 1\], got nan"),
    (["lab", "cost", "--c", "-0.1"], r"--c must be a number >= 0, got -0.1"),
    (["lab", "cost", "--c", "inf"], r"--c must be a number >= 0, got inf"),
    (["lab", "cost", "--max-gamma", "-1"], r"--max-gamma must be an integer >= 0, got -1"),
    (["lab", "block", "--gamma", "0"], r"--gamma must be a positive integer, got 0"),
    (["lab", "block", "--vocab", "1"], r"--vocab must be an integer >= 2, got 1"),
    (["lab", "block", "--vocab", "50", "--gamma", "5"], r"at most 2,000,000 blocks"),
])
def test_bad_input_is_one_line(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"exactspec {argv[0]}: error: ")
    assert re.search(message, err), err


def test_bad_input_from_the_command_line_has_no_traceback():
    result = subprocess.run([sys.executable, "-m", "exactspec", "lab", "cost", "--alpha", "1.5"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "exactspec lab: error: --alpha must be a number in [0, 1], got 1.5\n"


def test_json_from_the_command_line_parses():
    result = subprocess.run([sys.executable, "-m", "exactspec", "lab", "cost", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["best_gamma"] == 4


# --------------------------------------------------------------------------- extension


def test_a_lab_command_is_one_entry(monkeypatch, capsys):
    def add_arguments(parser):
        parser.add_argument("--k", default="2")

    def handler(args):
        print(f"k={args.k} json={args.json}")
        return 0

    extra = cli_lab.LabCommand("echo", "test command", add_arguments, handler)
    monkeypatch.setattr(cli_lab, "LAB_COMMANDS", [*cli_lab.LAB_COMMANDS, extra])
    code, out, _ = run_cli(capsys, "lab", "echo", "--k", "5", "--json")
    assert code == 0 and out == "k=5 json=True\n"
