"""The benchmark harness on tiny random-weight models: every field, JSON round trip, the cost model
from (injected) measured timings, and one-line errors for bad options. No timing thresholds."""
import json
import math
import statistics

import pytest

from exactspec import costmodel
from exactspec.bench.config import (BenchConfig, BenchPrompt, RunSpec, auto_model_spec, default_drafts,
                                    parse_gammas, parse_verify, plan)
from exactspec.bench.curves import build_costmodel
from exactspec.bench.plot import plot_costmodel
from exactspec.bench.report import write_json
from exactspec.bench.run import load_models, run_benchmark
from exactspec.bench.timing import measure_timings
from exactspec.cli import main
from exactspec.cli.bench import load_bench_prompts

TINY_PROMPTS = [
    BenchPrompt("a", "open", "w1 w2 w3"),
    BenchPrompt("b", "grounded", "w4 w5 w6 w4 w5 w6 w4 w5"),
]
ROW_FIELDS = {
    "method", "draft", "gamma", "verify", "temperature", "prompts", "n_prompts", "output_tokens",
    "wall_seconds", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ms_per_token",
    "time_to_first_token", "accepted_drafts", "drafted_tokens", "corrections", "bonus_tokens",
    "rounds", "target_calls", "draft_calls", "acceptance_rate", "alpha", "tokens_per_round",
    "ms_per_round", "speedup_vs_autoregressive", "speedup_vs_hf_generate", "speedup_vs_llamacpp",
    "decode_tokens_per_s",
    "decode_speedup_vs_autoregressive",
    "matches_autoregressive", "peer_settings", "rounds_by_source", "mean_gamma",
    "generation_tokens", "generation_seconds", "grammar_share", "constraint_ms_per_token",
    "pass_tokens_per_s", "pass_decode_tokens_per_s", "share_of_ceiling",
}
# fake cost-model inputs (seconds): target passes over 1..9 tokens, and each draft per token
FAKE_TIMINGS = {
    "context_tokens": 20,
    "target": [{"tokens": n, "seconds": 0.040 + 0.005 * (n - 1)} for n in range(1, 10)],
    "drafts": {"tiny-draft": {"seconds_per_token": 0.010, "measured_as": "fake"},
               "ngram": {"seconds_per_token": 0.0001, "measured_as": "fake"}},
}


def tiny_models():
    """The tiny target, its bfloat16 copy (the auto draft's model draft) and a smaller draft, by
    spec."""
    import torch
    from conftest import make_tiny_llama, make_tiny_tokenizer
    from exactspec.models import LoadedModel

    tokenizer, cpu = make_tiny_tokenizer(), torch.device("cpu")
    return {"tiny-target": LoadedModel(make_tiny_llama(seed=0), tokenizer, "tiny-target",
                                       torch.float32, cpu),
            "tiny-target@bfloat16": LoadedModel(make_tiny_llama(seed=0, dtype=torch.bfloat16),
                                                tokenizer, "tiny-target", torch.bfloat16, cpu),
            "tiny-draft": LoadedModel(make_tiny_llama(seed=1, num_layers=1), tokenizer,
                                      "tiny-draft", torch.float32, cpu)}


def tiny_config(**overrides):
    settings = dict(target="tiny-target", drafts=["tiny-draft", "ngram", "auto"],
                    gammas=[2, "auto"],
                    temperatures=[0.0, 1.0], prompts=list(TINY_PROMPTS), max_new_tokens=6,
                    repeats=2, warmup=1, peers=True)
    settings.update(overrides)
    return BenchConfig(**settings)


@pytest.fixture(scope="module")
def tiny_result():
    """One small benchmark, shared by the tests that only read it: fixed γ and γ = auto, a model
    draft, the n-gram draft and the auto draft."""
    return run_benchmark(tiny_config(), models=tiny_models(), timings=FAKE_TIMINGS, log=None)


