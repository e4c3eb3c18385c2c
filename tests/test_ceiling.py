"""The machine's ceiling and the oracle rows (`exactspec.bench.ceiling`, `OracleDrafter`,
`LookupOracleDrafter`): the ceiling's arithmetic and its errors, T(k) measured on the bundled
model, the line, the share column and the JSON of `exactspec bench`, and the oracle drafts'
exactness: a round of either then the target keeps the target's joint law (float64
enumeration), their greedy output is plain decoding's, and a q placed on another token goes
red."""
from __future__ import annotations

import functools
import itertools
import json

import pytest
import torch

from exactspec import costmodel
from exactspec.bench.ceiling import (LOOKUP_ORACLE, ORACLE, ceiling_gamma, measured_ceiling,
                                     oracle_gamma)
from exactspec.bench.config import BenchConfig, BenchPrompt
from exactspec.bench.run import run_benchmark
from exactspec.cli import main
from exactspec.cli.bench_tables import print_result
from exactspec.drafters import LookupOracleDrafter, OracleDrafter, Proposal
from exactspec.engine import autoregressive_generate, speculative_generate
from exactspec.sampling import SamplingConfig
from exactspec.verify import next_token_weights, stop_distribution

# the target's pass over 1..9 tokens: k·T(1)/T(k) grows with k, so k* = 9 and the ceiling 4.5
FAKE_TIMINGS = {"context_tokens": 20,
                "target": [{"tokens": n, "seconds": 0.040 + 0.005 * (n - 1)} for n in range(1, 10)],
                "drafts": {"ngram": {"seconds_per_token": 0.0001, "measured_as": "fake"}}}


# --------------------------------------------------------------------------- the ceiling


def test_ceiling_is_the_best_k_times_t1_over_tk():
    assert costmodel.ceiling([0.065, 0.070, 0.190]) == (2, pytest.approx(2 * 0.065 / 0.070))
    assert costmodel.ceiling([0.05]) == (1, 1.0)
    assert costmodel.ceiling([1.0, 2.0, 3.0]) == (1, 1.0)  # a tie: the smallest k
    k, ceiling = costmodel.ceiling(item["seconds"] for item in FAKE_TIMINGS["target"])
    assert (k, ceiling) == (9, pytest.approx(9 * 0.040 / 0.080))


@pytest.mark.parametrize("times, message", [
    ([], "pass_seconds is empty"),
    ([0.05, 0.0], r"T\(2\) = 0.0"),
    ([-1.0], r"T\(1\) = -1.0"),
    ([0.05, 0.06, float("nan")], r"T\(3\) = nan"),
    ([0.05, float("inf")], r"T\(2\) = inf"),
    ([True], r"T\(1\) = True"),
])
def test_ceiling_names_bad_values(times, message):
    with pytest.raises(ValueError, match=message):
        costmodel.ceiling(times)


def test_measured_ceiling_and_the_oracle_gamma():
    ceiling = measured_ceiling(FAKE_TIMINGS)
    assert ceiling["k"] == 9 and ceiling["speedup"] == pytest.approx(4.5)
    assert (ceiling["t_1_seconds"], ceiling["t_k_seconds"]) == (0.040, pytest.approx(0.080))
    assert ceiling["passes"] == FAKE_TIMINGS["target"] and ceiling["context_tokens"] == 20
    assert oracle_gamma(ceiling) == 8  # 8 drafts: a pass over k* = 9 tokens
    assert oracle_gamma({"k": 1}) == 1
    with pytest.raises(ValueError, match=r"1..K tokens, got \[1, 3\]"):
        measured_ceiling({"target": [{"tokens": 1, "seconds": 1.0}, {"tokens": 3, "seconds": 2.0}]})


def test_the_ceiling_covers_every_block_that_gamma_auto_may_choose():
    """With γ = auto the timings run to AUTO_MAX_GAMMA + 1 tokens (a long pass can cost less
    than a shorter one); with fixed γ only, to the curves' largest γ + 1."""
    from exactspec.controller import AUTO_MAX_GAMMA

    assert ceiling_gamma(["auto", 4], 8) == AUTO_MAX_GAMMA
    assert ceiling_gamma([4, 12], 12) == 12


def test_t_k_measured_on_the_bundled_model(bundled_pair):
    """T(1..9) on the bundled model through the target protocol: nine positive medians."""
    from exactspec.bench.timing import time_forward
    from exactspec.models import encode_prompt

    target, _ = bundled_pair
    ids = encode_prompt(target, "Explain in a few sentences how vaccines help the immune system.")
    times = time_forward(target, ids, range(1, 10), repeats=1, warmup=0)
    assert sorted(times) == list(range(1, 10)) and all(s > 0 for s in times.values())
    ceiling = measured_ceiling({"target": [{"tokens": k, "seconds": s} for k, s in times.items()]})
    assert 1 <= ceiling["k"] <= 9 and ceiling["speedup"] >= 1.0


