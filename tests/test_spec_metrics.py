"""Speculation metrics per request (the response's `metrics.speculative_decoding`: totals, by
source, per position of the block) and in the server's /metrics (by source, per position as
vLLM's `spec_decode_num_accepted_tokens_per_pos`): counted on hand-made rounds, then checked for
consistency on real requests (tiny models; the bundled model in one slow test)."""
import re
from types import SimpleNamespace

import pytest
import torch

from exactspec.controller import MAX_GAMMA
from exactspec.rows import DecodeStats, Rows, SourceCounts, round_source

EOS = 2


class _Clock:
    def read(self) -> float:
        return 1.0


def hand_made_round(rows: Rows, source: str, tokens: list[list[int]], accepted: list[int], drafted):
    """One round as the engine reports it: each row's block of emitted tokens (-1 padding) and τ."""
    width = max(map(len, tokens))
    result = SimpleNamespace(tokens=torch.tensor([t + [-1] * (width - len(t)) for t in tokens]),
                             num_accepted=torch.tensor(accepted))
    return rows.record(result, drafted, 1, 1, None, source)


def test_counts_per_source_and_position_on_hand_made_rounds():
    rows = Rows(3, max_new_tokens=20, eos={EOS}, clock=_Clock(), on_tokens=None)
    # round 1, prompt lookup drafted 3 per row: row 0 kept all 3 (+ bonus); row 1 kept 1 (+
    # correction); row 2 kept 3 but its second token is the EOS: 2 emitted, so 2 drafts count
    going = hand_made_round(rows, "ngram", [[5, 6, 7, 8], [5, 9], [5, EOS, 7, 8]], [3, 1, 3], 3)
    assert going.tolist() == [0, 1]
    rows.active = rows.active[going]  # as the engine retires row 2
    # round 2, the model drafted for rows 0 and 1: row 0 had 2 drafts (kept none), row 1 none
    hand_made_round(rows, "model", [[9], [4]], [0, 0], [2, 0])
    # round 3, the auto draft's first-round name ("none") counts as the model's
    hand_made_round(rows, "none", [[3, 4, 5], [3, 4]], [2, 1], [2, 2])
    first, second, third = rows.stats
    assert {k: (c.rounds, c.drafted_tokens, c.accepted_drafts) for k, c in first.by_source.items()} == {
        "ngram": (1, 3, 3), "model": (2, 4, 2)}
    assert {k: (c.rounds, c.drafted_tokens, c.accepted_drafts) for k, c in second.by_source.items()} == {
        "ngram": (1, 3, 1), "plain": (1, 0, 0), "model": (1, 2, 1)}
    assert (first.drafted_per_pos, first.accepted_per_pos) == ([3, 3, 1], [2, 2, 1])
    assert (second.drafted_per_pos, second.accepted_per_pos) == ([2, 2, 1], [2])
    assert (third.drafted_per_pos, third.accepted_per_pos) == ([1, 1, 1], [1, 1])
    for stats in rows.stats:
        assert_consistent(stats)
    total = DecodeStats()
    for stats in rows.stats:
        total.add(stats, rounds=True)
    assert total.drafted_tokens == sum(s.drafted_tokens for s in rows.stats)
    assert total.rounds == sum(s.rounds for s in rows.stats)
    assert (total.drafted_per_pos, total.accepted_per_pos) == ([6, 6, 3], [5, 3, 1])
    assert total.by_source["ngram"].accepted_drafts == 6 and total.by_source["plain"].rounds == 1


def test_round_source_names():
    assert [round_source(s, n) for s, n in (("ngram", 2), ("ngram", 0), ("none", 3), ("none", 0),
                                            ("grammar", 5))] == ["ngram", "plain", "model", "plain", "grammar"]


def test_grammar_rounds_count_under_grammar():
    """A grammar round's forced drafts (all kept) count under "grammar" in the row's own stats,
    as in the generation's rounds_by_source; the other rounds here are plain steps."""
    import exactspec as es
    from test_constraints import GRAMMARS, PROMPT, NoDrafting, grammar_pair

    target, _ = grammar_pair()
    out = es.speculative_generate(target, "ngram", torch.tensor([PROMPT]), gamma=NoDrafting(),
                                  max_new_tokens=8, temperature=0.0, constraint=GRAMMARS["jsonish"])
    stats = out.row_stats[0]
    assert_consistent(stats)
    grammar = stats.by_source["grammar"]
    assert (grammar.rounds, grammar.drafted_tokens, grammar.accepted_drafts) == (1, 4, 4)
    assert set(stats.by_source) == {"grammar", "plain"}
    assert stats.by_source["plain"].rounds == out.rounds_by_source["plain"]
    assert stats.accepted_per_pos == [1, 1, 1, 1]