def test_every_configuration_and_field(tiny_result):
    rows = tiny_result["rows"]
    assert set(tiny_result) >= {"config", "machine", "rows", "costmodel"}
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert row["output_tokens"] == 6 * row["n_prompts"]  # EOS off: every method, same work
        assert row["tokens_per_s"] > 0 and row["wall_seconds"] > 0
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
        assert row["ms_per_token"] == pytest.approx(1e3 / row["tokens_per_s"])
        assert row["time_to_first_token"] is not None
        assert row["speedup_vs_autoregressive"] > 0 and row["speedup_vs_hf_generate"] > 0
        exact = row["method"] in ("autoregressive", "speculative")
        assert (row["rounds"] is not None) == exact
        if row["method"] == "speculative":
            assert row["accepted_drafts"] + row["corrections"] + row["bonus_tokens"] \
                == row["output_tokens"]
            assert row["tokens_per_round"] == pytest.approx(row["output_tokens"] / row["rounds"])
            if row["drafted_tokens"]:  # γ = auto may choose plain steps only
                assert 0 <= row["acceptance_rate"] <= 1
        if exact:  # rounds per way of drafting add up to the rounds
            assert sum(row["rounds_by_source"].values()) == row["rounds"]
            sources = {"autoregressive": {"plain"}, "ngram": {"ngram", "ngram-1", "plain"},
                       "tiny-draft": {"model", "plain"},
                       "auto": {"ngram", "ngram-1", "model", "plain"}}
            assert set(row["rounds_by_source"]) <= sources[row["draft"] or row["method"]]
            if isinstance(row["gamma"], int) and row["mean_gamma"] is not None:
                assert 0 < row["mean_gamma"] <= row["gamma"]
        else:
            assert row["rounds_by_source"] is None and row["mean_gamma"] is None
        # greedy: every method gives the target's own greedy tokens
        assert row["matches_autoregressive"] is (True if row["temperature"] == 0 else None), row
    keys = {(r["method"], r["draft"], r["gamma"], r["verify"], r["temperature"], r["prompts"])
            for r in rows}
    assert len(keys) == len(rows)
    for t in (0.0, 1.0):
        for kind in ("open", "grounded"):
            assert ("autoregressive", None, None, None, t, kind) in keys
            assert ("hf_generate", None, None, None, t, kind) in keys
            assert ("hf_assisted", "tiny-draft", "default", None, t, kind) in keys
            for draft in ("tiny-draft", "ngram", "auto"):
                for gamma in (2, "auto"):
                    for verify in ("block", "token"):
                        assert ("speculative", draft, gamma, verify, t, kind) in keys
            peers = {(r[1], r[2]) for r in keys if r[0] == "hf_assisted" and r[4:] == (t, kind)}
            assert peers == {("tiny-draft", 2), ("tiny-draft", "default"),
                             ("ngram", 2), ("ngram", 4), ("ngram", 10)}
    constant = next(r for r in rows if r["method"] == "hf_assisted" and r["gamma"] == 2
                    and r["draft"] == "tiny-draft")
    assert constant["peer_settings"]["num_assistant_tokens"] == 2
    assert constant["peer_settings"]["num_assistant_tokens_schedule"] == "constant"
    for lookup in (r for r in rows if r["method"] == "hf_assisted" and r["draft"] == "ngram"):
        assert lookup["peer_settings"] == {"prompt_lookup_num_tokens": lookup["gamma"],
                                           "max_matching_ngram_size": 2}  # Transformers' default
    machine = tiny_result["machine"]
    for key in ("cpu_model", "cpu_cores", "torch_version", "device"):
        assert machine[key]


def test_coupled_rows_are_plain_decoding_texts():
    """At T = 1 the coupled rule's rows emit plain decoding's tokens for every job ("=AR" yes),
    with every draft and γ; the table lists it among the rules."""
    config = tiny_config(verify=["coupled"], temperatures=[1.0], repeats=1, peers=False)
    rows = run_benchmark(config, models=tiny_models(), timings=FAKE_TIMINGS, log=None)["rows"]
    coupled = [r for r in rows if r["method"] == "speculative"]
    assert {r["verify"] for r in coupled} == {"coupled"} and len(coupled) == 12
    assert all(r["matches_autoregressive"] is True for r in coupled)
    assert parse_verify("coupled,block") == ["block", "coupled"]


def test_json_round_trips(tiny_result, tmp_path):
    path = tmp_path / "bench.json"
    write_json(tiny_result, path)
    assert json.loads(path.read_text()) == tiny_result
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]  # no temporary left behind


