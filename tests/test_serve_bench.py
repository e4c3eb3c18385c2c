"""`exactspec serve-bench` on the tiny test models: two real servers (subprocesses on 127.0.0.1,
port 0), driven by the real `openai` client with tiny settings. No timing thresholds."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from exactspec.cli import main  # noqa: E402
from exactspec.serve.bench import Mode, RequestTiming, _percentile, summarize  # noqa: E402
from test_cli_generate import tiny_folders  # noqa: E402,F401  (the module-scoped fixture)

TINY_PROMPTS = ["w3 w7 w1 w9", "w5 w9 w5 w9 w5 w9", "w8"]


def test_serve_bench_json_on_tiny_models(tiny_folders, capsys, monkeypatch):  # noqa: F811
    import exactspec.serve.bench as bench

    monkeypatch.setattr(bench, "DEFAULT_PROMPTS", TINY_PROMPTS)
    target, _ = tiny_folders
    code = main(["serve-bench", "--target", target, "--concurrency", "1,2", "--requests-per-level", "2",
                 "--max-tokens", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    levels = result["levels"]
    assert [(lv["concurrency"], lv["mode"]) for lv in levels] == [
        (1, "drafting"), (1, "plain"), (2, "drafting"), (2, "plain")]
    for level in levels:
        assert level["requests"] == 2 * level["concurrency"]
        assert 0 < level["completion_tokens"] <= 4 * level["requests"]
        assert level["total_tokens_per_s"] > 0 and level["per_request_tokens_per_s"] > 0
        assert 0 < level["ttft_p50_s"] <= level["ttft_p95_s"]
    assert [lv["vs_plain"] for lv in levels if lv["mode"] == "plain"] == [1.0, 1.0]
    assert levels[0]["draft"] == "auto" and levels[0]["gamma"] == "auto" and levels[1]["draft"] == "none"
    # greedy: every request of a prompt gave the same text, with drafting and without
    assert result["greedy_agree"] == {"prompts": 3, "identical": 3}


def test_serve_bench_errors_are_one_line(tiny_folders, capsys):  # noqa: F811
    target, _ = tiny_folders
    code = main(["serve-bench", "--target", target, "--draft", "no-such-model", "--concurrency", "1",
                 "--requests-per-level", "1", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "could not start" in err and "no-such-model" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["serve-bench", "--concurrency", "1,x"]) == 2
    assert "--concurrency must be a positive integer, got x" in capsys.readouterr().err


def test_summary_medians_percentiles_and_table(capsys):
    from exactspec.cli.serve import print_serve_bench

    assert _percentile([], 50) is None
    assert _percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert _percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    runs = [([RequestTiming(0, 0.1, 2.0, 10, "a"), RequestTiming(1, 0.3, 1.0, 4, "b")], 2.0),
            ([RequestTiming(0, 0.2, 1.0, 10, "a"), RequestTiming(1, None, 1.0, 0, "")], 1.0)]
    level = summarize(Mode("plain", "none", "auto"), 2, runs)
    assert level.requests == 4 and level.completion_tokens == 24
    assert level.runs_total_tokens_per_s == [7.0, 10.0] and level.total_tokens_per_s == 8.5
    assert level.per_request_tokens_per_s == 4.5  # median of 5, 4, 10, 0
    assert level.ttft_p50_s == pytest.approx(0.2)
    levels = [{**vars(level), "vs_plain": 1.0}]
    print_serve_bench({"settings": dict(target="t", draft="none", gamma="auto", max_tokens=4,
                                        temperature=0.0, repeats=2, cpus=2,
                                        load_average_1min={"start": 0.5, "end": 1.5}),
                       "levels": levels, "greedy_agree": {"prompts": 2, "identical": 2}})
    out = capsys.readouterr().out
    assert "total tok/s" in out and "TTFT p95 s" in out and "8.5" in out and "2 of 2 prompts" in out
