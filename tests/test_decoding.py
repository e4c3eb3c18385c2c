"""The decoding engine on tiny random-weight models: greedy identity, distribution identity,
cache reuse, budgets, EOS and bad input."""
import itertools

import pytest
import torch

import exactspec as es
from exactspec.drafters import ModelDrafter, NGramDrafter
from conftest import ALPHA, chi_square_pvalue, first_tokens, make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 5, 9, 5], [1, 20, 21, 22, 20, 21], [1, 7]]


def ids(tokens):
    return torch.tensor([tokens])


def hf_greedy(model, prompt, n):
    """Transformers' own greedy decoding of n tokens, not stopping at EOS."""
    model.generation_config.eos_token_id = None  # the tiny models are built afresh per test
    out = model.generate(ids(prompt), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, pad_token_id=2)
    assert out.size(1) == len(prompt) + n
    return out[0].tolist()


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("verify", ["token", "block"])
def test_greedy_speculative_matches_target_greedy(tiny_pair, gamma, verify):
    target, draft = tiny_pair
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 24)
        plain = es.autoregressive_generate(target, ids(prompt), max_new_tokens=24, temperature=0,
                                           eos_token_id=[])
        assert plain.sequences[0].tolist() == expected
        for drafter in (draft, NGramDrafter()):
            out = es.speculative_generate(target, drafter, ids(prompt), gamma=gamma,
                                          max_new_tokens=24, temperature=0, eos_token_id=[],
                                          verify=verify)
            assert out.sequences[0].tolist() == expected


# --------------------------------------------------------------------------- distribution


def target_joint(target, prompt, length, sampling):
    """Exact P(first `length` tokens) under the target's decoding distribution, by enumeration
    (each level of the tree in one batched forward pass). Returns {tokens: probability}."""
    joint = {(): 1.0}
    for _ in range(length):
        prefixes = [k for k, v in joint.items() if v > 0]
        batch = torch.tensor([prompt + list(k) for k in prefixes])
        with torch.no_grad():
            probs = sampling.probs(target(batch).logits[:, -1].double())  # [N, V]
        joint = {k + (t,): joint[k] * probs[i, t].item()
                 for i, k in enumerate(prefixes) for t in range(probs.size(1))}
    return joint


# The random tiny target is flat (largest probability ≈ 0.15), so the n-gram cases sample at a
# lower temperature, with a prompt whose lookup proposes tokens the target likes: that way drafts
# are often accepted and the test exercises both the accept and the correction paths.
NGRAM_PROMPT = [1, 4, 3, 10, 7, 24, 28, 30, 3]  # suffix [3] proposes [10, 7]
CASES = [
    ("model", PROMPTS[2], dict(temperature=1.0)),
    ("model", PROMPTS[2], dict(temperature=0.7, top_k=8)),
    ("model", PROMPTS[2], dict(temperature=1.3, top_p=0.8)),
    ("ngram", NGRAM_PROMPT, dict(temperature=0.5)),
    ("ngram", NGRAM_PROMPT, dict(temperature=0.5, top_k=6)),
    ("ngram", NGRAM_PROMPT, dict(temperature=0.6, top_p=0.7)),
]


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("drafter_kind, prompt, settings", CASES,
                         ids=["model-T1", "model-topk", "model-topp", "ngram-T.5", "ngram-topk",
                              "ngram-topp"])
def test_speculative_sampling_matches_target_joint(tiny_pair, drafter_kind, prompt, settings,
                                                   verify):
    """The first 2 tokens of 1,200 speculative samplings (γ = 2, 3 new tokens; 6 batches of 200
    rows) follow the target's exact joint distribution (chi-square, α = 1e-6)."""
    target, draft = tiny_pair
    joint = target_joint(target, prompt, 2, es.SamplingConfig(**settings))
    drafter = draft if drafter_kind == "model" else NGramDrafter()
    counts, accepted = first_tokens(lambda batch, seed: es.speculative_generate(
        target, drafter, batch, gamma=2, max_new_tokens=3, seed=seed, eos_token_id=[],
        verify=verify, **settings), prompt)
    assert accepted > 100  # drafts were really kept, so the test exercises acceptance
    assert chi_square_pvalue(counts, joint) > ALPHA


# --------------------------------------------------------------------------- cache and counters