def test_costmodel_uses_measured_numbers(tiny_result):
    t_target = {item["tokens"]: item["seconds"] for item in FAKE_TIMINGS["target"]}
    curves = tiny_result["costmodel"]["curves"]
    assert {(c["temperature"], c["prompts"], c["draft"]) for c in curves} == {
        (t, k, d) for t in (0.0, 1.0) for k in ("open", "grounded") for d in ("tiny-draft", "ngram")}
    for curve in curves:
        rows = [r for r in tiny_result["rows"] if r["method"] == "speculative"
                and r["verify"] == "token" and r["gamma"] != "auto"
                and (r["temperature"], r["prompts"], r["draft"])
                == (curve["temperature"], curve["prompts"], curve["draft"])]
        accepted = sum(r["accepted_drafts"] for r in rows)
        alpha = accepted / (accepted + sum(r["corrections"] for r in rows))
        assert curve["alpha"] == pytest.approx(alpha)
        t_draft = FAKE_TIMINGS["drafts"][curve["draft"]]["seconds_per_token"]
        assert curve["c"] == pytest.approx(t_draft / 0.040)
        assert [p["gamma"] for p in curve["points"]] == list(range(1, 9))
        for p in curve["points"]:
            g = p["gamma"]
            assert p["predicted_speedup"] == pytest.approx(
                costmodel.speedup_measured(alpha, g, 0.040, t_target[g + 1], t_draft))
            assert p["predicted_ms_per_round"] == pytest.approx(1e3 * (g * t_draft + t_target[g + 1]))
            measured = next((r for r in rows if r["gamma"] == g), None)
            if measured is None:
                assert p["measured_speedup_token"] is None
            else:
                assert p["measured_speedup_token"] == measured["speedup_vs_autoregressive"]
                assert p["measured_decode_speedup_token"] == measured["decode_speedup_vs_autoregressive"]
                assert p["measured_over_predicted_token"] == pytest.approx(
                    measured["decode_speedup_vs_autoregressive"] / p["predicted_speedup"])
        best = max(curve["points"], key=lambda p: p["predicted_speedup"])
        assert curve["best_predicted_speedup"] == best["predicted_speedup"]


def test_summary_compares_lookup_and_gamma_auto(tiny_result):
    """Per (temperature, kind): the fastest n-gram/auto speculative row against the fastest
    Transformers prompt-lookup row, and every γ = auto row (with its speedup over plain)."""
    rows, summary = tiny_result["rows"], tiny_result["summary"]
    assert [(s["temperature"], s["prompts"]) for s in summary] == [
        (t, k) for t in (0.0, 1.0) for k in ("open", "grounded")]
    for item in summary:
        group = [r for r in rows if (r["temperature"], r["prompts"])
                 == (item["temperature"], item["prompts"])]
        ours = max((r for r in group if r["method"] == "speculative"
                    and r["draft"] in ("ngram", "auto")), key=lambda r: r["tokens_per_s"])
        peer = max((r for r in group if r["method"] == "hf_assisted" and r["draft"] == "ngram"),
                   key=lambda r: r["tokens_per_s"])
        assert item["best_lookup"]["tokens_per_s"] == ours["tokens_per_s"]
        assert (item["best_hf_lookup"]["draft"], item["best_hf_lookup"]["gamma"]) \
            == ("ngram", peer["gamma"])
        assert item["lookup_over_hf_lookup"] == pytest.approx(statistics.median(
            a / b for a, b in zip(ours["pass_tokens_per_s"], peer["pass_tokens_per_s"])))
        autos = [r for r in group if r["method"] == "speculative" and r["gamma"] == "auto"]
        assert [(a["draft"], a["verify"], a["speedup_vs_autoregressive"])
                for a in item["gamma_auto"]] == [
            (r["draft"], r["verify"], r["speedup_vs_autoregressive"]) for r in autos]
        assert len(autos) == 3 * 2  # three drafts, two rules
        assert item["gamma_sweep"] == []  # one fixed γ: no sweep


def test_speedups_pair_the_runs_of_each_pass():
    """A row's speedup is the median of its ratios to the other row pass by pass (they ran the
    same prompts seconds apart), not the ratio of two medians taken from different passes; rows
    without per-pass rates fall back to the ratio of their medians."""
    from exactspec.bench.report import add_speedups, paired_ratio

    def row(method, rates):
        return {"method": method, "temperature": 0.0, "prompts": "open", "tokens_per_s":
                statistics.median(rates), "pass_tokens_per_s": rates,
                "decode_tokens_per_s": statistics.median(rates), "pass_decode_tokens_per_s": rates}

    plain = row("autoregressive", [10.0, 20.0, 30.0])  # the machine's speed drifts between passes
    spec = row("speculative", [9.8, 40.0, 8.0])  # 0.98x, 2x, 0.27x the plain run beside it
    add_speedups([plain, spec])
    assert spec["speedup_vs_autoregressive"] == pytest.approx(0.98)  # medians' ratio: 0.49
    assert spec["decode_speedup_vs_autoregressive"] == pytest.approx(0.98)
    assert plain["speedup_vs_autoregressive"] == 1.0 and spec["speedup_vs_hf_generate"] is None
    assert paired_ratio({"tokens_per_s": 6.0}, {"tokens_per_s": 4.0}) == 1.5
    assert paired_ratio({**spec, "pass_tokens_per_s": [9.8, 40.0]}, plain) \
        == pytest.approx(9.8 / 20.0)  # passes that do not pair up: the ratio of the medians
    assert paired_ratio(None, plain) is None and paired_ratio(spec, None) is None


