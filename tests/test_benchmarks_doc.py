"""scripts/benchmarks_doc.py on JSON files that the benchmark's own code wrote (tiny models, fake
cost-model timings): one table line per result row, its cells the row's fields, and what the
JSON does not record (date, command) said as missing."""
import subprocess
import sys
from pathlib import Path

import pytest

from exactspec.bench.config import BenchConfig, BenchPrompt
from exactspec.bench.report import write_json
from exactspec.bench.run import run_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "benchmarks_doc.py"
PROMPTS = [BenchPrompt("a", "open", "w1 w2 w3"), BenchPrompt("b", "grounded", "w4 w5 w6 w4 w5 w6 w4 w5")]
TIMINGS = {  # fake cost-model inputs (seconds): target passes over 1..9 tokens, the draft per token
    "context_tokens": 20,
    "target": [{"tokens": n, "seconds": 0.040 + 0.005 * (n - 1)} for n in range(1, 10)],
    "drafts": {"ngram": {"seconds_per_token": 0.0001, "measured_as": "fake"}},
}


def tiny_target():
    import torch
    from conftest import make_tiny_llama, make_tiny_tokenizer
    from exactspec.models import LoadedModel

    return {"tiny-target": LoadedModel(make_tiny_llama(seed=0), make_tiny_tokenizer(), "tiny-target",
                                       torch.float32, torch.device("cpu"))}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60)


def cell(value, fmt: str) -> str:
    """A table cell as the script writes it: the value formatted, or a dash for null."""
    return "–" if value is None else fmt.format(value)


