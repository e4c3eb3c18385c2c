"""A draft whose vocabulary differs from the target's, drafting through the token-level
intersection (`exactspec.drafters.tli`, `exactspec.models.vocab_map`).

Two tiny BPE tokenizers over the same letters overlap only in part: the target's is byte-level
('Ġ' for a space) and merges a+b, c+d, Ġ+a, ab+c, Ġ+ab; the draft's is SentencePiece-like ('▁')
and merges b+c, ▁+a, a+bc, d+e, ▁+b. So "abc" is one token on both sides but "ab", "cd" are the
target's alone, "bc", "de", " b" the draft's alone. Checked: the map; one round of the real
drafter, enumerated in float64, keeps the target's joint law to 1e-12 (sampled and greedy, γ
1–3, both verification rules); whole generations by chi-square; a broken placement of q goes
red; the API and the CLI draft with such a pair instead of refusing it.
"""
import itertools

import pytest
import torch

import exactspec as es
from conftest import ALPHA, chi_square_pvalue, first_tokens, make_tiny_llama
from exactspec.drafters import TLIDrafter, make_drafter
from exactspec.models import LoadedModel
from exactspec.models.vocab_map import VocabMap, intersect
from exactspec.sampling import SamplingConfig
from exactspec.verify import next_token_weights, stop_distribution

pytestmark = pytest.mark.usefixtures("one_thread")

SPECIALS = ("<unk>", "<s>", "</s>")
TARGET_TOKENS = (*SPECIALS, *"abcde", "Ġ", "ab", "Ġa", "cd", "abc", "Ġab")
TARGET_MERGES = [("a", "b"), ("Ġ", "a"), ("c", "d"), ("ab", "c"), ("Ġ", "ab")]
DRAFT_TOKENS = (*SPECIALS, *"abcde", "▁", "bc", "▁a", "abc", "de", "▁b")
DRAFT_MERGES = [("b", "c"), ("▁", "a"), ("a", "bc"), ("d", "e"), ("▁", "b")]
VT, VD = len(TARGET_TOKENS), len(DRAFT_TOKENS)
SHARED_TEXTS = {"a", "b", "c", "d", "e", " ", " a", "abc"}
PROMPT_TEXT = "abc a"
CPU = torch.device("cpu")


def make_tokenizer(tokens, merges, byte_level: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                   unk_token="<unk>"))
    if byte_level:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
        backend.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")


T_TOK = make_tokenizer(TARGET_TOKENS, TARGET_MERGES, byte_level=True)
D_TOK = make_tokenizer(DRAFT_TOKENS, DRAFT_MERGES, byte_level=False)
PROMPT = T_TOK.encode(PROMPT_TEXT)


def loaded_pair(dtype=torch.float32):
    target = make_tiny_llama(0, vocab_size=VT, num_layers=2, dtype=dtype)
    draft = make_tiny_llama(1, vocab_size=VD, num_layers=1, dtype=dtype)
    return (LoadedModel(target, T_TOK, "tiny-bytelevel", dtype, CPU),
            LoadedModel(draft, D_TOK, "tiny-metaspace", dtype, CPU))


# --------------------------------------------------------------------------- the map


def test_the_map_pairs_tokens_by_their_text_in_context():
    """'Ġ' and '▁' spaces pair up; specials and one-sided merges are left out; the map is one
    to one; a committed target token the draft lacks is fed as the draft's spelling of it."""
    vmap = intersect(T_TOK, D_TOK)
    pairs = [(T_TOK.convert_ids_to_tokens(t), D_TOK.convert_ids_to_tokens(d))
             for t, d in zip(vmap.target_ids.tolist(), vmap.draft_ids.tolist())]
    expected = [(c, c) for c in "abcde"] + [("Ġ", "▁"), ("Ġa", "▁a"), ("abc", "abc")]
    assert sorted(pairs) == sorted(expected)
    assert {vmap.texts[t] for t in vmap.target_ids.tolist()} == SHARED_TEXTS
    committed = T_TOK.encode("abcde ab a")  # ['abc', 'd', 'e', 'Ġab', 'Ġa']
    assert D_TOK.decode(vmap.to_draft(committed)) == "abcde ab a"
    assert D_TOK.convert_ids_to_tokens(vmap.to_draft([TARGET_TOKENS.index("cd")])) == ["c", "d"]


