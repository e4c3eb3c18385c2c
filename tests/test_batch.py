"""Batched speculative decoding: rows of different prompt lengths, ragged acceptance, still exact
per row."""
import pytest
import torch

import exactspec as es
from exactspec.drafters import NGramDrafter
from exactspec.sampling import SamplingConfig
from test_decoding import ALPHA, chi_square_pvalue, hf_greedy, target_joint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 9, 5, 9, 5, 9], [1, 7], [1, 20, 21, 22, 20]]


def near_copy(model, noise=0.3, seed=0):
    """The target with a perturbed output layer: a draft that agrees often but not always, so
    rows keep different numbers of drafts even at temperature 0."""
    import copy

    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    weight = draft.lm_head.weight
    weight.add_(noise * weight.std() * torch.randn(weight.shape, generator=gen))
    return draft


def padded(prompts, side="left", pad=0):
    """input_ids[B, L] and attention_mask[B, L] of prompts padded on one side."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, cols], mask[row, cols] = torch.tensor(prompt), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_batch_greedy_matches_each_row_alone(tiny_pair, side, gamma):
    target, draft = tiny_pair
    ids, mask = padded(PROMPTS, side)
    expected = [hf_greedy(target, prompt, 20) for prompt in PROMPTS]
    plain = es.autoregressive_generate(target, ids, attention_mask=mask, max_new_tokens=20,
                                       temperature=0, eos_token_id=[])
    assert [row.tolist() for row in plain.sequences] == expected
    for drafter in (draft, near_copy(target), NGramDrafter()):
        out = es.speculative_generate(target, drafter, ids, attention_mask=mask, gamma=gamma,
                                      max_new_tokens=20, temperature=0, eos_token_id=[])
        assert [row.tolist() for row in out.sequences] == expected
        assert [s.output_tokens for s in out.row_stats] == [20, 20, 20]


def test_batch_rows_accept_different_numbers(tiny_pair):
    """Ragged acceptance really happens, holes are masked, and rows still match alone."""
    target, _ = tiny_pair
    ids, mask = padded(PROMPTS * 2)
    out = es.speculative_generate(target, near_copy(target), ids, attention_mask=mask, gamma=4,
                                  max_new_tokens=40, temperature=0, eos_token_id=[])
    accepted = {s.accepted_drafts for s in out.row_stats[:3]}
    assert len(accepted) > 1 and min(accepted) > 0
    for row, prompt in enumerate(PROMPTS * 2):
        assert out.sequences[row].tolist() == hf_greedy(target, prompt, 40)
    total = out.stats
    assert total.output_tokens == sum(s.output_tokens for s in out.row_stats) == 240
    assert total.output_tokens == total.accepted_drafts + total.corrections + total.bonus_tokens


def test_batch_rows_end_early_and_leave_the_batch(tiny_pair, monkeypatch):
    """A row that hits EOS stops; the others go on; later passes no longer include it."""
    from exactspec.cache import CachedModel

    target, draft = tiny_pair
    greedy = [hf_greedy(target, prompt, 30)[len(prompt):] for prompt in PROMPTS]
    eos = greedy[1][3]  # row 1 emits it at step 4
    batch_sizes, original = [], CachedModel.feed

    def feed(self, tokens, valid=None):
        batch_sizes.append(tokens.size(0))
        return original(self, tokens, valid)

    monkeypatch.setattr(CachedModel, "feed", feed)
    ids, mask = padded(PROMPTS)
    out = es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=3,
                                  max_new_tokens=30, temperature=0, eos_token_id=eos)
    assert isinstance(out.sequences, list)
    for row, prompt in enumerate(PROMPTS):
        new = out.sequences[row][len(prompt):].tolist()
        cut = greedy[row].index(eos) + 1 if eos in greedy[row] else 30
        assert new == greedy[row][:cut]
    assert min(batch_sizes) < len(PROMPTS)


def test_batch_is_seeded(tiny_pair):
    target, draft = tiny_pair
    ids, mask = padded(PROMPTS)
    runs = [es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=3,
                                    max_new_tokens=15, seed=9, eos_token_id=[]) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(runs[0].sequences, runs[1].sequences))


@pytest.mark.parametrize("verify", ["token", "block"])
def test_batch_sampling_matches_target_joint_per_row(tiny_pair, verify):
    """Two prompts of different lengths, 150 copies each per batch: the first 2 tokens of each
    row follow that prompt's exact joint distribution (chi-square, α = 1e-6 per prompt)."""
    target, draft = tiny_pair
    prompts, copies = [PROMPTS[1], PROMPTS[2]], 150
    ids, mask = padded([p for p in prompts for _ in range(copies)])
    counts = [{}, {}]
    for seed in range(8):
        out = es.speculative_generate(target, draft, ids, attention_mask=mask, gamma=2,
                                      max_new_tokens=3, seed=seed, eos_token_id=[], verify=verify)
        for row, seq in enumerate(out.sequences):
            which = row // copies
            key = tuple(seq[len(prompts[which]): len(prompts[which]) + 2].tolist())
            counts[which][key] = counts[which].get(key, 0) + 1
    for which, prompt in enumerate(prompts):
        joint = target_joint(target, prompt, 2, SamplingConfig())
        assert chi_square_pvalue(counts[which], joint) > ALPHA


def test_compaction_keeps_rows_exact(tiny_pair):
    """Long ragged runs compact the cache (holes squeezed out) without changing any row."""
    from exactspec.cache import CachedModel

    target, draft = tiny_pair
    calls, original = [], CachedModel.compact

    def compact(self):
        calls.append(self.length)
        original(self)

    CachedModel.compact = compact
    try:
        ids, mask = padded(PROMPTS)
        out = es.speculative_generate(target, near_copy(target), ids, attention_mask=mask,
                                      gamma=8, max_new_tokens=60, temperature=0, eos_token_id=[])
    finally:
        CachedModel.compact = original
    assert calls
    for row, prompt in enumerate(PROMPTS):
        assert out.sequences[row].tolist() == hf_greedy(target, prompt, 60)
