"""A draft model whose vocabulary differs from the target's, drafting through the token-level
intersection (TLI, Timor et al., ICML 2025; the map: `exactspec.models.vocab_map`).

The rule: at each draft position the draft's logits are kept on the intersection and put at
the target's ids (−inf elsewhere), then processed with the round's settings into q over the
target's vocabulary — q restricted to the intersection and renormalized, zero outside it. The
draft token is sampled from q; the target verifies with the usual rule (`exactspec.verify`).
Exact by the usual argument: q is the distribution the draft sampled from, so each emitted
token y has probability min(p(y), q(y)) + max(p(y) − q(y), 0) = p(y); tokens outside the
intersection come only as corrections and bonuses.

The draft's context, which decides only how often drafts are kept: the prompt's text (the
target's tokens decoded) encoded by the draft's tokenizer; then per round the kept drafts as
the draft's own ids (the map is one to one), and the correction or bonus as its partner when
it is in the intersection, else as the draft tokenizer's encoding of its text.
"""
from __future__ import annotations

import copy

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.drafters.model import ModelDrafter
from exactspec.models import check_intersection, usable_vocab
from exactspec.models.loaded import unwrap_model
from exactspec.models.vocab_map import VocabMap, encode_text
from exactspec.sampling import SamplingConfig


class InDraftVocab:
    """The round's settings seen from the draft's vocabulary: logits [B, V_d] → the target-side q
    of the module's rule [B, V_t], read back at the draft's ids [B, V_d] (0 outside the
    intersection), so the draft model samples its own ids from exactly that q."""

    def __init__(self, sampling, vocab_map: VocabMap):
        self.sampling, self.map = sampling, vocab_map

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        before = None if drafts is None else self.map.tokens_to_target(drafts)  # [B, i], target ids
        q = self.sampling.probs(self.map.logits_to_target(logits), drafts=before)  # [B, V_t]
        return self.map.probs_to_draft(q)  # [B, V_d]


class TLIDrafter(Drafter):
    """A model draft over its own vocabulary (its cache, its ids), whose proposals are mapped to
    the target's ids with q placed in the target's vocabulary (module docstring). `model`: a
    draft model (run as a `ModelDrafter`), or a drafter with a `tokenizer`, `bind_own` and a
    `commit`/`observe` that take several tokens per row (`ModelDrafter`, `LlamaCppDrafter`).
    `method` says which way it drafts, once bound."""

    def __init__(self, model):
        self.inner = model if isinstance(model, Drafter) else ModelDrafter(model)
        if self.inner.tokenizer is None:
            raise ValueError(f"draft {self.inner.name!r} has no tokenizer: a token-level "
                             "intersection needs one")
        self.name = f"tli:{self.inner.name}"
        self.map: VocabMap | None = None
        self.method = "token-level intersection"

    def __copy__(self):
        """A copy with a copy of its inner draft (`serve.drafts` gives each batch one)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__, inner=copy.copy(self.inner))
        return twin

    calls = property(lambda self: self.inner.calls)
    tokens_fed = property(lambda self: self.inner.tokens_fed)
    padding_fed = property(lambda self: self.inner.padding_fed)
    catch_up = property(lambda self: self.inner.catch_up)

    def bind(self, target, total_tokens: int) -> int:
        """The target's vocabulary V_t (q is placed in it), once the intersection is checked
        (`check_intersection`). The context check counts target tokens: the draft's own count
        may be larger where it spells a target token with several of its own."""
        scored = self.inner.bind_own(target, total_tokens)
        self.map = check_intersection(target, (self.inner, self.inner.tokenizer))
        self.target_tokenizer = unwrap_model(target, "target")[1]
        if scored < self.map.draft_size:
            raise ValueError(f"draft {self.inner.name!r} scores only {scored} token ids, but its "
                             f"tokenizer has {self.map.draft_size}")
        self.method = self.map.describe()
        return usable_vocab(target)

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.inner.start(*self._prompts(input_ids, valid), self.map.draft_size)

    def next_source(self) -> str:
        return "model"

    def lag(self) -> int:
        return self.inner.lag()

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        proposal = self.inner.propose(gamma, InDraftVocab(sampling, self.map), generator)
        self.drafts = self.map.tokens_to_target(proposal.tokens)  # [B, γ], target ids
        q = None if proposal.q is None else self.map.probs_to_target(proposal.q)  # [B, γ, V_t]
        return Proposal(self.drafts, q)

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """The kept drafts are in the draft's cache already; the next token is fed as the
        draft's ids for it (the module's rule)."""
        rows = [self.map.to_draft([token]) for token in next_tokens.tolist()]
        tokens, valid = _right_aligned(rows, next_tokens.device)
        self.inner.commit(num_accepted, tokens, valid)

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        """A round someone else drafted (in target ids): its committed tokens, as draft ids."""
        rows = [self.map.to_draft(row[:n] + [x]) for row, n, x in
                zip(drafts.tolist(), num_accepted.tolist(), next_tokens.tolist())]
        tokens, valid = _right_aligned(rows, next_tokens.device)
        self.inner.observe(tokens[:, :0], num_accepted, tokens, valid)

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor, lazy: bool = False) -> None:
        self.inner.join(*self._prompts(input_ids, valid), lazy=lazy)

    def _prompts(self, input_ids: torch.Tensor, valid: torch.Tensor):
        """Left-padded target prompts [B, L] → left-padded draft prompts [B, L'], by text."""
        texts = [self.target_tokenizer.decode(row[ok].tolist()) for row, ok in zip(input_ids, valid)]
        rows = [encode_text(self.inner.tokenizer, text) for text in texts]
        return _right_aligned(rows, input_ids.device)



def _right_aligned(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft ids per row → (tokens [B, k], valid [B, k]), right-aligned, holes on the left."""
    width = max(len(ids) for ids in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [B, k]
    valid = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, k]
    for b, ids in enumerate(rows):
        tokens[b, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        valid[b, width - len(ids):] = True
    return tokens.to(device), valid.to(device)
