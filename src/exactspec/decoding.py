"""Speculative and plain autoregressive generation with real Hugging Face models.

A round (the seed's Part 7): the drafter proposes γ tokens x_1..x_γ with their q; the target
scores [last committed token, x_1..x_γ] in one pass, giving p_1..p_{γ+1}; `verify_block` keeps a
prefix of the drafts and adds one correction or bonus token. The target's cache always holds the
committed sequence minus its last token, so every round feeds exactly γ+1 tokens and the cache is
cropped back to the kept prefix after a rejection (rule 3).

Batch size 1 for now; the loop is written over [B, ...] tensors so that B > 1 can follow.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from exactspec.drafters import ModelDrafter, NGramDrafter, Proposal, SamplingConfig, as_drafter
from exactspec.kvmodel import CachedModel, unwrap_model
from exactspec.models import check_compatible, context_length, eos_token_ids, usable_vocab
from exactspec.sampling import METHODS, check_sampling_args, sample, verify_block

MAX_GAMMA = 32


@dataclass
class DecodeStats:
    """Counters of one generation. output tokens = accepted drafts + corrections + bonus tokens."""

    output_tokens: int = 0
    accepted_drafts: int = 0
    drafted_tokens: int = 0
    corrections: int = 0
    bonus_tokens: int = 0
    rounds: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    target_tokens_fed: int = 0
    draft_tokens_fed: int = 0
    wall_seconds: float = 0.0
    time_to_first_token: float | None = None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_drafts / self.drafted_tokens if self.drafted_tokens else None

    @property
    def tokens_per_round(self) -> float | None:
        return self.output_tokens / self.rounds if self.rounds else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_round": self.tokens_per_round, "tokens_per_s": self.tokens_per_s}


@dataclass
class GenerateOutput:
    """sequences: LongTensor[B, L + n], the prompt followed by the new tokens."""

    sequences: torch.Tensor
    stats: DecodeStats = field(default_factory=DecodeStats)


# --------------------------------------------------------------------------- set-up and checks


def _check_generation_args(input_ids: torch.Tensor, max_new_tokens: int, sampling: SamplingConfig,
                           gamma: int | None = None) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor[B, L]")
    if input_ids.size(1) == 0:
        raise ValueError("the prompt is empty: input_ids has length 0")
    if input_ids.size(0) != 1:
        raise ValueError(f"batch size must be 1 for now, got {input_ids.size(0)}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens}")
    if gamma is not None and (isinstance(gamma, bool) or not isinstance(gamma, int)
                              or not 1 <= gamma <= MAX_GAMMA):
        raise ValueError(f"gamma must be an integer in [1, {MAX_GAMMA}], got {gamma}")
    check_sampling_args(sampling.temperature, sampling.top_k, sampling.top_p)


def _check_context(model: torch.nn.Module, name: str, total: int) -> None:
    limit = context_length(model)
    if limit is not None and total > limit:
        raise ValueError(f"prompt + max_new_tokens = {total} tokens exceeds the context window of "
                         f"{name!r} ({limit} tokens)")


def _shared_vocab(target, drafter) -> int:
    """The vocabulary V that p and q share (rule 5); refuses a draft model whose differs."""
    if isinstance(drafter, ModelDrafter):
        return check_compatible(target, (drafter.model, drafter.tokenizer))
    return usable_vocab(target)  # n-gram lookup proposes tokens of the sequence itself


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
    """Rule 4: randomness is passed, never global. No seed: a fresh, nondeterministic one."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_set(eos_token_id, target) -> set[int]:
    """The ids that end a generation: as given, else the target's tokenizer and configs say."""
    if eos_token_id is None:
        return set(eos_token_ids(target))
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class _Clock:
    """Wall time and time to first token, synchronizing the accelerator before each reading."""

    def __init__(self, device: torch.device):
        self.device = device
        _sync(device)
        self.start = time.perf_counter()

    def read(self) -> float:
        _sync(self.device)
        return time.perf_counter() - self.start


# --------------------------------------------------------------------------- generation


def _prefill(lm: CachedModel, input_ids: torch.Tensor) -> None:
    """Fill the cache with the prompt minus its last token (the first step feeds that one)."""
    if input_ids.size(1) > 1:
        lm.feed(input_ids[:, :-1])


def _emit(sequence: torch.Tensor, new: list[int], stats: DecodeStats, clock: _Clock,
          on_tokens) -> torch.Tensor:
    if stats.time_to_first_token is None and new:
        stats.time_to_first_token = clock.read()
    stats.output_tokens += len(new)
    if on_tokens is not None and new:
        on_tokens(new)
    return torch.cat([sequence, sequence.new_tensor([new])], dim=1)  # [1, L + n]


