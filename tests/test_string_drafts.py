"""A draft of another vocabulary drafting text (`exactspec.drafters.strings`): its greedy text,
encoded by the target's tokenizer, proposed as point-mass drafts.

The pair is `test_cross_vocab`'s: two tiny BPE tokenizers that share 8 of 14 tokens and split
words differently ("ab" and "cd" are the target's alone, "bc", "de" and " b" the draft's alone),
so the draft's text reaches the target in tokens the draft cannot spell one by one. Checked: one
round of the real drafter after several prompts, enumerated in float64, keeps the target's joint
law to 1e-12 (sampled and greedy, γ 1–3, both rules); the same drafts reported as sampled from a
spread q go red; whole generations by chi-square; greedy output row by row; the draft's context
spells the committed text after every round; the spec, `auto`, the CLI, the bench and the server.
"""
import pytest
import torch

import exactspec as es
from conftest import ALPHA, chi_square_pvalue, first_tokens, round_ends
from exactspec.drafters import AutoDrafter, StringDrafter, make_drafter
from exactspec.drafters.base import Proposal
from exactspec.engine import pad_prompts
from exactspec.sampling import SamplingConfig
from test_cross_vocab import D_TOK, PROMPT, PROMPT_TEXT, SETTINGS, T_TOK, VT, loaded_pair

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ("abc a", "cd ab cd", "e", "ab cde b", "a bc")  # contexts whose drafts differ


def started(target, draft, prompt: list[int]) -> StringDrafter:
    drafter = StringDrafter(draft)
    vocab = drafter.bind(target, 64)
    ids = torch.tensor([prompt])
    drafter.start(ids, torch.ones_like(ids, dtype=torch.bool), vocab)
    return drafter


class Enumerated:
    """One round of the real drafter after `prompt` with the float64 pair, then the target alone
    up to γ + 1 tokens: the exact law of those tokens, from `exactspec.verify`."""

    def __init__(self, prompt: list[int], settings: dict, verify: str):
        self.target, self.draft = loaded_pair(torch.float64)
        self.prompt, self.verify, self.sampling = prompt, verify, SamplingConfig(**settings)
        self.cache = {}

    def p(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self.cache:
            logits = self.target.model(torch.tensor([self.prompt + list(prefix)])).logits[:, -1]
            self.cache[prefix] = self.sampling.probs(logits)[0]  # [V]
        return self.cache[prefix]

    def proposal(self, gamma: int) -> Proposal:
        return started(self.target, self.draft, self.prompt).propose(gamma, self.sampling, None)

    def law(self, gamma: int, proposal: Proposal) -> dict:
        block = tuple(proposal.tokens[0, :proposal.lengths[0]].tolist())
        tokens = torch.tensor([block], dtype=torch.long).view(1, len(block))  # [1, k]
        p = torch.stack([self.p(block[:i]) for i in range(len(block) + 1)]).unsqueeze(0)  # [1, k+1, V]
        q = proposal.q[:, :len(block)] if proposal.q is not None else None
        law = {}
        for chance, emitted in round_ends(block, 1.0, tokens, q, p, self.verify):
            for seq, rest in self.target_law(emitted, gamma + 1).items():
                law[seq] = law.get(seq, 0.0) + chance * rest
        return law

    def target_law(self, prefix: tuple, length: int) -> dict:
        law = {tuple(prefix): 1.0}
        for _ in range(length - len(prefix)):
            law = {seq + (y,): w * self.p(seq)[y].item() for seq, w in law.items()
                   for y in self.p(seq).nonzero().flatten().tolist()}
        return law


def worst_gap(settings: str, verify: str, gamma: int, report=lambda proposal: proposal):
    """The largest gap between one round's law and the target's over the TEXTS prompts, and how
    many target tokens were proposed in all (`report`: what the drafter hands the verifier)."""
    gaps, proposed = [], 0
    with torch.no_grad():
        for text in TEXTS:
            enumerated = Enumerated(T_TOK.encode(text), SETTINGS[settings], verify)
            proposal = report(enumerated.proposal(gamma))
            got, want = enumerated.law(gamma, proposal), enumerated.target_law((), gamma + 1)
            gaps.append(max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in got.keys() | want.keys()))
            proposed += proposal.lengths[0]
    return max(gaps), proposed


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_a_round_keeps_the_target_law_exactly(settings, gamma, verify):
    gap, proposed = worst_gap(settings, verify, gamma)
    assert proposed >= gamma  # drafts were proposed, so the rule ran on them
    assert gap < 1e-12