def test_gamma_sweep_compares_auto_with_the_best_fixed_gamma():
    """γ = auto against the fastest fixed γ of the same draft and rule, with a paired bootstrap
    interval over the generations: checked on rows made by hand, where the answer is known."""
    from exactspec.bench.summary import SWEEP_MIN_GENERATIONS, gamma_sweep

    def row(gamma, seconds, draft="d", verify="token"):
        n = len(seconds)
        return {"method": "speculative", "draft": draft, "verify": verify, "gamma": gamma,
                "tokens_per_s": 10 * n / sum(seconds), "mean_gamma": 3.0,
                "generation_tokens": [10] * n, "generation_seconds": list(seconds)}

    n = SWEEP_MIN_GENERATIONS
    times = [1.0 + 0.1 * i for i in range(n)]  # generations differ a lot; γ = 4 is 10 % faster
    group = [row(2, [2 * t for t in times]), row(4, [t / 1.1 for t in times]), row("auto", times),
             row(4, times, draft="other"), row("auto", times, draft="other"),  # one fixed γ only
             {"method": "autoregressive", "draft": None, "verify": None, "gamma": None,
              "tokens_per_s": 1.0}]
    (sweep,) = gamma_sweep(group)
    assert (sweep["draft"], sweep["verify"], sweep["best_gamma"], sweep["generations"]) \
        == ("d", "token", 4, n)
    assert sweep["auto_over_best"] == pytest.approx(1 / 1.1)
    assert sweep["interval"] == pytest.approx([1 / 1.1, 1 / 1.1])  # paired: the same every draw
    noisy = [row(4, [t * (1.3 if i % 2 else 0.7) / 1.1 for i, t in enumerate(times)]),
             row(2, [2 * t for t in times]), row("auto", times)]  # γ = 4 fast on half of them
    low, high = gamma_sweep(noisy)[0]["interval"]
    assert low < gamma_sweep(noisy)[0]["auto_over_best"] < high and high - low > 0.05
    assert gamma_sweep([row(4, times[:3]), row(2, times[:3]), row("auto", times[:3])]
                       )[0]["interval"] is None  # too few generations for an interval


def test_plan_rows():
    config = tiny_config(drafts=["m", "ngram", "auto"], gammas=[2, "auto"], verify=["block"],
                         temperatures=[0.0])
    assert plan(config) == [
        RunSpec("autoregressive", 0.0), RunSpec("hf_generate", 0.0),
        RunSpec("speculative", 0.0, "m", 2, "block"),
        RunSpec("speculative", 0.0, "m", "auto", "block"),
        RunSpec("hf_assisted", 0.0, "m", 2), RunSpec("hf_assisted", 0.0, "m", "default"),
        RunSpec("speculative", 0.0, "ngram", 2, "block"),
        RunSpec("speculative", 0.0, "ngram", "auto", "block"),
        RunSpec("hf_assisted", 0.0, "ngram", 2), RunSpec("hf_assisted", 0.0, "ngram", 4),
        RunSpec("hf_assisted", 0.0, "ngram", 10),
        RunSpec("speculative", 0.0, "auto", 2, "block"),
        RunSpec("speculative", 0.0, "auto", "auto", "block"),  # the auto draft: no peer rows
    ]
    only_auto = plan(tiny_config(drafts=["m", "ngram"], gammas=["auto"], verify=["token"],
                                 temperatures=[0.5]))
    assert [(s.method, s.draft, s.gamma) for s in only_auto] == [
        ("autoregressive", None, None), ("hf_generate", None, None),
        ("speculative", "m", "auto"), ("hf_assisted", "m", "default"),
        ("speculative", "ngram", "auto"), ("hf_assisted", "ngram", 4),
        ("hf_assisted", "ngram", 10)]
    assert RunSpec("speculative", 0.0, "auto", "auto", "block").label \
        == "speculative auto γ=auto block T=0"