def test_cache_is_cut_back_after_each_round(tiny_pair, monkeypatch):
    """With one row, discarding the rejected drafts crops the cache (no holes remain), and the
    target's cache ends each round holding the committed sequence minus its last token."""
    from exactspec.cache import CachedModel

    target, draft = tiny_pair
    seen, original = [], CachedModel.discard_last

    def discard_last(self, counts):
        original(self, counts)
        seen.append((self.model is target, self.length, bool(self.valid.all())))

    monkeypatch.setattr(CachedModel, "discard_last", discard_last)
    lengths = []
    out = es.speculative_generate(target, draft, ids(PROMPTS[2]), gamma=4, max_new_tokens=30,
                                  seed=1, eos_token_id=[], on_tokens=lambda _row, new: lengths.append(len(new)))
    assert seen and all(no_holes for _, _, no_holes in seen)
    committed = len(PROMPTS[2]) + torch.tensor(lengths).cumsum(0)
    target_lengths = [length for is_target, length, _ in seen if is_target]
    assert target_lengths == (committed - 1).tolist()
    assert out.stats.corrections > 0


def record_feeds(monkeypatch):
    """Record (model, cache length before, tokens fed) for every forward pass."""
    from exactspec.cache import CachedModel

    feeds, original = [], CachedModel._run

    def run(self, tokens, valid, **kwargs):
        feeds.append((self.model, self.length, tokens.size(1)))
        return original(self, tokens, valid, **kwargs)

    monkeypatch.setattr(CachedModel, "_run", run)
    return feeds


def test_caches_are_reused_and_cut_back(tiny_pair, monkeypatch):
    """Target and draft: the whole prompt once, the target's in one pass with the first round's
    γ' drafts, then γ'+1 tokens per later round; the draft only what it has not seen (the
    correction, or its last draft and the bonus) and one token per further proposal. No
    recomputation."""
    target, draft = tiny_pair
    feeds = record_feeds(monkeypatch)
    prompt, n = PROMPTS[1], 40
    out = es.speculative_generate(target, draft, ids(prompt), gamma=3, max_new_tokens=n,
                                  seed=0, eos_token_id=[], verify="token")
    s = out.stats
    assert s.output_tokens == n == s.accepted_drafts + s.corrections + s.bonus_tokens
    assert s.corrections > 0 and s.bonus_tokens > 0  # both paths were taken
    target_sizes = [size for model, _, size in feeds if model is target]
    assert target_sizes[0] == len(prompt) + 3
    assert len(target_sizes) == s.target_calls == s.rounds
    assert sum(target_sizes) == s.target_tokens_fed == len(prompt) + s.drafted_tokens + s.rounds - 1
    draft_sizes = [size for model, _, size in feeds if model is draft]
    assert draft_sizes[0] == len(prompt)
    assert set(draft_sizes[1:]) <= {1, 2}
    assert draft_sizes.count(2) <= s.bonus_tokens  # a 2-token catch-up follows each bonus
    # the prefill, then one pass per drafted token but the very first (scored by the prefill)
    assert len(draft_sizes) == s.draft_calls == s.drafted_tokens
    assert sum(draft_sizes) == s.draft_tokens_fed
    row = out.row_stats[0]  # one row: its counters are the batch's
    assert (row.target_calls, row.draft_calls, row.rounds) == (s.target_calls, s.draft_calls, s.rounds)
    final_cache = {model: length + size for model, length, size in feeds}
    assert final_cache[target] <= len(prompt) + n  # cropped back: never longer than the sequence


def test_max_new_tokens_is_never_exceeded(tiny_pair):
    target, draft = tiny_pair
    for n in (0, 1, 2, 5, 17):
        out = es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=8, max_new_tokens=n,
                                      seed=n, eos_token_id=[])
        assert out.sequences.size(1) == len(PROMPTS[0]) + n
        assert out.stats.output_tokens == n


def test_eos_inside_a_block_ends_the_row(tiny_pair):
    target, draft = tiny_pair
    prompt = PROMPTS[0]
    greedy = hf_greedy(target, prompt, 20)[len(prompt):]
    eos = greedy[5]  # a token the target emits at step 6
    out = es.speculative_generate(target, draft, ids(prompt), gamma=8, max_new_tokens=20,
                                  temperature=0, eos_token_id=eos)
    new = out.sequences[0, len(prompt):].tolist()
    assert new == greedy[: greedy.index(eos) + 1]
    assert out.stats.output_tokens == len(new)


def test_same_seed_same_output(tiny_pair):
    target, draft = tiny_pair
    runs = [es.speculative_generate(target, draft, ids(PROMPTS[1]), gamma=3, max_new_tokens=20,
                                    seed=42).sequences for _ in range(2)]
    assert torch.equal(*runs)
    plain = [es.autoregressive_generate(target, ids(PROMPTS[1]), max_new_tokens=20,
                                        seed=42).sequences for _ in range(2)]
    assert torch.equal(*plain)