def spread_q(proposal: Proposal) -> Proposal:
    """A broken report: the same drafts as if sampled from a uniform q (the token rule's
    min(1, p/q)), not as the point masses they are."""
    batch, width = proposal.tokens.shape
    q = torch.full((batch, width, VT), 1.0 / VT, dtype=torch.float64)  # [B, γ', V]
    return Proposal(proposal.tokens, q, proposal.lengths)


def test_drafts_reported_as_sampled_from_a_spread_q_go_red():
    gap, _ = worst_gap("T1", "token", 2, report=spread_q)
    assert gap > 1e-3


def test_generations_follow_the_target_law():
    """The first 2 tokens of 1,200 generations (γ = 2, 3 new tokens, T = 1) against the target's
    exact joint: chi-square at α = 1e-6 (a false failure once in a million runs of a changed
    test, never for this fixed one)."""
    target, draft = loaded_pair()
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        first = sampling.probs(target.model(torch.tensor([PROMPT])).logits[:, -1].double())[0]  # [V]
        after = torch.tensor([PROMPT + [y] for y in range(VT)])  # [V, L+1]
        second = sampling.probs(target.model(after).logits[:, -1].double())  # [V, V]
    joint = {(x, y): first[x].item() * second[x, y].item() for x in range(VT) for y in range(VT)}
    drafter = StringDrafter(draft)
    counts, accepted = first_tokens(lambda batch, seed: es.speculative_generate(
        target, drafter, batch, gamma=2, max_new_tokens=3, seed=seed, eos_token_id=[]), PROMPT)
    assert accepted > 100  # drafts were kept, so acceptance is exercised
    assert chi_square_pvalue(counts, joint) > ALPHA


class Spelled(StringDrafter):
    """The real drafter, keeping each row's context on both sides: the target's committed tokens,
    and the draft's ids as its own draft is told to hold them (what `commit` hands it)."""

    def start(self, input_ids, valid, vocab_size):
        super().start(input_ids, valid, vocab_size)
        self.target_side = [row[ok].tolist() for row, ok in zip(input_ids, valid)]
        tokens, ok = self._prompts(input_ids, valid)
        self.draft_side = [row[v].tolist() for row, v in zip(tokens, ok)]

    def commit(self, num_accepted, next_tokens):
        told, commit = [], self.inner.commit
        self.inner.commit = lambda kept, tokens, valid: (told.append((kept, tokens, valid)),
                                                         commit(kept, tokens, valid))
        try:
            super().commit(num_accepted, next_tokens)
        finally:
            del self.inner.commit
        kept, tokens, valid = told[0]
        for b, (written, proposed) in enumerate(zip(self.written, self.drafts.tolist())):
            self.draft_side[b] += written[:kept[b]] + tokens[b][valid[b]].tolist()
            self.target_side[b] += proposed[:num_accepted[b]] + [int(next_tokens[b])]


def test_the_drafts_context_spells_the_committed_text_after_every_round():
    """Whatever was kept or rejected, at T = 1 and greedy, the draft's context decodes to the
    target's committed text (its cache rolled back and re-fed at the boundary)."""
    target, draft = loaded_pair()
    ids, mask = pad_prompts([torch.tensor(T_TOK.encode(text)) for text in TEXTS])
    for temperature in (1.0, 0.0):
        drafter = Spelled(draft)
        out = es.speculative_generate(target, drafter, ids, attention_mask=mask, gamma=3,
                                      max_new_tokens=24, seed=0, temperature=temperature,
                                      eos_token_id=[])
        assert out.stats.accepted_drafts > 0 and out.stats.corrections > 0
        for draft_ids, target_ids in zip(drafter.draft_side, drafter.target_side):
            assert D_TOK.decode(draft_ids) == T_TOK.decode(target_ids)