def test_a_pair_without_enough_shared_tokens_is_refused_with_the_reason():
    from conftest import make_tiny_tokenizer

    target = LoadedModel(make_tiny_llama(0), make_tiny_tokenizer(), "t", torch.float32, CPU)
    draft = LoadedModel(make_tiny_llama(1), make_tiny_tokenizer(prefix="v"), "d", torch.float32, CPU)
    with pytest.raises(ValueError, match=r"different vocabularies .*token id 3 is 'w0' .*'v0'.*"
                                         r"token-level intersection holds 0 of the draft's 29 ordinary"):
        es.speculative_generate(target, TLIDrafter(draft), torch.tensor([[1, 5]]), gamma=2,
                                max_new_tokens=2)
    out = es.speculative_generate(target, draft, torch.tensor([[1, 5]]), gamma=2, max_new_tokens=2,
                                  seed=0, eos_token_id=[])
    assert out.sequences.shape == (1, 4)  # string-level drafts (the default) serve any pair


# --------------------------------------------------------------------------- enumeration in float64


class Scripted:
    """Stands in for `sample` in the model draft: proposes the scripted target tokens (as draft
    ids) and keeps the last distribution it was asked to sample from, read at the target's ids
    through the pairs of the map (not through the code under test that places q)."""

    def __init__(self, vmap: VocabMap, script):
        self.draft_of, self.script, self.calls = vmap.draft_of, list(script), 0

    def __call__(self, q, generator=None):
        self.sampled = torch.zeros(VT, dtype=q.dtype)  # [V_t]
        for t, d in self.draft_of.items():
            self.sampled[t] = q[0, d]
        if self.calls == len(self.script):  # past the script: any token q allows
            return q[0].nonzero()[0]
        self.calls += 1
        return torch.tensor([self.draft_of[self.script[self.calls - 1]]])


