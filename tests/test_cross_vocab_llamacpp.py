"""A llama.cpp draft whose vocabulary differs from the target's: as string-level drafts by
default (`StringDrafter` around a `LlamaCppDrafter`), as the bundled 135M GGUF does for the real
pair's 1.5B, or through the token-level intersection ("tli:llamacpp:PATH", `TLIDrafter`).

The pair: a tiny random GGUF as the llama.cpp target (the bundled model's tokenizer), and as the
draft the same kind of model written under renumbered tokens (ids 17.. reversed, specials kept;
its embeddings larger, so q differs from p): the vocabularies differ id for id and agree text
for text, so the intersection is large and drafts are kept and rejected alike. The rule is the
one `test_cross_vocab` enumerates (q placed in the target's vocabulary, `InDraftVocab`); here
whole generations follow the llama.cpp target's joint law by chi-square, and greedy output is
plain decoding's on rows whose tokens the draft spells with several of its own, both ways.
"""
from __future__ import annotations

import pytest
import torch

from conftest import ALPHA, chi_square_pvalue, write_tiny_gguf
from exactspec.engine import autoregressive_generate, speculative_generate
from exactspec.models import BUNDLED_MODEL, LoadedModel, load_model
from exactspec.models.loading import gguf_path
from exactspec.sampling import SamplingConfig

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make setup builds it)")
from exactspec.drafters import StringDrafter, TLIDrafter, make_drafter  # noqa: E402
from exactspec.drafters.llamacpp import LlamaCppDrafter  # noqa: E402
from exactspec.models.llamacpp import LlamaCppModel  # noqa: E402
from test_llamacpp import as_lists, batch  # noqa: E402
from test_llamacpp_target import SMALL_BATCH, TINY_REPEATING, assert_rows_alike, llama_joint  # noqa: E402

pytestmark = pytest.mark.slow

SPECIALS = 17  # the bundled tokenizer's special ids, 0..16, keep their numbers


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny random GGUF run by llama.cpp, with the bundled model's tokenizer."""
    bundled = load_model(f"llamacpp:{BUNDLED_MODEL}")
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "target.gguf", gguf_path(BUNDLED_MODEL),
                           logit_scale=2.5)
    return LoadedModel(model=LlamaCppModel(path, "tiny"), tokenizer=bundled.tokenizer, name="tiny",
                       dtype=torch.float32, device=torch.device("cpu"), backend="llamacpp")


@pytest.fixture(scope="module")
def renumbered(tmp_path_factory, target):
    """The draft's GGUF: the target's weights under renumbered tokens, embeddings 2.4 times larger."""
    size = len(target.tokenizer)
    order = list(range(SPECIALS)) + list(range(size - 1, SPECIALS - 1, -1))
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "renumbered.gguf", gguf_path(BUNDLED_MODEL),
                           logit_scale=6.0, order=order)


def test_a_gguf_of_another_vocabulary_drafts_text_or_through_the_intersection(target, renumbered):
    drafter = make_drafter(f"tli:llamacpp:{renumbered}", target=target)
    assert type(drafter) is TLIDrafter and isinstance(drafter.inner, LlamaCppDrafter)
    assert isinstance(make_drafter(f"llamacpp:{renumbered}", target=target), StringDrafter)
    drafter.bind(target, 64)
    assert drafter.map.draft_ids[:3].tolist() != drafter.map.target_ids[:3].tolist()
    assert len(drafter.map) > 0.9 * len(target.tokenizer), drafter.method
    assert isinstance(make_drafter(f"llamacpp:{target.model.path}", target=target), LlamaCppDrafter)


def test_whole_generations_follow_the_llama_cpp_target(target, renumbered):
    """The first 2 new tokens of 1,200 generations (150 batches of 8 rows, γ = 3, T = 1, top-k 3)
    against the joint law enumerated from llama.cpp's logits; false-failure rate 1e-6."""
    settings, counts, kept, corrections = dict(temperature=1.0, top_k=3), {}, 0, 0
    ids, mask = batch([TINY_REPEATING] * SMALL_BATCH)
    drafter = make_drafter(f"tli:llamacpp:{renumbered}", target=target)
    for seed in range(150):
        out = speculative_generate(target, drafter, ids, attention_mask=mask, gamma=3,
                                   max_new_tokens=2, seed=seed, eos_token_id=[], **settings)
        kept, corrections = kept + out.stats.accepted_drafts, corrections + out.stats.corrections
        for row in as_lists(out.sequences):
            key = tuple(row[len(TINY_REPEATING):])
            counts[key] = counts.get(key, 0) + 1
    assert kept > 100 and corrections > 100  # drafts were kept and rejected: both paths ran
    joint = llama_joint(target, TINY_REPEATING, 2, SamplingConfig(**settings))
    assert chi_square_pvalue(counts, joint) > ALPHA


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("method", ["tli:", ""])
def test_greedy_output_is_plain_decodings(target, renumbered, gamma, method):
    """Rows of different lengths, whose text the draft's tokenizer spells with its own tokens,
    through the intersection and as string-level drafts (`StringDrafter`): each row is plain
    greedy decoding's (or parts at a near-tie, `assert_rows_alike`)."""
    texts = ("def add(a, b):\n    return", "Hello, my name is", "1, 2, 3, 4,")
    prompts = [target.tokenizer.encode(text) for text in texts]
    plain = [as_lists(autoregressive_generate(target, torch.tensor([p]), max_new_tokens=16,
                                              temperature=0, eos_token_id=[]).sequences)[0] for p in prompts]
    ids, mask = batch(prompts)
    drafter = make_drafter(f"{method}llamacpp:{renumbered}", target=target)
    assert isinstance(drafter, StringDrafter) == (method == "")
    out = speculative_generate(target, drafter, ids,
                               attention_mask=mask, gamma=gamma, max_new_tokens=16, temperature=0,
                               eos_token_id=[])
    rows = [row[-(len(p) + 16):] for row, p in zip(as_lists(out.sequences), prompts)]
    assert out.stats.accepted_drafts > 0
    assert_rows_alike(target, rows, plain)