def assert_consistent(stats: DecodeStats) -> None:
    """A row's counts by source add up to its totals, per position to its drafted and accepted."""
    shares = stats.by_source.values()
    assert sum(c.rounds for c in shares) == stats.rounds
    assert sum(c.drafted_tokens for c in shares) == stats.drafted_tokens
    assert sum(c.accepted_drafts for c in shares) == stats.accepted_drafts
    assert all(c.accepted_drafts <= c.drafted_tokens for c in shares)
    assert_positions(stats.drafted_per_pos, stats.accepted_per_pos, stats.drafted_tokens,
                     stats.accepted_drafts)


def assert_positions(drafted: list, accepted: list, drafted_total: int, accepted_total: int):
    assert sum(drafted) == drafted_total and sum(accepted) == accepted_total
    assert all(a >= b for a, b in zip(drafted, drafted[1:]))  # a draft at i+1 has one at i
    assert all(a >= b for a, b in zip(accepted, accepted[1:]))  # accepted at i+1: at i too
    assert len(accepted) <= len(drafted) and all(a <= d for a, d in zip(accepted, drafted))


# --------------------------------------------------------------------------- the server

pytest.importorskip("fastapi")
pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from exactspec.serve.metrics import DEEPER, ServerMetrics  # noqa: E402
from exactspec.serve.protocol import speculative_metrics  # noqa: E402
from test_cli_generate import tiny_folders  # noqa: E402,F401  (the module-scoped fixture)

TOTALS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")


def assert_spec_consistent(spec: dict) -> None:
    """The response's `metrics.speculative_decoding`: by source adds up, per position too."""
    for key in TOTALS:
        assert sum(share[key] for share in spec["by_source"].values()) == spec[key], key
    assert all(s["num_accepted_draft_tokens"] <= s["num_draft_tokens"] for s in spec["by_source"].values())
    assert_positions(spec["num_draft_tokens_per_pos"], spec["num_accepted_tokens_per_pos"],
                     spec["num_draft_tokens"], spec["num_accepted_draft_tokens"])


def exported(text: str, name: str) -> dict[str, float]:
    """A labelled counter's values in /metrics text, by its one label's value."""
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}\{{\w+="([^"]+)"\}} (\S+)$', text, re.M)}