@pytest.mark.parametrize("rule, expected", [("latest", [9, 4, 5]), ("earliest", [7, 8, 4])])
def test_ngram_drafter_proposes_earlier_continuation(rule, expected):
    from exactspec.drafters.ngram import SuffixIndex

    drafter = NGramDrafter(max_ngram=3, rule=rule)
    index = SuffixIndex([4, 5, 6, 7, 8, 4, 5, 6, 9, 4, 5, 6], max_n=3)
    assert drafter.lookup(index, 3) == expected  # the longest suffix, [4, 5, 6], matched earlier
    assert drafter.lookup(SuffixIndex([1, 2, 3], 3), 3) == []
    assert drafter.lookup(SuffixIndex([3, 1, 2, 3], 3), 5) == [1, 2, 3]  # what followed, up to γ
    assert drafter.lookup(SuffixIndex([3, 1, 2, 3], 3), 2) == [1, 2]


def test_a_one_token_match_is_a_source_of_its_own():
    """The controller keeps α per source: a lookup whose longest match (over the rows) is one
    token is "ngram-1", a longer one "ngram"."""
    from exactspec.drafters.ngram import ONE_TOKEN_MATCH

    drafter = NGramDrafter()
    ones = torch.ones(2, 4, dtype=torch.bool)
    drafter.start(torch.tensor([[3, 1, 2, 3], [5, 6, 7, 8]]), ones, 10)
    assert drafter.next_source() == ONE_TOKEN_MATCH
    drafter.start(torch.tensor([[3, 1, 2, 3], [6, 7, 6, 7]]), ones, 10)
    assert drafter.next_source() == "ngram"


def test_prompt_lookup_scores_itself_against_each_committed_token():
    """Before each committed token (drafted or not), the token the lookup would have proposed
    there is compared with it, per source and row; the prompt itself is not scored."""
    from exactspec.drafters.ngram import ONE_TOKEN_MATCH

    drafter = NGramDrafter()
    drafter.start(torch.tensor([[1, 2, 3, 1, 2], [7, 8, 9, 9, 9]]), torch.ones(2, 5, dtype=torch.bool), 10)
    assert drafter.evidence() == {"ngram": [(0, 0), (0, 0)], ONE_TOKEN_MATCH: [(0, 0), (0, 0)]}
    # row 0 commits 3 ([1, 2] matched: 3 proposed, a hit), then 4 ([1, 2, 3] matched: 1, a miss);
    # row 1 commits 8 ([9, 9] matched: 9, a miss)
    drafter.observe(torch.tensor([[3, 0], [5, 0]]), torch.tensor([1, 0]), torch.tensor([4, 8]))
    assert drafter.evidence() == {"ngram": [(1, 1), (0, 1)], ONE_TOKEN_MATCH: [(0, 0), (0, 0)]}
    drafter.observe(torch.tensor([[0], [0]]), torch.tensor([0, 0]), torch.tensor([5, 9]))
    # row 0: [4] never occurred before, no lookup; row 1: [8] matched once: 9 proposed, a hit
    assert drafter.evidence() == {"ngram": [(0, 0), (0, 0)], ONE_TOKEN_MATCH: [(0, 0), (1, 0)]}
    drafter.select(torch.tensor([1]))
    drafter.observe(torch.tensor([[0]]), torch.tensor([0]), torch.tensor([9]))
    assert drafter.evidence() == {"ngram": [(1, 0)], ONE_TOKEN_MATCH: [(0, 0)]}


def test_suffix_index_matches_brute_force_as_it_grows():
    """Built token by token, the index finds the same longest earlier match as a scan of the
    whole context, for both rules."""
    from exactspec.drafters.ngram import SuffixIndex

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (200,), generator=gen).tolist()
    index = SuffixIndex(tokens[:1], max_n=6)
    for length in range(2, len(tokens) + 1):
        index.extend(tokens[length - 1:length])
        seq = tokens[:length]
        for rule in ("earliest", "latest"):
            assert index.lookup(1, rule) == brute_force_match(seq, 6, rule)


def brute_force_match(seq: list[int], max_n: int, rule: str):
    for n in range(min(max_n, len(seq) - 1), 0, -1):
        ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1:e + 1] == seq[-n:]]
        if ends:
            return n, ends[0] if rule == "earliest" else ends[-1]
    return 0, None