def test_auto_draft_shares_the_bf16_model_loaded_once(monkeypatch):
    import exactspec.models
    from exactspec.drafters import AutoDrafter

    models, loads = tiny_models(), []

    def load(spec, device=None):
        loads.append(spec)
        return models[spec]

    monkeypatch.setattr(exactspec.models, "load_model", load)
    config = tiny_config(drafts=["tiny-target@bfloat16", "ngram", "auto", "auto:tiny-draft"])
    target, drafts = load_models(config)
    assert sorted(loads) == ["tiny-draft", "tiny-target", "tiny-target@bfloat16"]  # each once
    assert target is models["tiny-target"] and drafts["ngram"] == "ngram"
    assert isinstance(drafts["auto"], AutoDrafter)
    assert drafts["auto"].model.model is drafts["tiny-target@bfloat16"].model
    assert drafts["auto:tiny-draft"].model.model is models["tiny-draft"].model
    assert auto_model_spec("auto", "some-model@float16") == "some-model@bfloat16"
    assert auto_model_spec("auto:d@float32", "t") == "d@float32"
    for target in ("llamacpp:qwen2.5-coder-1.5b-instruct", "llamacpp:qwen2.5-coder-1.5b-instruct@invariant"):
        assert auto_model_spec("auto", target) == "llamacpp:qwen2.5-coder-0.5b-instruct"  # the pair's draft


@pytest.mark.parametrize("installed", [True, False])
def test_auto_draft_of_a_gguf_target_is_llama_cpp_when_installed(installed, monkeypatch):
    """A target loaded from a GGUF (the bundled model is) drafts with its own file through
    llama.cpp when the llamacpp extra is installed, else with its bfloat16 copy."""
    import exactspec.drafters

    monkeypatch.setattr(exactspec.drafters, "llamacpp_available", lambda: installed)
    for target in ("smollm2-135m-instruct", "/models/m.gguf@float32"):
        name = target.split("@")[0]
        assert auto_model_spec("auto", target) == ("llamacpp" if installed else f"{name}@bfloat16")
    assert ("llamacpp" in default_drafts()) == installed


def test_costmodel_by_hand():
    """Known α and timings give the reference's S(α, γ, c) where the block costs one target pass."""
    rows = [{"method": "speculative", "temperature": 0.8, "prompts": "open", "draft": "d",
             "gamma": 4, "verify": "token", "accepted_drafts": 70, "corrections": 30,
             "speedup_vs_autoregressive": 1.4, "decode_speedup_vs_autoregressive": 1.5,
             "tokens_per_round": 2.8, "ms_per_round": 50.0}]
    timings = {"context_tokens": 10, "target": [{"tokens": n, "seconds": 1.0} for n in range(1, 6)],
               "drafts": {"d": {"seconds_per_token": 0.1, "measured_as": "fake"}}}
    curve = build_costmodel(rows, timings, curve_max_gamma=4)["curves"][0]
    assert curve["alpha"] == pytest.approx(0.7)
    assert curve["best_gamma"] == 4
    assert curve["best_predicted_speedup"] == pytest.approx(costmodel.speedup(0.7, 4, 0.1))
    assert curve["best_predicted_speedup"] == pytest.approx(1.98, abs=0.01)  # the reference's cost model
    assert curve["points"][3]["measured_over_predicted_token"] == pytest.approx(
        1.5 / costmodel.speedup(0.7, 4, 0.1))  # the decode phase: the model has no prefill term