# --------------------------------------------------------------------------- the bench


def test_the_report_prints_the_ceiling_and_each_rows_share(capsys):
    """From a result set made by hand: the ceiling line, and 'of ceiling' = ×AR / ceiling."""
    ceiling = measured_ceiling(FAKE_TIMINGS)  # 4.5× at k = 9
    base = dict(method="speculative", draft="ngram", gamma=4, verify="block", temperature=0.0,
                prompts="open", n_prompts=1, output_tokens=32, tokens_per_s=30.0,
                speedup_vs_autoregressive=1.8, share_of_ceiling=1.8 / 4.5)
    rows = [base, {**base, "draft": ORACLE, "gamma": 8, "speedup_vs_autoregressive": 3.6,
                   "share_of_ceiling": 3.6 / 4.5}]
    config = BenchConfig(target="t", drafts=["ngram"], prompts=[BenchPrompt("a", "open", "x")])
    result = {"config": config.to_dict(), "rows": rows, "summary": [], "ceiling": ceiling,
              "machine": {key: "-" for key in ("cpu_model", "cpu_cores_usable", "torch_version",
                                                "torch_threads", "transformers_version", "device")},
              "costmodel": {"timings": FAKE_TIMINGS, "curves": []}}
    print_result(result)
    out = capsys.readouterr().out
    assert "ceiling: 4.50× at k = 9 (T(1) 40.0 ms, T(9) 80.0 ms)" in out
    assert "'of ceiling' = ×AR / ceiling" in out
    assert "oracle (target's own greedy tokens)" in out and "γ = 8" in out
    header = next(line for line in out.splitlines() if "of ceiling" in line and "×AR" in line)
    assert header.split().count("ceiling") == 1
    assert " 40% " in out + " " and " 80% " in out + " "


@pytest.fixture(scope="module")
def oracle_result():
    """A small bench on the tiny models with the oracle row, at T = 0 and T = 1."""
    from test_bench import tiny_models

    config = BenchConfig(target="tiny-target", drafts=["ngram"], gammas=[2], verify=["token"],
                         temperatures=[0.0, 1.0], max_new_tokens=8, repeats=1, warmup=0,
                         peers=False, oracle=True,
                         prompts=[BenchPrompt("a", "open", "w1 w2 w3"),
                                  BenchPrompt("b", "grounded", "w4 w5 w6 w4 w5")])
    return run_benchmark(config, models=tiny_models(), timings=FAKE_TIMINGS, log=None)


def test_the_oracle_row_keeps_every_greedy_draft_per_category(oracle_result):
    rows = [r for r in oracle_result["rows"] if r["draft"] == ORACLE]
    assert {(r["temperature"], r["prompts"]) for r in rows} == {
        (0.0, kind) for kind in ("open", "grounded")}  # one per category, at T = 0 only
    for row in rows:  # the target's own greedy tokens: every draft is kept
        assert row["gamma"] == 8 and row["verify"] == "token"
        assert set(row["rounds_by_source"]) == {ORACLE}
        assert row["accepted_drafts"] == row["drafted_tokens"] > 0
        assert row["corrections"] == 0 and row["matches_autoregressive"] is True
    for row in oracle_result["rows"]:
        assert row["share_of_ceiling"] == pytest.approx(row["speedup_vs_autoregressive"] / 4.5)
    assert {c["draft"] for c in oracle_result["costmodel"]["curves"]} == {"ngram"}
    for item in oracle_result["summary"]:
        assert item["peers"]["best"]["draft"] not in (ORACLE, LOOKUP_ORACLE)  # not contenders


def test_the_lookup_oracle_row_keeps_every_draft_it_makes(oracle_result):
    """The lookup oracle's row per category at T = 0: γ the longest block timed (8 drafts for
    T(1..9)), only drafts the target keeps, plain decoding's text; on the prompt that repeats
    itself it drafts, and never more than the oracle keeps."""
    rows = {r["prompts"]: r for r in oracle_result["rows"] if r["draft"] == LOOKUP_ORACLE}
    assert set(rows) == {"open", "grounded"}
    for row in rows.values():
        assert row["temperature"] == 0.0 and row["gamma"] == 8
        assert row["accepted_drafts"] == row["drafted_tokens"]
        assert row["corrections"] == 0 and row["matches_autoregressive"] is True
    assert rows["grounded"]["drafted_tokens"] > 0
    oracle = {r["prompts"]: r for r in oracle_result["rows"] if r["draft"] == ORACLE}
    assert all(rows[kind]["accepted_drafts"] <= oracle[kind]["accepted_drafts"] for kind in rows)