@torch.inference_mode()
def autoregressive_generate(target, input_ids: torch.Tensor, *, max_new_tokens: int,
                            temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None, seed: int | None = None,
                            eos_token_id=None, attention_mask=None,
                            on_tokens=None) -> GenerateOutput:
    """Plain decoding of the target: one forward pass and one draw from p per output token."""
    sampling = SamplingConfig(temperature, top_k, top_p)
    _check_generation_args(input_ids, max_new_tokens, sampling)
    model, tokenizer, name = unwrap_model(target)
    _check_context(model, name, input_ids.size(1) + max_new_tokens)
    lm = CachedModel(model, name, usable_vocab((model, tokenizer)))
    input_ids = input_ids.to(lm.device)
    generator, eos = _generator(seed, lm.device), _eos_set(eos_token_id, (model, tokenizer))
    stats, clock, sequence = DecodeStats(), _Clock(lm.device), input_ids
    _prefill(lm, input_ids)
    while stats.output_tokens < max_new_tokens:
        p = sampling.probs(lm.feed(sequence[:, -1:])[:, -1])  # [1, V]
        token = int(sample(p, generator).item())
        stats.rounds += 1
        stats.bonus_tokens += 1
        sequence = _emit(sequence, [token], stats, clock, on_tokens)
        if token in eos:
            break
    stats.target_calls, stats.target_tokens_fed = lm.calls, lm.tokens_fed
    stats.wall_seconds = clock.read()
    return GenerateOutput(sequence, stats)


def _round(lm: CachedModel, drafter, sequence: torch.Tensor, gamma: int,
           sampling: SamplingConfig, generator: torch.Generator, method: str):
    """One round: propose, score [last token, drafts] in one target pass, verify, crop.
    Returns (emitted tokens, the proposal, τ)."""
    proposal: Proposal = drafter.propose(sequence, gamma, sampling, generator)
    drafts = proposal.tokens.to(lm.device)  # [1, γ']
    logits = lm.feed(torch.cat([sequence[:, -1:], drafts], dim=1))  # [1, γ'+1, V]
    p = sampling.probs(logits)  # [1, γ'+1, V]
    result = verify_block(drafts, proposal.q, p, generator, method)
    tau = int(result.num_accepted.item())
    lm.crop(sequence.size(1) + tau)  # keep the committed tokens minus the last, and x_1..x_τ
    return result.tokens[0, : tau + 1].tolist(), proposal, tau


@torch.inference_mode()
def speculative_generate(target, draft, input_ids: torch.Tensor, *, gamma: int,
                         max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int | None = None,
                         eos_token_id=None, attention_mask=None, method: str = "block",
                         on_tokens=None) -> GenerateOutput:
    """Speculative decoding: output follows the target's decoding distribution exactly.

    target: a Hugging Face causal LM or LoadedModel. draft: the same, or any drafter
    (`ModelDrafter`, `NGramDrafter`, or "ngram"). method: "block" (joint block verification,
    never fewer tokens per round) or "token" (the seed's rule); both are exact.
    `on_tokens(list[int])` is called with the tokens each round emits (for streaming).
    """
    sampling = SamplingConfig(temperature, top_k, top_p)
    _check_generation_args(input_ids, max_new_tokens, sampling, gamma)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    drafter = NGramDrafter() if draft == "ngram" else as_drafter(draft)
    model, tokenizer, name = unwrap_model(target)
    vocab = _shared_vocab((model, tokenizer), drafter)
    total = input_ids.size(1) + max_new_tokens
    _check_context(model, name, total)
    if isinstance(drafter, ModelDrafter):
        _check_context(drafter.model, drafter.name, total)
    lm = CachedModel(model, name, vocab)
    input_ids = input_ids.to(lm.device)
    generator, eos = _generator(seed, lm.device), _eos_set(eos_token_id, (model, tokenizer))
    stats, clock, sequence = DecodeStats(), _Clock(lm.device), input_ids
    _prefill(lm, input_ids)
    drafter.start(input_ids, vocab)
    while stats.output_tokens < max_new_tokens:
        block = min(gamma, max_new_tokens - stats.output_tokens - 1)  # never exceed the budget
        new, proposal, tau = _round(lm, drafter, sequence, block, sampling, generator, method)
        new = _cut_at_eos(new, eos)
        _count_round(stats, new, proposal, tau)
        sequence = _emit(sequence, new, stats, clock, on_tokens)
        if new[-1] in eos:
            break
    stats.target_calls, stats.target_tokens_fed = lm.calls, lm.tokens_fed
    stats.draft_calls, stats.draft_tokens_fed = drafter.calls, drafter.tokens_fed
    stats.wall_seconds = clock.read()
    return GenerateOutput(sequence, stats)


def _count_round(stats: DecodeStats, new: list[int], proposal: Proposal, tau: int) -> None:
    """Count what the round emitted (an EOS may have cut it short)."""
    drafted = proposal.tokens.size(1)
    stats.rounds += 1
    stats.drafted_tokens += drafted
    stats.accepted_drafts += min(tau, len(new))
    if len(new) == tau + 1:
        if tau == drafted:
            stats.bonus_tokens += 1
        else:
            stats.corrections += 1