class Round:
    """One library round after PROMPT with the float64 pair, enumerated: q from the real
    `TLIDrafter` (sampling scripted), τ's exact law and the next token's weights from
    `exactspec.verify`, then the target alone for the rest of γ+1 tokens."""

    def __init__(self, monkeypatch, settings, verify):
        self.target, self.draft = loaded_pair(torch.float64)
        self.sampling, self.verify, self.monkeypatch = SamplingConfig(**settings), verify, monkeypatch
        self.logits, self.qs = {}, {}  # p and q by prefix

    def p(self, prefix) -> torch.Tensor:
        if prefix not in self.logits:
            logits = self.target.model(torch.tensor([PROMPT + list(prefix)])).logits[:, -1]  # [1, V]
            self.logits[prefix] = self.sampling.probs(logits)[0]  # [V]
        return self.logits[prefix]

    def q(self, block, sampled: bool = False) -> torch.Tensor:
        """The q the drafter reports after it drafted `block` (target ids), or the one it
        sampled from (`Scripted`): [V_t]; the two are the same law when the drafter is right."""
        if block not in self.qs:
            drafter = TLIDrafter(self.draft)
            vocab = drafter.bind(self.target, 64)
            script = Scripted(drafter.map, block)
            self.monkeypatch.setattr("exactspec.drafters.model.sample", script)
            ids = torch.tensor([PROMPT])
            drafter.start(ids, torch.ones_like(ids, dtype=torch.bool), vocab)
            proposal = drafter.propose(len(block) + 1, self.sampling, None)
            assert proposal.tokens[0, :-1].tolist() == list(block)
            self.qs[block] = proposal.q[0, -1], script.sampled
        return self.qs[block][sampled]

    def blocks(self, gamma):
        """Every draft block with its probability under what the drafter sampled from."""
        found = [((), 1.0)]
        for _ in range(gamma):
            found = [(block + (x,), w * self.q(block, True)[x].item()) for block, w in found
                     for x in self.q(block, True).nonzero().flatten().tolist()]
        return found

    def law(self, gamma) -> dict:
        """{γ+1 tokens: probability}: the round's emitted tokens, then the target's."""
        dist = {}
        for emitted, chance in self.round_law(gamma).items():
            for seq, rest in self.target_law(emitted, gamma + 1).items():
                dist[seq] = dist.get(seq, 0.0) + chance * rest
        return dist

    def round_law(self, gamma) -> dict:
        """{the tokens one round emits: probability}."""
        law = {}
        for block, weight in self.blocks(gamma):
            tokens = torch.tensor([block])  # [1, γ]
            q = torch.stack([self.q(block[:i]) for i in range(gamma)]).unsqueeze(0)  # [1, γ, V]
            p = torch.stack([self.p(block[:i]) for i in range(gamma + 1)]).unsqueeze(0)  # [1, γ+1, V]
            stop = stop_distribution(tokens, q, p, self.verify)[0]  # [γ+1]
            for tau in range(gamma + 1):
                nxt = next_token_weights(tokens, q, p, torch.tensor([tau]), self.verify)[0]  # [V]
                for y in nxt.nonzero().flatten().tolist():
                    emitted = block[:tau] + (y,)
                    chance = weight * stop[tau].item() * (nxt[y] / nxt.sum()).item()
                    law[emitted] = law.get(emitted, 0.0) + chance
        return law

    def target_law(self, prefix, length) -> dict:
        """{sequence of `length` tokens starting with prefix: P(the rest | prefix)} under p."""
        law = {tuple(prefix): 1.0}
        for _ in range(length - len(prefix)):
            law = {seq + (y,): w * self.p(seq)[y].item() for seq, w in law.items()
                   for y in self.p(seq).nonzero().flatten().tolist()}
        return law


SETTINGS = {"T1": dict(temperature=1.0), "T0.8-top5": dict(temperature=0.8, top_k=5),
            "greedy": dict(temperature=0.0)}


def worst_gap(monkeypatch, settings, verify, gamma):
    with torch.no_grad():
        enumerated = Round(monkeypatch, SETTINGS[settings], verify)
        got, want = enumerated.law(gamma), enumerated.target_law((), gamma + 1)
    return max(abs(got.get(k, 0.0) - want.get(k, 0.0)) for k in got.keys() | want.keys())


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("gamma", [1, 2, 3])
@pytest.mark.parametrize("settings", sorted(SETTINGS))
def test_a_round_keeps_the_target_law_exactly(monkeypatch, settings, gamma, verify):
    """One round of the TLI draft, then the target: the joint of the next γ+1 tokens equals
    the target's to 1e-12."""
    assert worst_gap(monkeypatch, settings, verify, gamma) < 1e-12


def swapped_placement(vmap: VocabMap, probs: torch.Tensor) -> torch.Tensor:
    """A broken map: q placed at the target's ids with two of them swapped (the drafts are
    still mapped right), so the q reported is not the q sampled from."""
    ids = vmap.target_ids.clone()
    ids[[0, 1]] = ids[[1, 0]]
    out = probs.new_zeros((*probs.shape[:-1], vmap.target_size))
    out[..., ids] = probs[..., vmap.draft_ids]
    return out


def unnormalized_placement(vmap: VocabMap, probs: torch.Tensor) -> torch.Tensor:
    """A broken map: q scaled as if renormalized over more than the intersection."""
    return PLACE(vmap, probs) * 0.9


PLACE = VocabMap.probs_to_target  # the placement under test, kept before it is patched


