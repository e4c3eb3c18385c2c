"""End-to-end on the bundled SmolLM2-135M-Instruct (slow: a minute or two on 2 cores)."""
import pytest
import torch

import exactspec as es

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
]
NEW_TOKENS = 32


def chat_ids(loaded, prompt):
    encoded = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   add_generation_prompt=True, return_tensors="pt")
    return getattr(encoded, "input_ids", encoded)


@pytest.fixture(scope="module")
def greedy_references(bundled_pair):
    """Transformers' own greedy decoding of each prompt (EOS allowed to end it)."""
    target, _ = bundled_pair
    refs = []
    for prompt in PROMPTS:
        ids = chat_ids(target, prompt)
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, pad_token_id=2)
        refs.append((ids, out[0].tolist()))
    return refs


def test_bundled_plain_greedy_matches_transformers(bundled_pair, greedy_references):
    target, _ = bundled_pair
    for ids, expected in greedy_references:
        out = es.autoregressive_generate(target, ids, max_new_tokens=NEW_TOKENS, temperature=0)
        assert out.sequences[0].tolist() == expected


@pytest.mark.parametrize("gamma", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["bfloat16", "ngram"])
def test_bundled_speculative_greedy_matches_transformers(bundled_pair, greedy_references, gamma,
                                                         drafter):
    target, draft = bundled_pair
    draft = draft if drafter == "bfloat16" else "ngram"
    for ids, expected in greedy_references:
        out = es.speculative_generate(target, draft, ids, gamma=gamma, max_new_tokens=NEW_TOKENS,
                                      temperature=0)
        assert out.sequences[0].tolist() == expected
        if drafter == "bfloat16":
            assert out.stats.acceptance_rate > 0.5  # the self-draft agrees most of the time


def test_bundled_sampling_is_seeded(bundled_pair):
    target, draft = bundled_pair
    ids = chat_ids(target, PROMPTS[0])
    runs = [es.speculative_generate(target, draft, ids, gamma=4, max_new_tokens=24,
                                    temperature=0.8, seed=3) for _ in range(2)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.accepted_drafts > 0


@pytest.mark.parametrize("drafter", ["bfloat16", "ngram"])
def test_bundled_batch_greedy_matches_each_row_alone(bundled_pair, greedy_references, drafter):
    """Prompts of different lengths in one left-padded batch: each row is token for token what
    Transformers' greedy decoding gives that prompt alone."""
    target, draft = bundled_pair
    rows = [ids[0] for ids, _ in greedy_references]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    out = es.speculative_generate(target, draft if drafter == "bfloat16" else "ngram", ids,
                                  attention_mask=mask, gamma=4, max_new_tokens=NEW_TOKENS,
                                  temperature=0)
    for sequence, (_, expected) in zip(out.sequences, greedy_references):
        assert sequence.tolist() == expected