def test_plot(tiny_result, tmp_path):
    path = tmp_path / "cost.png"
    plot_costmodel(tiny_result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_peers_and_one_verify(tiny_loaded_pair):
    target, draft = tiny_loaded_pair
    config = tiny_config(peers=False, verify=["block"], temperatures=[0.5], gammas=[2],
                         drafts=["ngram"], repeats=1, warmup=0)
    result = run_benchmark(config, models={"tiny-target": target}, timings=FAKE_TIMINGS,
                           log=None)
    assert {r["method"] for r in result["rows"]} == {"autoregressive", "speculative"}
    assert all(r["speedup_vs_hf_generate"] is None for r in result["rows"])
    curve = result["costmodel"]["curves"][0]
    assert curve["alpha_from"] == "block"  # no token-rule rows: α from the block rule's


def test_seeds_run_each_prompt_with_more_texts(tiny_loaded_pair):
    """--seeds N: every configuration runs each prompt with N seeds (seed + i + P·j), a row
    totals them, and a greedy row still matches plain decoding run for run."""
    target, _ = tiny_loaded_pair
    config = tiny_config(peers=False, verify=["token"], temperatures=[0.0, 0.9], gammas=[2],
                         drafts=["ngram"], repeats=1, warmup=0, seed=5, seeds=3)
    assert config.jobs()[:3] == [(0, 5), (1, 6), (0, 7)]  # two prompts
    assert len(config.jobs()) == 3 * len(config.prompts)
    result = run_benchmark(config, models={"tiny-target": target}, timings=FAKE_TIMINGS, log=None)
    one = run_benchmark(tiny_config(**{**config.__dict__, "seeds": 1}),
                        models={"tiny-target": target}, timings=FAKE_TIMINGS, log=None)
    for row, single in zip(result["rows"], one["rows"]):
        assert row["n_prompts"] == single["n_prompts"]
        assert row["output_tokens"] == 3 * single["output_tokens"]
        if row["temperature"] == 0:
            assert row["matches_autoregressive"] is True
    with pytest.raises(ValueError, match=r"^seeds must be an integer >= 1, got 0"):
        tiny_config(seeds=0).check()


def test_measure_timings_on_tiny_models(tiny_loaded_pair):
    import torch

    target, draft = tiny_loaded_pair
    context = torch.tensor([[1, 5, 6, 7, 5, 6, 8, 9, 10, 11]])
    from exactspec.drafters import AutoDrafter, ModelDrafter

    timings = measure_timings(target, {"tiny-draft": draft, "ngram": "ngram",
                                       "auto": AutoDrafter(ModelDrafter(draft))}, context, 3)
    assert set(timings["drafts"]) == {"tiny-draft", "ngram"}  # an auto draft has no single cost
    assert [item["tokens"] for item in timings["target"]] == [1, 2, 3, 4]
    assert all(item["seconds"] > 0 for item in timings["target"])
    assert timings["drafts"]["tiny-draft"]["seconds_per_token"] > 0
    assert timings["drafts"]["ngram"]["seconds_per_token"] > 0


def test_gammas_and_verify_parsing():
    assert parse_gammas("8, 1,2,4,2") == [1, 2, 4, 8]
    assert parse_gammas("auto,8,4") == [4, 8, "auto"]  # integers sorted, then auto
    assert parse_gammas("AUTO, auto") == ["auto"]
    assert parse_gammas("4,auto") == [4, "auto"]
    for bad in ("", "1,,2", "0", "33", "two", "1.5", "auto,", "automatic"):
        with pytest.raises(ValueError, match="^gammas"):  # the library names the parameter
            parse_gammas(bad)
        with pytest.raises(ValueError, match="^--gammas"):  # or the option that carried it
            parse_gammas(bad, "--gammas")
    assert parse_verify("token,block") == ["block", "token"]
    with pytest.raises(ValueError, match="^verify"):
        parse_verify("token,joint")
    with pytest.raises(ValueError, match="^--verify"):
        parse_verify("token,joint", "--verify")


def test_config_check_names_the_parameter():
    assert tiny_config(gammas=["auto"]).check().gammas == ["auto"]
    for overrides, message in (({"gammas": [0]}, r"^gammas must be integers in \[1, 32\]"),
                               ({"gammas": [4, "fast"]}, r"^gammas .* or 'auto', got \[4, 'fast'\]"),
                               ({"drafts": []}, r"^drafts needs at least one draft"),
                               ({"repeats": 0}, r"^repeats must be an integer >= 1, got 0"),
                               ({"top_p": 1.5}, r"^top_p must be in \(0, 1\], got 1.5")):
        with pytest.raises(ValueError, match=message):
            tiny_config(**overrides).check()


def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "copy this", "kind": "grounded", '
                    '"name": "c"}\n')
    assert load_bench_prompts(path) == [BenchPrompt("line 1", "custom", "hello"),
                                        BenchPrompt("c", "grounded", "copy this")]