def test_padded_embeddings_get_zero_probability(tiny_tokenizer):
    """Target and draft with output layers padded past the 32-token vocabulary never emit a
    padding id."""
    from exactspec.models import LoadedModel

    target = LoadedModel(make_tiny_llama(0, vocab_size=40), tiny_tokenizer, "t", torch.float32,
                         torch.device("cpu"))
    draft = LoadedModel(make_tiny_llama(1, vocab_size=48, num_layers=1), tiny_tokenizer, "d",
                        torch.float32, torch.device("cpu"))
    for seed in range(5):
        out = es.speculative_generate(target, draft, ids(PROMPTS[2]), gamma=4, max_new_tokens=30,
                                      seed=seed, temperature=1.5, eos_token_id=[])
        assert out.sequences.max() < 32


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, message", [
    (dict(gamma=0), r"gamma must be an integer in \[1, 32\] or 'auto', got 0"),
    (dict(gamma=33), r"gamma must be an integer in \[1, 32\] or 'auto', got 33"),
    (dict(max_new_tokens=-1), r"max_new_tokens must be an integer >= 0, got -1"),
    (dict(temperature=-1.0), r"temperature must be a finite number >= 0, got -1.0"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=0), r"top_k must be an integer >= 1 or None, got 0"),
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), r"the prompt is empty"),
    (dict(max_new_tokens=200), r"exceeds the context window .* \(128 tokens\)"),
    (dict(verify="tree"), r"verify must be one of"),
])
def test_bad_input_names_itself(tiny_pair, kwargs, message):
    target, draft = tiny_pair
    args = dict(input_ids=ids(PROMPTS[0]), gamma=4, max_new_tokens=5) | kwargs
    with pytest.raises(ValueError, match=message):
        es.speculative_generate(target, draft, args.pop("input_ids"), **args)


def test_incompatible_vocabularies_are_refused(tiny_pair, tiny_tokenizer):
    from conftest import make_tiny_tokenizer
    from exactspec.models import LoadedModel

    target, draft = tiny_pair
    cpu = torch.device("cpu")
    other = make_tiny_tokenizer(prefix="v")
    from exactspec.drafters import TLIDrafter

    with pytest.raises(ValueError, match="vocabular"):  # the intersection needs shared tokens
        es.speculative_generate(LoadedModel(target, tiny_tokenizer, "t", torch.float32, cpu),
                                TLIDrafter(LoadedModel(draft, other, "d", torch.float32, cpu)),
                                ids(PROMPTS[0]), gamma=2, max_new_tokens=3)
    with pytest.raises(ValueError, match="output sizes differ: 32 vs 40"):
        es.speculative_generate(target, make_tiny_llama(1, vocab_size=40), ids(PROMPTS[0]),
                                gamma=2, max_new_tokens=3)


def test_nan_logits_name_the_model_and_position(tiny_pair):
    target, draft = tiny_pair
    draft.lm_head.weight.data[5] = float("nan")  # a broken output row: NaN logits everywhere
    with pytest.raises(ValueError, match=r"model .* produced NaN or \+inf logits at position 5"):
        es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=2, max_new_tokens=3)


def test_finite_checks_pass_what_may_pass_and_name_what_may_not():
    """`check_finite`'s one-sum fast path lets through only logits the full checks pass: -inf
    for some tokens and finite logits whose sum overflows are fine; NaN, +inf, or -inf for
    every token of a valid slot raise, at a padded slot they do not."""
    from exactspec.cache import check_finite

    valid, positions = torch.tensor([[True, False]]), torch.tensor([[7, 8]])
    fine = torch.zeros(1, 2, 4)
    fine[0, 0, 1] = float("-inf")
    fine[0, 1] = float("nan")  # the padded slot
    check_finite(fine, valid, positions, "m")
    check_finite(torch.full((1, 2, 4), 3e38), valid, positions, "m")  # sum: +inf, each finite
    for bad, what in ((float("nan"), "NaN or \\+inf"), (float("inf"), "NaN or \\+inf")):
        logits = torch.zeros(1, 2, 4)
        logits[0, 0, 2] = bad
        with pytest.raises(ValueError, match=f"model 'm' produced {what} logits at position 7"):
            check_finite(logits, valid, positions, "m")
    with pytest.raises(ValueError, match="-inf logits for every token at position 7"):
        check_finite(torch.full((1, 2, 4), float("-inf")), valid, positions, "m")


def test_plain_decoding_makes_one_pass_per_token(tiny_pair):
    """The prefill's logits give the first token: n tokens cost n target passes, like
    Transformers' generate()."""
    target, _ = tiny_pair
    out = es.autoregressive_generate(target, ids(PROMPTS[0]), max_new_tokens=10, eos_token_id=[])
    assert out.stats.target_calls == 10
    assert out.stats.target_tokens_fed == len(PROMPTS[0]) + 9