def total_of(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def assert_exported_consistent(text: str) -> None:
    """/metrics: by source adds up to the totals; per position is non-increasing over
    0..MAX_GAMMA-1 and sums (the deeper positions' label included) to the totals."""
    pairs = (("num_rounds", "num_drafts"), ("num_draft_tokens", "num_draft_tokens"),
             ("num_accepted_tokens", "num_accepted_tokens"))
    for by, total in pairs:
        by_source = exported(text, f"exactspec:spec_decode_{by}_by_source_total")
        assert by_source and sum(by_source.values()) == total_of(text, f"exactspec:spec_decode_{total}_total")
    per_pos = [exported(text, f"exactspec:spec_decode_{name}_per_pos_total")
               for name in ("num_draft_tokens", "num_accepted_tokens")]
    for series in per_pos:
        assert set(series) == {*map(str, range(MAX_GAMMA)), DEEPER}
    drafted, accepted = ([series[str(i)] for i in range(MAX_GAMMA)] for series in per_pos)
    assert_positions(drafted, accepted, sum(drafted), sum(accepted))
    assert sum(per_pos[0].values()) == total_of(text, "exactspec:spec_decode_num_draft_tokens_total")
    assert sum(per_pos[1].values()) == total_of(text, "exactspec:spec_decode_num_accepted_tokens_total")


def test_server_metrics_count_per_position_and_source():
    """A hand-made request's counts reach /metrics; positions past MAX_GAMMA (a grammar round's
    forced drafts) are summed under one label."""
    stats = DecodeStats(rounds=3, drafted_tokens=MAX_GAMMA + 4, accepted_drafts=MAX_GAMMA + 2)
    stats.by_source = {"grammar": SourceCounts(1, MAX_GAMMA + 2, MAX_GAMMA + 2),
                       "model": SourceCounts(1, 2, 0), "plain": SourceCounts(1, 0, 0)}
    stats.drafted_per_pos = [2, 2] + [1] * MAX_GAMMA
    stats.accepted_per_pos = [1] * (MAX_GAMMA + 2)
    spec = speculative_metrics(stats)
    assert_spec_consistent(spec)
    metrics = ServerMetrics()
    metrics.observe_request(5, spec, MAX_GAMMA + 5, "length", 0.1)
    text = metrics.render().decode()
    accepted = exported(text, "exactspec:spec_decode_num_accepted_tokens_per_pos_total")
    assert accepted["0"] == accepted[str(MAX_GAMMA - 1)] == 1 and accepted[DEEPER] == 2
    assert exported(text, "exactspec:spec_decode_num_draft_tokens_per_pos_total")["1"] == 2
    assert exported(text, "exactspec:spec_decode_num_rounds_by_source_total") == {
        "grammar": 1, "model": 1, "plain": 1}
    assert_exported_consistent(text)
    assert speculative_metrics(None)["by_source"] == {}  # a request never admitted


@pytest.fixture(scope="module")
def metrics_server(tiny_folders):  # noqa: F811
    """A server of its own (its /metrics counts only this module's requests), with the defaults
    --draft auto (prompt lookup, else a bfloat16 copy of the target) and --gamma auto."""
    from exactspec.serve.app import ServeConfig
    from test_serve import Server

    srv = Server(ServeConfig(target=tiny_folders[0], model_name="tiny"))
    yield srv
    srv.close()


def test_request_metrics_add_up_streamed_and_not(metrics_server):
    """Prompts that repeat themselves give prompt lookup rounds, the others the model's: each
    response's counts by source and per position add up to its totals; a streamed request's usage
    chunk carries the same numbers as the same greedy request not streamed; /metrics adds up too."""
    client, sources = metrics_server.client, set()
    for prompt in ("w5 w9 w5 w9 w5 w9 w5", "w1 w2 w3 w1 w2 w3 w1", "w8 w3"):
        args = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"gamma": 3})
        spec = client.completions.create(**args).model_extra["metrics"]["speculative_decoding"]
        assert_spec_consistent(spec)
        sources |= set(spec["by_source"])
        chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].model_extra["metrics"]["speculative_decoding"] == spec
    assert {"ngram", "model"} <= sources, sources
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w4 w4 w4"}],
                                          max_tokens=16, temperature=0.8, seed=1)
    assert_spec_consistent(chat.model_extra["metrics"]["speculative_decoding"])
    text = httpx.get(metrics_server.url + "/metrics").text
    assert "exactspec:spec_decode_num_accepted_tokens_per_pos_total" in text
    assert_exported_consistent(text)
    assert total_of(text, "exactspec:spec_decode_num_accepted_tokens_total") > 0


@pytest.mark.slow
def test_bundled_model_request_metrics_add_up():
    """A real request on the bundled model with the server's defaults (--draft auto --gamma
    auto): a reply that repeats its prompt gives prompt lookup and the model draft rounds."""
    from exactspec.models import BUNDLED_MODEL, BundledModelMissing, load_model
    from exactspec.serve.app import ServeConfig
    from test_serve import Server

    try:
        load_model(BUNDLED_MODEL)
    except BundledModelMissing as err:
        pytest.skip(str(err))
    srv = Server(ServeConfig(target=BUNDLED_MODEL))
    try:
        question = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
        reply = srv.client.chat.completions.create(
            model=BUNDLED_MODEL, messages=[{"role": "user", "content": question}], max_tokens=40,
            temperature=0)
        spec = reply.model_extra["metrics"]["speculative_decoding"]
        assert_spec_consistent(spec)
        assert spec["num_accepted_draft_tokens"] > 0 and len(spec["by_source"]) >= 2, spec
        assert_exported_consistent(httpx.get(srv.url + "/metrics").text)
    finally:
        srv.close()