@pytest.mark.parametrize("argv, message", [
    (["--gammas", "1,x"], r"--gammas: each γ must be an integer in \[1, 32\] or 'auto', got 'x'"),
    (["--gammas", "0,2"], r"--gammas"),
    (["--gammas", ""], r"--gammas must be a comma-separated list"),
    (["--verify", "fast"], r"--verify"),
    (["--temperature", "-1"], r"--temperature must be a number >= 0, got -1"),
    (["--repeats", "0"], r"--repeats must be a positive integer, got 0"),
    (["--max-new-tokens", "ten"], r"--max-new-tokens must be a positive integer"),
    (["--top-p", "1.5"], r"--top-p must be a number in \(0, 1\], got 1.5"),
    (["--seeds", "0"], r"--seeds must be a positive integer, got 0"),
    (["--seeds", "2", "--batch-sizes", "2"], r"--seeds is for the per-prompt benchmark"),
])
def test_bad_options_one_line_error(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("exactspec bench: error: ")
    assert __import__("re").search(message, err)


def test_the_json_workload_gets_a_budget_its_replies_fit():
    """Without --max-new-tokens a JSON reply may run to its own default budget (it ends at its
    JSON's end; 32 tokens cut nearly every reply off); a given budget is kept."""
    from exactspec.bench import config as bench, extraction
    from exactspec.cli.bench import config_from_args
    from exactspec.cli.main import build_parser

    parse = lambda *argv: config_from_args(build_parser().parse_args(["bench", *argv]))
    assert parse("--workload", "json:2").max_new_tokens == extraction.MAX_NEW_TOKENS
    assert parse("--workload", "json:2", "--max-new-tokens", "40").max_new_tokens == 40
    assert parse().max_new_tokens == bench.DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("content, message", [
    (None, r"--prompts .*missing.jsonl: cannot read the file"),
    ("", r"the file has no prompts"),
    ('{"prompt": "ok"}\nnot json\n', r"line 2: not valid JSON"),
    ('{"text": "no prompt key"}\n', r'line 1: expected an object with a non-empty "prompt"'),
    ('{"prompt": "   "}\n', r'line 1: expected an object with a non-empty "prompt"'),
    ('["prompt"]\n', r"line 1: expected an object"),
    ('{"prompt": "x", "kind": 3}\n', r'line 1: "kind" and "name" must be strings'),
])
def test_bad_prompts_one_line_error(content, message, tmp_path, capsys):
    path = tmp_path / "missing.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--prompts", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("exactspec bench: error: ")
    assert __import__("re").search(message, err)


def test_missing_output_folder_refused_before_running(tmp_path, capsys):
    assert main(["bench", "--json", str(tmp_path / "no" / "out.json")]) == 2
    assert "--json: the folder" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--gammas", "auto"], ["--draft", "auto", "--gammas", "4"]])
def test_plot_without_curves_refused_before_running(argv, tmp_path, capsys):
    """γ = auto rows and auto-draft rows have no cost-model curve: --plot needs another row."""
    assert main(["bench", *argv, "--plot", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs an integer γ" in err


def test_cli_end_to_end_on_tiny_models(tiny_loaded_pair, tmp_path, capsys, monkeypatch):
    """The whole command, with the model loader pointed at the tiny pair."""
    target, draft = tiny_loaded_pair
    import exactspec.models

    monkeypatch.setattr(exactspec.models, "load_model",
                        lambda spec, device=None: {"tiny-target": target, "tiny-draft": draft}[spec])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w1 w2", "kind": "grounded"}\n')
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    code = main(["bench", "--target", "tiny-target", "--draft", "tiny-draft", "NGRAM",
                 "Auto:tiny-draft", "--gammas", "auto,2", "--prompts", str(prompts),
                 "--max-new-tokens", "5",
                 "--temperature", "0", "--repeats", "1", "--warmup", "0", "--verify", "token",
                 "--json", str(out), "--plot", str(plot), "--quiet", "--trace", str(tmp_path / "t.jsonl")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    trace = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    exactspec_rows = [r for r in result["rows"] if r["method"] in ("speculative", "autoregressive")]
    assert {line["config"].split()[0] for line in trace} == {"speculative", "autoregressive"}
    assert sum(line["drafted"] for line in trace) == sum(r["drafted_tokens"] for r in exactspec_rows)
    assert all(line["reason"] for line in trace)
    assert result["config"]["prompts_source"] == str(prompts)
    assert result["config"]["drafts"] == ["tiny-draft", "ngram", "auto:tiny-draft"]
    assert result["config"]["gammas"] == [2, "auto"]
    assert {(r["draft"], r["gamma"]) for r in result["rows"] if r["method"] == "speculative"} \
        == {(d, g) for d in ("tiny-draft", "ngram", "auto:tiny-draft") for g in (2, "auto")} \
        | {("oracle", max(1, result["ceiling"]["k"] - 1)),  # the oracle rows: on by default
           ("lookup-oracle", len(result["ceiling"]["passes"]) - 1)}
    assert {c["draft"] for c in result["costmodel"]["curves"]} == {"tiny-draft", "ngram"}
    assert plot.exists()
    assert "T = 0, grounded prompts" in captured.out and "recommended γ" in captured.out
    assert "T = 0, grounded: best lookup speculative" in captured.out
    assert "γ=auto vs autoregressive: tiny-draft token" in captured.out
    assert captured.err == ""
    assert all(math.isfinite(r["tokens_per_s"]) for r in result["rows"])


def test_decode_rate_leaves_out_the_first_emission():
    """The decode phase: tokens after each run's first emission over the seconds after it."""
    from exactspec.bench.report import decode_rate
    from exactspec.bench.runners import RunResult

    runs = [RunResult(list(range(32)), 1.0, 0.2, first_tokens=5),
            RunResult(list(range(32)), 2.0, 0.4, first_tokens=1)]
    assert decode_rate(runs) == pytest.approx((27 + 31) / (0.8 + 1.6))
    assert decode_rate([RunResult([1, 2], 1.0, None)]) is None


def test_background_load_runs_for_the_block_only():
    """`--background-load N`: N busy processes inside the block, none after it; a bad N names
    the field."""
    from exactspec.bench.load import BackgroundLoad

    with BackgroundLoad(2) as load:
        assert load.running() == 2
        processes = list(load.processes)
    assert load.running() == 0 and all(p.poll() is not None for p in processes)
    with pytest.raises(ValueError, match=r"background_load must be an integer in \[0, 64\], got -1"):
        tiny_config(background_load=-1).check()


def test_constrained_prompts_report_validity_and_the_grammars_share():
    """The json workload's path on tiny models with a tokenizer llguidance reads: replies end at
    EOS once their schema is met, every one validates, greedy speculative rows equal plain
    decoding, and rows say how much the grammar drafted and what the matchers cost; peers are
    refused (Transformers' rows do not constrain), llama.cpp's accepted (they follow the schema)."""
    import torch
    from conftest import GRAMMAR_VOCAB, make_grammar_tokenizer, make_tiny_llama
    from exactspec.bench.config import BenchPrompt
    from exactspec.constraints import Constraint
    from exactspec.models import LoadedModel

    schema = {"type": "object", "properties": {"ab": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["ab"], "additionalProperties": False}
    tokenizer, cpu = make_grammar_tokenizer(), torch.device("cpu")
    models = {"tiny-grammar": LoadedModel(make_tiny_llama(seed=0, vocab_size=GRAMMAR_VOCAB), tokenizer,
                                          "tiny-grammar", torch.float32, cpu)}
    prompts = [BenchPrompt(f"p{i}", "json", text, constraint=Constraint.json_schema(schema))
               for i, text in enumerate(['{"ab": 12}', "ab cd"])]
    config = tiny_config(target="tiny-grammar", drafts=["ngram"], gammas=["auto"], prompts=prompts,
                         max_new_tokens=40, repeats=1, peers=False)
    result = run_benchmark(config, models=models, timings=FAKE_TIMINGS, log=None)
    assert {row["method"] for row in result["rows"]} == {"autoregressive", "speculative"}
    for row in result["rows"]:
        assert row["valid"] == 1.0 and row["invalid"] is None
        assert row["output_tokens"] < 2 * 40 and row["constraint_ms_per_token"] > 0
        if row["method"] == "speculative":
            assert row["grammar_share"] > 0
            if row["temperature"] == 0:
                assert row["matches_autoregressive"]
    assert result["config"]["prompts"][0]["schema"] == schema
    with pytest.raises(ValueError, match="llama.cpp's rows only: peers must be off"):
        tiny_config(target="tiny-grammar", prompts=prompts).check()
    tiny_config(target="tiny-grammar", prompts=prompts, peers=False, llama_peers=True).check()


def test_timed_passes_run_each_prompt_under_every_configuration_in_alternating_order(monkeypatch):
    """A timed pass runs one prompt under every configuration before the next prompt, the order
    reversed from one prompt to the next (the machine's drift spreads over all configurations)."""
    from exactspec.bench import run as bench_run

    calls, run = [], bench_run.Runner.run

    def recording(self, spec, input_ids, seed, max_new_tokens, constraint=None):
        calls.append((spec, seed))
        return run(self, spec, input_ids, seed, max_new_tokens, constraint)

    monkeypatch.setattr(bench_run.Runner, "run", recording)
    config = tiny_config(drafts=["ngram"], gammas=[2], temperatures=[0.0], peers=False, repeats=2, warmup=0)
    run_benchmark(config, models=tiny_models(), timings=FAKE_TIMINGS, log=None)
    specs = list(dict.fromkeys(spec for spec, _ in calls))
    prompts = len(config.jobs())
    assert len(specs) >= 2 and len(calls) == 2 * prompts * len(specs)
    blocks = [calls[k * len(specs): (k + 1) * len(specs)] for k in range(2 * prompts)]
    for k, block in enumerate(blocks):  # (pass, prompt) in the order they ran
        rep, j = divmod(k, prompts)
        assert {seed for _, seed in block} == {config.jobs()[j][1]}  # one prompt, every configuration
        assert [spec for spec, _ in block] == (specs if (rep + j) % 2 == 0 else specs[::-1])
