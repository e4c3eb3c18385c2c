"""`load_model("llamacpp:...", prompt_cache=True)`: a generation resumes the KV cache the previous
one left where the tokens begin its prompt (a chat's next turn), and feeds only the rest.

On the bundled model ``@invariant`` (Q4_1: no product of its changes kernels with a decode's
size there) a token's logits do not depend on the decodes that cached its prefix, so a resumed
prompt must score bit for bit as a fresh one: that is the check that the cache keeps exactly
the shared prefix (a stale cell past it would be attended to).
"""
from __future__ import annotations

import gc

import pytest
import torch

from exactspec.engine import speculative_generate
from exactspec.models import encode_prompt, load_model

pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed (make setup builds it)")
from exactspec.targets import LlamaCppTarget  # noqa: E402

pytestmark = pytest.mark.slow

SPEC = "llamacpp:smollm2-135m-instruct@invariant"
FIRST = "Name three rivers of Europe, one line each, then repeat the list."


@pytest.fixture(scope="module")
def cached():
    return load_model(SPEC, prompt_cache=True)


@pytest.fixture(scope="module")
def fresh(cached):
    model = load_model(SPEC)
    assert model.model.gguf is cached.model.gguf  # one file, one set of idle contexts
    return model


def prefill(model, ids: torch.Tensor, keep: int = 0) -> tuple[torch.Tensor, int]:
    """A target's prefill of ids[1, n] (logits as `LlamaCppTarget.prefill` returns them) and the
    tokens it fed; the target is freed, its context left for the next one."""
    target = LlamaCppTarget(model.model, model.name, model.vocab_size)
    logits = target.prefill(ids, torch.ones_like(ids, dtype=torch.bool), keep)
    fed = target.tokens_fed
    del target
    gc.collect()
    return logits, fed


def first_turn(model) -> torch.Tensor:
    ids = encode_prompt(model, FIRST)
    out = speculative_generate(model, "ngram", ids, gamma=3, max_new_tokens=40, temperature=0.0)
    gc.collect()  # the target's context goes back to the model, its rows cached
    return out.sequences


def second_turn(model, first: torch.Tensor) -> torch.Tensor:
    return torch.cat([first, encode_prompt(model, "Now name two more.")], dim=1)


def test_a_next_turn_feeds_only_its_new_tokens_and_scores_as_a_fresh_prompt(cached, fresh):
    first = first_turn(cached)
    turn = second_turn(cached, first)
    resumed, fed = prefill(cached, turn)
    assert fed == turn.size(1) - first.size(1) + 1  # turn 1's last token was never fed
    cold, fed_cold = prefill(fresh, turn)
    assert fed_cold == turn.size(1)
    assert torch.equal(resumed, cold)


def test_a_prompt_that_leaves_the_cached_tokens_keeps_only_the_shared_prefix(cached, fresh):
    first = first_turn(cached)
    other = first.clone()
    other[0, -20:] = torch.arange(300, 320)  # the last 20 tokens differ from the cached ones
    resumed, fed = prefill(cached, other)
    assert fed == 20
    cold, _ = prefill(fresh, other)
    assert torch.equal(resumed, cold)


def test_the_same_prompt_again_feeds_its_last_token_or_its_drafts(cached, fresh):
    ids = encode_prompt(cached, FIRST)
    prefill(cached, ids)
    again, fed = prefill(cached, ids)
    assert fed == 1
    with_drafts, fed = prefill(cached, ids, keep=3)  # a prompt and a first round's 2 drafts
    assert fed == 3 and with_drafts.shape == (1, 3, cached.vocab_size)
    cold, _ = prefill(fresh, ids, keep=3)
    assert torch.equal(again, cold[:, -1]) and torch.equal(with_drafts, cold)


def test_a_seed_names_the_same_text_with_the_cache_and_without(cached, fresh):
    first = first_turn(cached)
    turn = second_turn(cached, first)
    settings = dict(gamma=3, max_new_tokens=40, temperature=1.0, seed=7)
    resumed = speculative_generate(cached, "ngram", turn, **settings).sequences
    gc.collect()
    cold = speculative_generate(fresh, "ngram", turn, **settings).sequences
    assert torch.equal(resumed, cold)


def test_a_model_without_the_cache_empties_what_an_earlier_one_left(cached, fresh):
    first_turn(cached)
    ids = encode_prompt(fresh, FIRST)
    _, fed = prefill(fresh, ids)
    assert fed == ids.size(1)


def test_only_a_llama_cpp_target_keeps_a_prompt_cache():
    with pytest.raises(ValueError, match="prompt_cache=True: only a llama.cpp target"):
        load_model("smollm2-135m-instruct", prompt_cache=True)


def test_rows_of_a_batch_resume_what_begins_their_own_prompts(cached, fresh):
    first = first_turn(cached)
    turn = second_turn(cached, first)
    other = encode_prompt(cached, "Something else entirely, please.")
    width = max(turn.size(1), other.size(1))
    ids = torch.zeros(2, width, dtype=torch.long)
    valid = torch.zeros(2, width, dtype=torch.bool)
    for row, prompt in enumerate([other, turn]):  # left-padded
        ids[row, width - prompt.size(1):], valid[row, width - prompt.size(1):] = prompt[0], True
    target = LlamaCppTarget(cached.model, cached.name, cached.vocab_size)
    resumed = target.prefill(ids, valid)
    assert [len(fed) for fed in target.rows.fed] == [other.size(1), turn.size(1)]
    fed = target.tokens_fed
    del target
    gc.collect()
    assert fed < other.size(1) + turn.size(1) - first.size(1) + 2  # the second row resumed
    for row, prompt in enumerate([other, turn]):
        assert torch.equal(resumed[row], prefill(fresh, prompt)[0][0])


def test_a_generation_that_feeds_nothing_keeps_the_cache_for_the_next(cached):
    first = first_turn(cached)
    speculative_generate(cached, "ngram", first, gamma=3, max_new_tokens=0)
    gc.collect()
    _, fed = prefill(cached, second_turn(cached, first))
    assert fed < second_turn(cached, first).size(1) - first.size(1) + 2