def test_greedy_output_is_the_targets_row_by_row():
    """Rows of different lengths, γ 1–4: each row's tokens are plain greedy decoding's."""
    target, draft = loaded_pair()
    prompts = [T_TOK.encode(text) for text in TEXTS]
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    plain = [es.autoregressive_generate(target, torch.tensor([p]), max_new_tokens=16, temperature=0,
                                        eos_token_id=[]).sequences[0, len(p):].tolist() for p in prompts]
    for gamma in (1, 2, 4):
        drafter = StringDrafter(draft)
        out = es.speculative_generate(target, drafter, ids, attention_mask=mask, gamma=gamma,
                                      max_new_tokens=16, temperature=0, eos_token_id=[])
        assert [[int(t) for t in row][-16:] for row in out.sequences] == plain
        assert out.stats.accepted_drafts > 0


def test_prompt_lookup_and_string_drafts_take_turns():
    """As the model draft of `auto`: the rounds prompt lookup drafts reach the draft's context
    as text (`observe`); greedy output stays the target's."""
    target, draft = loaded_pair()
    prompt = T_TOK.encode("abc a abc a abc a")
    plain = es.autoregressive_generate(target, torch.tensor([prompt]), max_new_tokens=16,
                                       temperature=0, eos_token_id=[])
    out = es.speculative_generate(target, AutoDrafter(StringDrafter(draft), min_match=1),
                                  torch.tensor([prompt]), gamma=2, max_new_tokens=16, temperature=0,
                                  eos_token_id=[])
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert "model" in out.stats.by_source and "ngram" in out.stats.by_source


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    where = tmp_path_factory.mktemp("pair")
    for name, loaded in zip(("target", "draft"), loaded_pair()):
        loaded.model.save_pretrained(where / name)
        loaded.tokenizer.save_pretrained(where / name)
    return where


def test_the_spec_string_names_string_drafts(saved_pair):
    target, _ = loaded_pair()
    drafter = make_drafter(f"string:{saved_pair / 'draft'}", target=target)
    assert isinstance(drafter, StringDrafter)
    drafter.bind(target, 64)
    assert drafter.method.startswith("string-level")
    with pytest.raises(ValueError, match="draft 'string:' needs a model"):
        make_drafter("string:", target=target)


def test_the_cli_drafts_text_with_a_cross_vocabulary_pair(saved_pair, capsys):
    from exactspec.cli import main

    code = main(["generate", PROMPT_TEXT, "--target", str(saved_pair / "target"), "--draft",
                 f"string:{saved_pair / 'draft'}", "--no-chat", "--max-new-tokens", "6",
                 "--gamma", "2", "--seed", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "string-level: the draft's text in the target's tokens" in err
    assert '"drafted_tokens"' in out


def test_the_bench_runs_and_times_string_drafts():
    """A bench row for "string:SPEC" (its drafter restarted per generation, its cost per drafted
    token timed through the drafter contract); greedy rows match plain decoding."""
    from exactspec.bench.config import BenchConfig, BenchPrompt
    from exactspec.bench.run import run_benchmark

    target, draft = loaded_pair()
    config = BenchConfig(target="target", drafts=["string:draft"], gammas=[2], temperatures=[0.0],
                         prompts=[BenchPrompt("a", "open", PROMPT_TEXT)], max_new_tokens=8, repeats=1,
                         warmup=1, peers=False, llama_peers=False)
    out = run_benchmark(config, models={"target": target, "draft": draft}, log=None)
    row = next(row for row in out["rows"] if row["method"] == "speculative")
    assert row["draft"] == "string:draft" and row["matches_autoregressive"]
    assert out["costmodel"]["timings"]["drafts"]["string:draft"]["seconds_per_token"] > 0


def test_the_server_drafts_text_for_a_cross_vocabulary_pair(saved_pair, capsys):
    """`exactspec serve --draft string:SPEC`: each batch gets its own copy of the drafter, and a
    greedy completion is plain decoding's."""
    pytest.importorskip("fastapi")
    from exactspec.serve.app import ServeConfig
    from test_serve import Server, generate_cli

    target = str(saved_pair / "target")
    plain = generate_cli(capsys, target, "none", PROMPT_TEXT, "--no-chat")
    srv = Server(ServeConfig(target=target, draft=f"string:{saved_pair / 'draft'}", gamma=2,
                             model_name="tiny"))
    try:
        for _ in range(2):  # a second batch gets a fresh copy
            completion = srv.client.completions.create(model="tiny", prompt=PROMPT_TEXT, max_tokens=12,
                                                       temperature=0)
            assert completion.choices[0].text == plain
    finally:
        srv.close()
