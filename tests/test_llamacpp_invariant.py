"""`llamacpp:NAME@invariant`: a llama.cpp target whose logits for a token do not depend on the
size of the decode that scored it, so greedy (and coupled) speculative output is plain decoding's
token for token, whatever the draft and γ — not only up to near-ties.

The default target is not so: past 256 cached tokens llama.cpp splits a one-token decode's
attention over threads (an f16 cache of 512 cells or more), and its products change kernels with
the decode's size; the first test shows that difference, the second that the option removes it.
The split needs two threads, so these targets run on two whatever the test worker's count.
"""
from __future__ import annotations

import pytest
import torch

from exactspec.engine import autoregressive_generate, speculative_generate
from exactspec.models import encode_prompt, load_model

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make setup builds it)")
from exactspec.models.llamacpp import INVARIANT_TOKENS  # noqa: E402
from exactspec.targets import LlamaCppTarget  # noqa: E402

pytestmark = pytest.mark.slow

CONTEXT = 300  # cached tokens: past 256, where a one-token decode's attention is split
# a prompt lookup finds and a long generation follows (drafts at every γ)
TEXT = "Repeat this list twice, then continue it: " + ", ".join(
    f"item {i} is {word}" for i, word in enumerate("apple pear plum fig kiwi lime lemon peach".split() * 5))


THREADS = 2  # a one-thread decode's attention is not split


def on_two_threads(spec: str):
    model = load_model(spec)
    model.model.n_threads = THREADS
    return model


@pytest.fixture(scope="module")
def invariant():
    return on_two_threads("llamacpp:smollm2-135m-instruct@invariant")


def one_and_many(model, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of k tokens after a CONTEXT-token prompt, fed one a decode and in one pass
    ([k, V] each)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(100, 20000, (1, CONTEXT + k), generator=generator)
    target = LlamaCppTarget(model.model, model.name, model.vocab_size)
    target.prefill(tokens[:, :CONTEXT], torch.ones(1, CONTEXT, dtype=torch.bool))
    one = torch.cat([target.feed(tokens[:, CONTEXT + i: CONTEXT + i + 1]) for i in range(k)], dim=1)
    target.discard_last(torch.tensor([k]))
    return one[0], target.feed(tokens[:, CONTEXT:])[0]


def test_the_default_targets_logits_depend_on_the_decodes_size():
    one, many = one_and_many(on_two_threads("llamacpp:smollm2-135m-instruct"), 2)
    assert (one - many).abs().max() > 1e-3, "llama.cpp became size-invariant: @invariant may be unneeded"


@pytest.mark.parametrize("k", [2, INVARIANT_TOKENS, INVARIANT_TOKENS + 2])
def test_an_invariant_targets_logits_do_not(invariant, k):
    one, many = one_and_many(invariant, k)
    assert torch.equal(one, many), f"k={k}: max difference {(one - many).abs().max():.3g}"


@pytest.fixture(scope="module")
def greedy(invariant):
    """The prompt and its plain greedy decoding."""
    prompt = encode_prompt(invariant, TEXT)
    assert prompt.size(1) > 256  # past 256 cached tokens, where the default target splits
    return prompt, autoregressive_generate(invariant, prompt, max_new_tokens=48, temperature=0)


@pytest.mark.parametrize("draft, gamma", [("ngram", 9), ("llamacpp", 3)])
def test_greedy_speculative_output_is_plain_decodings_token_for_token(invariant, greedy, draft, gamma):
    prompt, plain = greedy
    out = speculative_generate(invariant, draft, prompt, gamma=gamma, max_new_tokens=48, temperature=0)
    assert out.stats.drafted_tokens > 0
    assert out.sequences.tolist() == plain.sequences.tolist()


def test_a_seed_names_plain_decodings_text_under_the_coupled_rule(invariant):
    prompt = encode_prompt(invariant, TEXT)
    plain = autoregressive_generate(invariant, prompt, max_new_tokens=32, temperature=0.8, seed=3)
    out = speculative_generate(invariant, "ngram", prompt, gamma=9, max_new_tokens=32,
                               temperature=0.8, seed=3, verify="coupled")
    assert out.stats.drafted_tokens > 0
    assert out.sequences.tolist() == plain.sequences.tolist()


def test_the_spec_names_the_option_and_refuses_others(invariant):
    assert invariant.spec == "llamacpp:smollm2-135m-instruct@invariant"
    assert load_model(invariant.spec).model.invariant
    with pytest.raises(ValueError, match="takes no dtype; its one option is @invariant"):
        load_model("llamacpp:smollm2-135m-instruct@float16")