def test_the_cli_json_carries_t_k_the_ceiling_and_the_shares(tiny_loaded_pair, tmp_path, capsys,
                                                            monkeypatch):
    """The whole command on the tiny target (T(k) measured for real): the line, the column, the
    oracle row (on by default) and the JSON."""
    import exactspec.models

    target, _ = tiny_loaded_pair
    monkeypatch.setattr(exactspec.models, "load_model", lambda spec, device=None: target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w1 w2 w3 w1 w2", "kind": "grounded"}\n')
    out = tmp_path / "r.json"
    code = main(["bench", "--target", "tiny-target", "--draft", "ngram", "--gammas", "2",
                 "--prompts", str(prompts), "--max-new-tokens", "5", "--temperature", "0",
                 "--repeats", "1", "--warmup", "0", "--verify", "token", "--no-peers",
                 "--json", str(out), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    ceiling = result["ceiling"]
    assert [p["tokens"] for p in ceiling["passes"]] == list(range(1, 10))
    assert all(p["seconds"] > 0 for p in ceiling["passes"])
    assert (ceiling["k"], ceiling["speedup"]) == tuple(
        costmodel.ceiling([p["seconds"] for p in ceiling["passes"]]))
    assert f"ceiling: {ceiling['speedup']:.2f}× at k = {ceiling['k']}" in captured.out
    assert "of ceiling" in captured.out
    oracle = [r for r in result["rows"] if r["draft"] == ORACLE]
    assert len(oracle) == 1 and oracle[0]["gamma"] == max(1, ceiling["k"] - 1)
    assert all("share_of_ceiling" in r for r in result["rows"])
    assert main(["bench", "--no-oracle", "--target", "tiny-target", "--draft", "ngram",
                 "--gammas", "2", "--prompts", str(prompts), "--max-new-tokens", "3",
                 "--temperature", "0", "--repeats", "1", "--warmup", "0", "--no-peers",
                 "--json", str(out), "--quiet"]) == 0
    assert not [r for r in json.loads(out.read_text())["rows"] if r["draft"] == ORACLE]


# --------------------------------------------------------------------------- exactness

V = 8  # the enumeration's vocabulary
PROMPT = (1, 5, 3, 6)


# a lookup oracle's pass times: the longer the pass, the less it costs per token
PASS_SECONDS = [1.0, 1.5, 1.8, 2.0]
LookupOracle = functools.partial(LookupOracleDrafter, pass_seconds=PASS_SECONDS)


def placed_elsewhere(oracle):
    """A broken `oracle` class: its q claims a point mass, placed on the token after each draft."""

    class PlacedElsewhere(oracle):
        def propose(self, gamma, sampling, generator):
            proposal = super().propose(gamma, sampling, generator)
            q = torch.nn.functional.one_hot((proposal.tokens + 1) % V, V).double()  # [B, γ', V]
            return Proposal(proposal.tokens, q, proposal.lengths)
    return PlacedElsewhere


def half_elsewhere(oracle):
    """A broken `oracle` class: its q puts half the draft's mass on the token after it."""

    class HalfElsewhere(oracle):
        def propose(self, gamma, sampling, generator):
            proposal = super().propose(gamma, sampling, generator)
            one_hot = torch.nn.functional.one_hot
            q = (one_hot(proposal.tokens, V) + one_hot((proposal.tokens + 1) % V, V)).double() / 2
            return Proposal(proposal.tokens, q, proposal.lengths)
    return HalfElsewhere


class Enumerated:
    """p at every prefix of up to `depth` tokens after PROMPT + history, from a tiny float64
    Llama of vocabulary V (one batched pass per prefix length): tables[k] is [V]*k + [V]."""

    def __init__(self, temperature: float, history: tuple = (), depth: int = 0):
        from conftest import make_tiny_llama

        model = make_tiny_llama(seed=3, vocab_size=V, dtype=torch.float64)
        sampling, self.history, self.tables = SamplingConfig(temperature=temperature), history, []
        with torch.no_grad():
            for k in range(depth + 1):
                prefixes = torch.tensor(list(itertools.product(range(V), repeat=k)),
                                        dtype=torch.long).view(V**k, k)  # [V^k, k]
                ids = torch.cat([torch.tensor(PROMPT + history).expand(V**k, -1), prefixes], 1)
                probs = sampling.probs(model(ids).logits[:, -1])  # [V^k, V]
                self.tables.append(probs.view(*[V] * k, V))

    def target_after(self, emitted: tuple) -> torch.Tensor:
        """P(the rest of the len(tables) tokens | emitted), [V]*(len(tables) − len(emitted))."""
        law = torch.ones((), dtype=torch.float64)
        for k in range(len(emitted), len(self.tables)):
            law = law.unsqueeze(-1) * self.tables[k][emitted]  # [V]*(k − len(emitted) + 1)
        return law

    def round_then_target(self, drafter, gamma: int, verify: str) -> torch.Tensor:
        """One round of `drafter` (started on PROMPT, then given `history`), then the target, to
        γ+1 tokens: [V]*(γ+1)."""
        ids = torch.tensor([PROMPT])
        drafter.start(ids, torch.ones_like(ids, dtype=torch.bool), V)
        for token in self.history:  # rounds that rejected their one draft and emitted `token`
            drafter.propose(1, SamplingConfig(), None)
            drafter.commit(torch.tensor([0]), torch.tensor([token]))
        proposal = drafter.propose(gamma, SamplingConfig(), None)
        block = tuple(proposal.tokens[0].tolist())
        p = torch.stack([self.tables[i][block[:i]] for i in range(len(block) + 1)]).unsqueeze(0)
        stop = stop_distribution(proposal.tokens, proposal.q, p, verify)[0]  # [γ'+1]
        law = torch.zeros([V] * (gamma + 1), dtype=torch.float64)
        for tau in range(len(block) + 1):
            nxt = next_token_weights(proposal.tokens, proposal.q, p, torch.tensor([tau]), verify)[0]
            for y in nxt.nonzero().flatten().tolist():
                emitted = block[:tau] + (y,)
                law[emitted] += stop[tau] * nxt[y] / nxt.sum() * self.target_after(emitted)
        return law


def greedy_reference(length: int) -> list[int]:
    """The tiny target's own greedy continuation of PROMPT."""
    reference = []
    for _ in range(length):
        reference.append(int(Enumerated(0.0, tuple(reference)).tables[0].argmax()))
    return reference


def worst_gap(drafter_class, temperature, history, gamma, verify, reference) -> float:
    world = Enumerated(temperature, history, gamma)
    got = world.round_then_target(drafter_class({PROMPT: reference}), gamma, verify)
    return (got - world.target_after(())).abs().max().item()


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("history, gamma", [((), 3), ((4, 2), 2)])
def test_a_round_of_the_oracle_keeps_the_target_law(history, gamma, temperature, verify):
    """One round of the oracle (the greedy reference; after committed tokens that left it, too;
    and another reference), then the target: the joint of the next γ+1 tokens is the target's,
    to 1e-12."""
    greedy = greedy_reference(len(history) + gamma + 1)
    for reference in (greedy, [7, 0, 7, 0, 7, 0]):
        assert worst_gap(OracleDrafter, temperature, history, gamma, verify, reference) < 1e-12


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_round_of_the_lookup_oracle_keeps_the_target_law(temperature, verify):
    """One round of the lookup oracle after history (5, 3), which PROMPT's "5 3 6" continues (the
    lookup proposes 6 5 3): with a reference that agrees it drafts all three (the cheapest pass
    per token), with one that agrees on one token it drafts that one, with the greedy reference
    what the lookup and it share; each time the joint of the next 4 tokens is the target's."""
    history = (5, 3)
    for reference, drafted in (([5, 3, 6, 5, 3], 3), ([5, 3, 6, 0, 0], 1),
                               (list(history) + greedy_reference(3), None)):
        drafter = LookupOracle({PROMPT: reference})
        world = Enumerated(temperature, history, 3)
        if drafted is not None:  # the cut, seen on the drafter the round uses
            world.round_then_target(drafter, 3, verify)
            assert drafter.drafts.shape == (1, drafted)
        assert worst_gap(LookupOracle, temperature, history, 3, verify, reference) < 1e-12


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("oracle, keywords, history, reference", [
    (OracleDrafter, {}, (), None),
    (LookupOracleDrafter, {"pass_seconds": PASS_SECONDS}, (5, 3), [5, 3, 6, 5, 3])])
def test_a_q_placed_on_another_token_goes_red(oracle, keywords, history, reference, verify):
    """The same enumeration goes red: a q with half its mass on another token shows a gap; one
    with all of it there is refused by the verifier."""
    reference = reference or greedy_reference(3)
    half, placed = (functools.partial(wrap(oracle), **keywords)
                    for wrap in (half_elsewhere, placed_elsewhere))
    assert worst_gap(half, 1.0, history, 2, verify, reference) > 1e-3
    with pytest.raises(ValueError, match="zero probability under q"):
        worst_gap(placed, 1.0, history, 2, verify, reference)


def test_the_lookup_oracle_drafts_at_the_pass_size_that_costs_least_per_token():
    drafter = LookupOracleDrafter({(1,): [2]}, [1.0, 1.5, 3.3, 2.0])  # per token: 1, .75, 1.1, .5
    assert [drafter.cheapest(run) for run in range(4)] == [0, 1, 1, 3]
    with pytest.raises(ValueError, match="pass_seconds"):
        LookupOracleDrafter({(1,): [2]}, [])


def test_the_lookup_oracle_gives_plain_greedy_text_on_the_bundled_model(bundled_pair):
    """SmolLM2, a prompt that repeats itself: the lookup oracle on plain greedy decoding's tokens
    drafts, keeps every draft, and gives plain decoding's tokens."""
    from exactspec.models import encode_prompt

    target, _ = bundled_pair
    ids = encode_prompt(target, "Repeat exactly: the cat sat on the mat. the cat sat on the mat.")
    settings = dict(max_new_tokens=12, temperature=0.0, eos_token_id=[])
    plain = autoregressive_generate(target, ids, **settings).sequences[0].tolist()
    drafter = LookupOracleDrafter({tuple(ids[0].tolist()): plain[ids.size(1):]},
                                  [0.03 + 0.002 * k for k in range(9)])
    out = speculative_generate(target, drafter, ids, gamma=8, **settings)
    assert out.sequences[0].tolist() == plain
    assert out.stats.accepted_drafts == out.stats.drafted_tokens > 0


def test_greedy_oracle_is_plain_decoding_on_the_bundled_model(bundled_pair):
    """SmolLM2: the oracle built from plain greedy decoding keeps every draft and gives the same
    tokens; with the coupled rule at T > 0 it gives plain sampling's tokens with the same seed."""
    from exactspec.models import encode_prompt

    target, _ = bundled_pair
    ids = encode_prompt(target, "Write a short story about a lighthouse keeper.")
    settings = dict(max_new_tokens=8, temperature=0.0, eos_token_id=[])
    plain = autoregressive_generate(target, ids, **settings).sequences[0].tolist()
    reference = plain[ids.size(1):]
    out = speculative_generate(target, OracleDrafter({tuple(ids[0].tolist()): reference}), ids,
                               gamma=4, **settings)
    assert out.sequences[0].tolist() == plain
    assert out.stats.accepted_drafts == out.stats.drafted_tokens > 0
    sampled = dict(settings, temperature=0.8, seed=5)  # the coupled rule: plain's tokens at T > 0
    plain = autoregressive_generate(target, ids, **sampled).sequences[0].tolist()
    out = speculative_generate(target, OracleDrafter({tuple(ids[0].tolist()): reference}), ids,
                               gamma=4, verify="coupled", **sampled)
    assert out.sequences[0].tolist() == plain


def test_a_row_that_left_its_reference_stops_drafting():
    """A reference whose third token is not the target's greedy one: the first round keeps both
    drafts and emits the target's third token; the row has left its reference, so it drafts no
    more (plain steps), and the text is still plain greedy decoding's."""
    from conftest import make_tiny_llama

    target = make_tiny_llama(seed=3, vocab_size=V)
    ids, settings = torch.tensor([PROMPT]), dict(max_new_tokens=8, temperature=0.0, eos_token_id=[])
    plain = autoregressive_generate(target, ids, **settings).sequences[0].tolist()
    greedy = plain[len(PROMPT):]
    reference = greedy[:2] + [(greedy[2] + 1) % V] + greedy[3:]
    out = speculative_generate(target, OracleDrafter({tuple(PROMPT): reference}), ids, gamma=2,
                               **settings)
    assert out.sequences[0].tolist() == plain
    assert out.stats.drafted_tokens == out.stats.accepted_drafts == 2


def test_a_prompt_without_a_reference_is_refused():
    drafter = OracleDrafter({(1, 2): [3]})
    ids = torch.tensor([[1, 2, 4]])
    with pytest.raises(ValueError, match="no reference continuation for this prompt"):
        drafter.start(ids, torch.ones_like(ids, dtype=torch.bool), V)
    with pytest.raises(ValueError, match="at least one reference"):
        OracleDrafter({})
