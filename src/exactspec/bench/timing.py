"""The measured cost model's inputs, timed directly: the target's forward pass over 1..γ+1 new
tokens and each draft's cost per token, on a KV cache that holds a realistic context. An auto
draft has no single cost per token (its rounds are lookups or model drafts): it is not timed."""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

import torch

from exactspec.bench.config import NGRAM, is_auto_draft
from exactspec.drafters import is_llamacpp_spec, other_vocabulary_method
from exactspec.engine import synchronize


def context_from_prompts(prompt_ids: list[torch.Tensor], length: int) -> torch.Tensor:
    """A [1, length] context made of the prompts' tokens (repeated as needed)."""
    pool = torch.cat([ids[0] for ids in prompt_ids])
    reps = -(-length // pool.numel())
    return pool.repeat(reps)[:length].view(1, -1)


@torch.inference_mode()
def time_forward(loaded, context_ids: torch.Tensor, sizes: Iterable[int], *, repeats: int = 5,
                 warmup: int = 2) -> dict[int, float]:
    """Median seconds of one forward pass over n new tokens on a KV cache that holds
    `context_ids` [1, L], for each n in `sizes` (the engine's own target, `exactspec.targets`:
    its `feed`, cut back after each pass). Sizes are interleaved within each repeat, so noise
    spreads evenly."""
    from exactspec.models import unwrap_model, usable_vocab
    from exactspec.targets import make_target

    model, tokenizer, name = unwrap_model(loaded)
    lm = make_target(model, name, usable_vocab((model, tokenizer)), 1)
    with lm.threads():
        return _time_feeds(lm, context_ids.to(lm.device), sorted(set(sizes)), repeats, warmup)


def _time_feeds(lm, context_ids: torch.Tensor, sizes: list[int], repeats: int, warmup: int) -> dict:
    device = lm.device
    lm.prefill(context_ids[:, :-1], torch.ones_like(context_ids[:, :-1], dtype=torch.bool))
    new = context_ids[:, -1:].repeat(1, max(sizes))  # [1, n_max] any real token ids will do
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for i in range(warmup + repeats):
        for n in sizes:
            synchronize(device)
            start = time.perf_counter()
            lm.feed(new[:, :n])
            synchronize(device)
            if i >= warmup:
                times[n].append(time.perf_counter() - start)
            lm.discard_last(torch.tensor([n]))  # back to the context
    return {n: statistics.median(ts) for n, ts in times.items()}


def time_ngram_draft(context_ids: torch.Tensor, gamma: int, *, repeats: int = 50) -> float:
    """Median seconds per drafted token of the n-gram drafter: one round's proposal (one lookup)
    on `context_ids` [1, L], through the drafter contract (`start`, then `propose`), divided by γ."""
    from exactspec.drafters import NGramDrafter
    from exactspec.sampling import SamplingConfig

    drafter = NGramDrafter()
    drafter.start(context_ids, torch.ones_like(context_ids, dtype=torch.bool), 0)
    sampling = SamplingConfig()  # a point-mass draft: the settings are not read
    times = []
    for _ in range(repeats + 5):
        start = time.perf_counter()
        drafter.propose(gamma, sampling, None)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) / gamma


def measure_timings(target, drafts: dict, context_ids: torch.Tensor, max_gamma: int,
                    log: Callable[[str], None] = lambda _m: None) -> dict:
    """The cost model's inputs, timed directly: the target's pass over n = 1..max_gamma+1 tokens
    and each draft's cost per token, on a cache of len(context_ids) tokens (auto drafts left out)."""
    log(f"timing the target's forward pass on a {context_ids.size(1)}-token cache "
        f"(1..{max_gamma + 1} new tokens) ...")
    target_times = time_forward(target, context_ids, range(1, max_gamma + 2))
    out = {"context_tokens": int(context_ids.size(1)),
           "target": [{"tokens": n, "seconds": s} for n, s in sorted(target_times.items())],
           "drafts": {}}
    for spec, draft in drafts.items():
        if is_auto_draft(spec):
            continue
        if draft == NGRAM:
            seconds, how = time_ngram_draft(context_ids, 4), "one n-gram lookup (γ = 4) / 4"
        elif is_llamacpp_spec(spec) or other_vocabulary_method(spec):
            log(f"timing the draft {spec} ...")
            seconds = time_drafter(draft, target, context_ids, 4)
            how = "one proposal after a round that kept its drafts (γ = 4) / 4"
        else:
            log(f"timing the draft {spec} ...")
            own = _draft_ids(target, draft, context_ids)
            seconds, how = time_forward(draft, own, [1])[1], "forward pass, 1 token"
        out["drafts"][spec] = {"seconds_per_token": seconds, "measured_as": how}
    return out


def _draft_ids(target, draft, context_ids: torch.Tensor) -> torch.Tensor:
    """The context [1, L] in the draft's ids: the same text encoded by its tokenizer when its
    vocabulary differs from the target's (`pair_method`)."""
    from exactspec.models import INTERSECTION, pair_method
    from exactspec.models.vocab_map import encode_text

    if pair_method(target, draft) != INTERSECTION:
        return context_ids
    text = target.tokenizer.decode(context_ids[0].tolist())
    return torch.tensor([encode_text(draft.tokenizer, text)])


def time_drafter(drafter, target, context_ids: torch.Tensor, gamma: int, *,
                 repeats: int = 20, warmup: int = 3) -> float:
    """Median seconds per drafted token of a drafter with a cache of its own (llama.cpp, a draft
    of another vocabulary) after `context_ids` [1, L]:
    rounds of `propose(γ)` through the drafter contract, each followed by a commit that keeps
    every draft, as most rounds do at this draft's α (so each round feeds the last draft and the
    bonus token in one decode, then γ − 1 drafts), divided by γ."""
    from exactspec.sampling import SamplingConfig

    rounds = warmup + repeats
    drafter.start(context_ids, torch.ones_like(context_ids, dtype=torch.bool),
                  drafter.bind(target, context_ids.size(1) + rounds * (gamma + 1)))
    sampling, times = SamplingConfig(temperature=1.0), []
    next_token = context_ids[0, -1:]  # [1], any real token id will do
    for _ in range(rounds):
        start = time.perf_counter()
        drafter.propose(gamma, sampling, None)
        times.append(time.perf_counter() - start)
        drafter.commit(torch.tensor([gamma]), next_token)
    return statistics.median(times[warmup:]) / gamma