def table_lines(markdown: str) -> list[list[str]]:
    """The cells of every table line after the header and its rule."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[1].startswith("| ---")
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


@pytest.fixture(scope="module")
def result_file(tmp_path_factory):
    config = BenchConfig(target="tiny-target", drafts=["ngram"], gammas=[2, "auto"],
                         temperatures=[0.0, 1.0], verify=["block"], prompts=list(PROMPTS),
                         max_new_tokens=4, repeats=1, warmup=0, peers=False)
    result = run_benchmark(config, models=tiny_target(), timings=TIMINGS, log=None)
    path = tmp_path_factory.mktemp("bench") / "result.json"
    write_json(result, path)
    return path, result


def test_one_table_line_per_row_with_its_fields(result_file):
    path, result = result_file
    done = run_script(str(path), "--date", "2026-12-06", "--command", "exactspec bench --no-peers")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if line.startswith("| T |"))
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    cells = table_lines(done.stdout)
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 3  # (T 0, 1) × (open, grounded) × (plain, ngram γ 2, ngram γ auto)
    assert len(cells) == len(rows)
    # grouped by (T, kind) as the bench prints them; within a group, the file's order
    expected = sorted(rows, key=lambda r: ([0.0, 1.0].index(r["temperature"]),
                                           ["open", "grounded"].index(r["prompts"])))
    for line, row in zip(cells, expected):
        got = dict(zip(columns, line))
        assert got["T"] == f"{row['temperature']:g}"
        assert got["prompts"] == row["prompts"]
        assert got["method"] == row["method"]
        assert got["draft"] == cell(row["draft"], "{}")
        assert got["γ"] == cell(row["gamma"], "{}")
        assert got["tok/s"] == cell(row["tokens_per_s"], "{:.1f}")
        assert got["× plain"] == cell(row["speedup_vs_autoregressive"], "{:.2f}")
        assert got["acc. rate"] == cell(row["acceptance_rate"], "{:.3f}")
        assert got["tok/round"] == cell(row["tokens_per_round"], "{:.2f}")
        assert got["of ceiling"] == f"{100 * row['share_of_ceiling']:.0f} %"
        if row["temperature"] == 0:  # greedy rows say whether they are plain decoding's tokens
            assert got["=plain"] == "yes"
    assert "pass@1" not in columns and "× llama.cpp" not in columns  # no such rows here
    assert "- Date: 2026-12-06" in done.stdout
    assert "- Ceiling: 4.50× at k = 9 (T(1) 40.0 ms, T(9) 80.0 ms)" in done.stdout  # TIMINGS
    assert "- Command: `exactspec bench --no-peers`" in done.stdout
    assert result["machine"]["cpu_model"] in done.stdout


def test_summary_a_line_per_kind_and_temperature_a_column_per_configuration(result_file):
    path, result = result_file
    done = run_script(str(path), "--summary")
    assert done.returncode == 0, done.stderr
    header = [c.strip() for c in done.stdout.splitlines()[0].strip("|").split("|")]
    assert header == ["prompts", "T", "llama.cpp plain tok/s", "exactspec plain", "lookup, γ 2",
                      "lookup, γ auto", "bound"]
    lines = table_lines(done.stdout)
    assert [(line[0], line[1]) for line in lines] == [("open", "0"), ("grounded", "0"),
                                                      ("open", "1"), ("grounded", "1")]
    for line in lines:
        got = dict(zip(header, line))
        rows = {(r["draft"], r["gamma"]): r for r in result["rows"]
                if (r["prompts"], f"{r['temperature']:g}") == (got["prompts"], got["T"])}
        assert got["exactspec plain"] == "1.00×"
        assert got["lookup, γ 2"].rstrip("†") == f"{rows[('ngram', 2)]['speedup_vs_autoregressive']:.2f}×"
        assert got["llama.cpp plain tok/s"] == "–"  # no llama.cpp rows here
        plain = rows[(None, None)]  # the bound: the prefill as it was, every decode step at 4.50×
        wall, first = plain["wall_seconds"], plain["time_to_first_token"]
        assert got["bound"] == f"{wall / (first + (wall - first) / 4.5):.2f}×"


def test_says_what_the_json_lacks(result_file):
    path, _ = result_file
    done = run_script(str(path), str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("Date: not recorded in the JSON") == 2
    assert "exactspec bench --target tiny-target --draft ngram --gammas 2,auto" in done.stdout
    assert "--no-peers" in done.stdout


def test_the_machine_line_names_a_llama_cpp_targets_threads(result_file, tmp_path):
    path, result = result_file
    assert result["machine"]["llama_cpp_threads"] is None  # a torch target
    assert "llama.cpp target on" not in run_script(str(path)).stdout
    other = tmp_path / "llama.json"
    write_json({**result, "machine": {**result["machine"], "llama_cpp_threads": 2}}, other)
    done = run_script(str(other))
    assert done.returncode == 0, done.stderr
    assert "torch" in done.stdout and "; llama.cpp target on 2 threads;" in done.stdout


@pytest.mark.parametrize("content, message", [
    (None, "cannot read the file"),
    ("not json", "not valid JSON"),
    ('{"config": {}}', "not a file from `exactspec bench --json`"),
])
def test_bad_input_one_line_error(content, message, tmp_path):
    path = tmp_path / "in.json"
    if content is not None:
        path.write_text(content)
    done = run_script(str(path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


def test_dates_once_or_once_per_file(result_file):
    path, _ = result_file
    done = run_script(str(path), str(path), "--date", "a", "--date", "b", "--date", "c")
    assert done.returncode == 2 and "--date is given 3 times for 2 files" in done.stderr


def test_batch_file_gives_its_batch_table(result_file, tmp_path):
    from exactspec.bench.batch import batch_throughput
    from exactspec.bench.run import load_models

    config = BenchConfig(target="tiny-target", drafts=["ngram"], gammas=[2], temperatures=[0.0],
                         verify=["block"], prompts=list(PROMPTS), max_new_tokens=4, repeats=1,
                         warmup=0, peers=False)
    target, drafts = load_models(config, tiny_target())
    rows = batch_throughput(target, drafts, config, [1, 2])
    path = tmp_path / "batch.json"  # shaped as `run_batch_benchmark`'s result: {config, machine, batch}
    write_json({"config": {**config.to_dict(), "batch_sizes": [1, 2]},
                "machine": result_file[1]["machine"], "batch": rows}, path)
    done = run_script(str(path))
    assert done.returncode == 0, done.stderr
    cells = table_lines(done.stdout)
    assert [(line[0], line[2], line[6]) for line in cells] == [
        (str(r["batch_size"]), r["method"], f"{r['tokens_per_s']:.1f}") for r in rows]
    assert "--batch-sizes 1,2" in done.stdout