@pytest.mark.parametrize("broken", [swapped_placement, unnormalized_placement])
def test_a_broken_map_is_detected(monkeypatch, broken):
    """The same enumeration goes red: a wrong placement shows a gap, an unnormalized q is
    refused by the verifier."""
    monkeypatch.setattr(VocabMap, "probs_to_target", broken)
    try:
        gap = worst_gap(monkeypatch, "T1", "token", 2)
    except ValueError as err:
        assert "must sum to 1" in str(err)
    else:
        assert gap > 1e-3


# --------------------------------------------------------------------------- whole generations


def test_generations_follow_the_target_law():
    """The first 2 tokens of speculative sampling (γ = 2, 3 new tokens) with the TLI draft follow
    the target's exact joint (chi-square at α = 1e-6 over 1,200 rows, 6 batches of 200 with seeds
    0..5: a false failure once in a million runs of a changed test, never for this fixed one)."""
    target, draft = loaded_pair()
    drafter = TLIDrafter(draft)
    sampling = SamplingConfig(temperature=1.0)
    with torch.no_grad():
        first = sampling.probs(target.model(torch.tensor([PROMPT])).logits[:, -1].double())[0]  # [V]
        after = torch.tensor([PROMPT + [y] for y in range(VT)])  # [V, L+1]
        second = sampling.probs(target.model(after).logits[:, -1].double())  # [V, V]
    joint = {(x, y): first[x].item() * second[x, y].item()
             for x, y in itertools.product(range(VT), repeat=2)}
    counts, accepted = first_tokens(lambda batch, seed: es.speculative_generate(
        target, drafter, batch, gamma=2, max_new_tokens=3, seed=seed, eos_token_id=[]), PROMPT)
    assert accepted > 100  # drafts were really kept, so acceptance is exercised
    assert chi_square_pvalue(counts, joint) > ALPHA


def test_greedy_output_is_the_targets_row_by_row():
    """Greedy speculative decoding of a batch whose rows spell their tokens with different
    numbers of draft tokens (holes in the draft's pending columns) emits each row's plain
    greedy tokens."""
    from exactspec.engine import pad_prompts

    target, draft = loaded_pair()
    prompts = [T_TOK.encode(text) for text in ("abc a", "cd ab cd", "e")]
    ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    plain = [es.autoregressive_generate(target, torch.tensor([p]), max_new_tokens=12, temperature=0,
                                        eos_token_id=[]).sequences[0, len(p):].tolist() for p in prompts]
    for gamma in (1, 3):
        out = es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=gamma,
                                      max_new_tokens=12, temperature=0, eos_token_id=[])
        assert [[int(t) for t in row][-12:] for row in out.sequences] == plain


# --------------------------------------------------------------------------- API and CLI


def test_the_api_drafts_with_a_cross_vocabulary_pair(tmp_path):
    """A draft of another vocabulary drafts as string-level drafts by default
    (`test_string_drafts`), through the intersection when named "tli:SPEC"."""
    from exactspec.drafters import StringDrafter

    target, draft = loaded_pair()
    assert isinstance(make_drafter(draft, target=target), StringDrafter)
    draft.model.save_pretrained(tmp_path)
    draft.tokenizer.save_pretrained(tmp_path)
    drafter = make_drafter(f"tli:{tmp_path}", target=target)
    assert type(drafter) is TLIDrafter
    out = es.speculative_generate(target, drafter, torch.tensor([PROMPT, PROMPT]), gamma=3,
                                  max_new_tokens=8, seed=0, eos_token_id=[])
    assert drafter.method == f"token-level intersection: 8 of the target's {VT} tokens can be drafted"
    assert out.stats.drafted_tokens > 0


def test_prompt_lookup_and_the_tli_draft_take_turns():
    """As the model draft of `auto`: the rounds prompt lookup drafts reach the TLI draft's
    context as its own ids (`observe`); greedy output stays the target's."""
    from exactspec.drafters import AutoDrafter

    target, draft = loaded_pair()
    prompt = T_TOK.encode("abc a abc a abc a")
    plain = es.autoregressive_generate(target, torch.tensor([prompt]), max_new_tokens=16,
                                       temperature=0, eos_token_id=[])
    drafter = AutoDrafter(TLIDrafter(draft), min_match=1)
    out = es.speculative_generate(target, drafter, torch.tensor([prompt]), gamma=2,
                                  max_new_tokens=16, temperature=0, eos_token_id=[])
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert "model" in out.stats.by_source and "ngram" in out.stats.by_source


