"""`exactspec generate` end to end on tiny models saved as local folders."""
import json

import pytest

from conftest import make_tiny_llama, make_tiny_tokenizer
from exactspec.cli import main


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A target folder and a draft folder, each with a tiny model and the tiny tokenizer."""
    folders = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        folder = tmp_path_factory.mktemp(name)
        make_tiny_llama(seed, num_layers=layers).save_pretrained(folder)
        make_tiny_tokenizer().save_pretrained(folder)
        folders.append(str(folder))
    return folders


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("draft", ["model", "ngram", "none"])
def test_generate_json(tiny_folders, capsys, draft):
    target, draft_folder = tiny_folders
    draft_arg = draft_folder if draft == "model" else draft
    code, out, _ = run(capsys, "generate", "w3 w7 w3 w7", "--target", target, "--draft", draft_arg,
                       "--max-new-tokens", "12", "--seed", "1", "--no-chat", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["stats"]["output_tokens"] == len(result["token_ids"]) <= 12
    assert set(result) >= {"target", "draft", "gamma", "text", "token_ids", "stats"}


def test_generate_greedy_table_and_stream_match_plain(tiny_folders, capsys):
    target, draft = tiny_folders
    common = ["--target", target, "--max-new-tokens", "10", "--temperature", "0", "--chat"]
    _, plain, _ = run(capsys, "generate", "w5", "--draft", "none", "--json", *common)
    _, spec, _ = run(capsys, "generate", "w5", "--draft", draft, "--json", *common)
    assert json.loads(plain)["token_ids"] == json.loads(spec)["token_ids"]
    code, out, _ = run(capsys, "generate", "w5", "--draft", draft, "--stream", *common)
    assert code == 0
    assert json.loads(spec)["text"] in out and "acceptance_rate" in out


@pytest.mark.parametrize("args, message", [
    (["--gamma", "0"], r"--gamma must be in \[1, 32\], got 0"),
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\], got 1.5"),
    (["--temperature", "-1"], r"--temperature must be >= 0, got -1"),
    (["--target", "no-such-model"], r"unknown model 'no-such-model'"),
])
def test_generate_bad_input_is_one_line(tiny_folders, capsys, args, message):
    import re

    code, out, err = run(capsys, "generate", "w1", "--draft", "ngram", *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_generate_empty_prompt(tiny_folders, capsys):
    code, _, err = run(capsys, "generate", "  ", "--target", tiny_folders[0], "--draft", "none")
    assert code == 2 and "the prompt is empty" in err


def test_generate_batch_of_prompts(tiny_folders, capsys, tmp_path):
    target, draft = tiny_folders
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w4"}\n\n{"prompt": "w5"}\n')
    common = ["--target", target, "--max-new-tokens", "8", "--temperature", "0", "--no-chat",
              "--json"]
    _, out, _ = run(capsys, "generate", "w9 w9", "--prompts", str(prompts), "--draft", draft,
                    *common)
    batch = json.loads(out)
    assert [r["prompt"] for r in batch["results"]] == ["w9 w9", "w1 w2 w3 w4", "w5"]
    for result in batch["results"]:  # each row as it is when decoded alone
        _, alone, _ = run(capsys, "generate", result["prompt"], "--draft", "none", *common)
        assert json.loads(alone)["token_ids"] == result["token_ids"]
    code, table, _ = run(capsys, "generate", "w1", "w2", "--draft", "ngram", *common[:-1])
    assert code == 0 and "[1]" in table and "batch" in table


@pytest.mark.parametrize("content, message", [
    ("not json\n", r"line 1: not valid JSON"),
    ('{"text": "x"}\n', r'line 1: expected an object with a non-empty "prompt" string'),
    ("\n", r"has no prompts"),
])
def test_generate_bad_prompts_file(tiny_folders, capsys, tmp_path, content, message):
    import re

    path = tmp_path / "p.jsonl"
    path.write_text(content)
    code, _, err = run(capsys, "generate", "--prompts", str(path), "--target", tiny_folders[0])
    assert code == 2 and re.search(message, err), err


def test_generate_needs_a_prompt(tiny_folders, capsys):
    code, _, err = run(capsys, "generate", "--target", tiny_folders[0])
    assert code == 2 and "give a prompt" in err


def test_the_demo_says_why_a_run_lost_by_where_its_rounds_went():
    """A loss with mostly plain steps: drafting did not pay and the controller stepped aside; a
    loss with mostly drafting rounds: they made tokens per pass but cost more than plain steps."""
    from types import SimpleNamespace

    from exactspec.cli.generate import _why

    stats = SimpleNamespace(tokens_per_round=4.23, acceptance_rate=0.9)
    run = lambda rounds: SimpleNamespace(rounds_by_source=rounds, stats=stats)  # noqa: E731
    stepped_aside = _why(run({"plain": 31, "model": 3}), 0.93)
    drafted = _why(run({"model": 11, "plain": 1}), 0.90)
    assert stepped_aside.startswith("lost 7%: drafting did not pay")
    assert stepped_aside.endswith("(rounds: plain 31, model 3)")
    assert drafted == ("lost 10%: the drafting rounds made 4.23 tokens per target pass but cost "
                       "more than the plain steps they replaced (rounds: model 11, plain 1)")


def test_generate_trace_writes_one_line_per_round_with_its_reason(tiny_folders, capsys, tmp_path):
    """--trace FILE: one JSON line a round; its drafts and kept drafts add up to the stats, and
    every round says why its γ was chosen (a plain round too)."""
    target, draft = tiny_folders
    trace = tmp_path / "trace.jsonl"
    code, out, _ = run(capsys, "generate", "w3 w7 w3 w7 w3 w7", "--target", target, "--draft", draft,
                       "--max-new-tokens", "24", "--seed", "1", "--no-chat", "--json", "--trace", str(trace))
    stats = json.loads(out)["stats"]
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert code == 0 and len(lines) == stats["rounds"] and [line["round"] for line in lines] == \
        list(range(1, len(lines) + 1))
    assert sum(line["drafted"] for line in lines) == stats["drafted_tokens"]
    assert sum(line["kept"] for line in lines) == stats["accepted_drafts"]
    assert all(line["reason"] and line["pass_seconds"] > 0 for line in lines)
    assert {line["source"] for line in lines if line["drafted"] == 0} <= {"plain"}
    assert lines[0]["reason"].startswith("first round of")
    code, _, err = run(capsys, "generate", "w3", "--target", target, "--trace", str(tmp_path / "no" / "t"))
    assert code == 2 and "error: --trace: " in err.strip().splitlines()[-1]