def test_the_cli_drafts_with_a_cross_vocabulary_pair(tmp_path, capsys):
    from exactspec.cli import main

    target, draft = loaded_pair()
    for name, loaded in (("target", target), ("draft", draft)):
        loaded.model.save_pretrained(tmp_path / name)
        loaded.tokenizer.save_pretrained(tmp_path / name)
    code = main(["generate", PROMPT_TEXT, "--target", str(tmp_path / "target"), "--draft",
                 f"tli:{tmp_path / 'draft'}", "--no-chat", "--max-new-tokens", "6", "--gamma", "2",
                 "--seed", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "token-level intersection: 8 of the target's 14 tokens can be drafted" in err
    assert '"drafted_tokens"' in out


def test_the_bench_runs_transformers_generators_for_another_vocabulary():
    """Transformers' rows with such a pair pass both tokenizers: greedy runs its
    AssistedCandidateGeneratorDifferentTokenizers, sampling its UniversalSpeculativeDecodingGenerator,
    which prunes its assistant's output layer in place, so the bench gives it a copy and the
    draft exactspec's rows use stays whole."""
    from exactspec.bench.config import BenchConfig, BenchPrompt
    from exactspec.bench.run import run_benchmark

    target, _ = loaded_pair()
    # Transformers tells tokenizers apart by the models' vocabulary sizes: the draft's is padded
    draft = LoadedModel(make_tiny_llama(1, vocab_size=VD + 2, num_layers=1), D_TOK, "tiny-metaspace",
                        torch.float32, CPU)
    head = draft.model.get_output_embeddings().weight.clone()
    timings = {"context_tokens": 8, "target": [{"tokens": n, "seconds": 0.04 + 0.005 * n} for n in range(1, 10)],
               "drafts": {"draft": {"seconds_per_token": 0.01, "measured_as": "fake"}}}
    config = BenchConfig(target="target", drafts=["draft"], gammas=[2], temperatures=[0.0, 1.0],
                         prompts=[BenchPrompt("a", "open", PROMPT_TEXT)], max_new_tokens=6, repeats=1,
                         warmup=1, peers=True, llama_peers=False)
    rows = run_benchmark(config, models={"target": target, "draft": draft}, timings=timings, log=None)["rows"]
    assisted = {(row["temperature"], row["gamma"]): row for row in rows if row["method"] == "hf_assisted"}
    assert assisted[(0.0, 2)]["peer_settings"]["generator"] == "AssistedCandidateGeneratorDifferentTokenizers"
    assert assisted[(1.0, 2)]["peer_settings"]["generator"] == "UniversalSpeculativeDecodingGenerator"
    assert assisted[(0.0, 2)]["matches_autoregressive"]
    assert torch.equal(draft.model.get_output_embeddings().weight, head)


def test_the_bench_times_a_draft_of_another_vocabulary_on_its_own_ids(monkeypatch):
    """The cost model's draft timing feeds the draft the context's text in its own ids."""
    from exactspec.bench import timing
    from exactspec.models.vocab_map import encode_text

    target, draft = loaded_pair()
    context, fed, real = torch.tensor([T_TOK.encode("cd ab cd ab cd")]), [], timing.time_forward
    monkeypatch.setattr(timing, "time_forward", lambda model, ids, ns: fed.append(ids) or real(model, ids, ns))
    timings = timing.measure_timings(target, {"draft": draft}, context, max_gamma=1)
    assert timings["drafts"]["draft"]["seconds_per_token"] > 0
    assert fed[-1][0].tolist() == encode_text(D_TOK, "cd ab cd ab cd") != context[0].tolist()
