"""A draft language model with its own KV cache: q is its decoding distribution."""
from __future__ import annotations

import time

import torch

from exactspec.cache import CachedModel
from exactspec.drafters.base import Drafter, Proposal, lag
from exactspec.models import check_compatible, check_context, unwrap_model
from exactspec.models.loaded import memory_of, output_vocab_size
from exactspec.sampling import SamplingConfig, sample


class ModelDrafter(Drafter):
    """A draft language model with its own KV cache.

    Drafts are sampled from q (never the argmax while q is a softmax: that would break
    exactness); at temperature 0, q is one-hot and sampling is the argmax. The cache holds each
    row's committed tokens except the `pending` ones: the last committed token, and after a round
    that kept every draft also the last draft (it was sampled but never fed). A round feeds the
    pending tokens (rows with fewer get a padding hole), then one token per further draft.
    The cache catches up lazily: the prompt, and the tokens of rounds this drafter sat out
    (`observe`), stay pending until it next proposes; that pass is reported apart (`catch_up`),
    so the controller learns a round's cost from the passes after it.
    """

    def __init__(self, model):
        self.model, self.tokenizer, self.name = unwrap_model(model, "draft")
        self.memory = memory_of(model)  # a LoadedModel's own: its faster products (`CachedModel`)
        self.lm: CachedModel | None = None
        self.catch_up = (0.0, 0)  # (seconds, passes) of the last proposal's first pass, if behind

    def bind(self, target, total_tokens: int) -> int:
        """The shared vocabulary: the draft's tokenizer must match the target's (the vocabulary
        rule), and prompt + budget must fit the draft's context too."""
        self.bind_own(target, total_tokens)
        return check_compatible(target, (self.model, self.tokenizer))

    def bind_own(self, target, total_tokens: int) -> int:
        """`bind` less the vocabulary rule (a `TLIDrafter` maps vocabularies instead): prompt +
        budget must fit the draft's context. Returns the width of its logits."""
        check_context(self.model, self.name, total_tokens)
        return output_vocab_size(self.model)

    @property
    def calls(self) -> int:
        return self.lm.calls if self.lm else 0

    @property
    def tokens_fed(self) -> int:
        return self.lm.tokens_fed if self.lm else 0

    @property
    def padding_fed(self) -> int:
        return self.lm.padding_fed if self.lm else 0

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.lm = CachedModel(self.model, self.name, vocab_size, input_ids.size(0), self.memory)
        self.pending, self.pending_valid = input_ids, valid  # [B, L], fed at the first proposal

    def next_source(self) -> str:
        return "model"

    def lag(self) -> int:
        """Pending tokens beyond a round in step's (see `drafters.base.lag`)."""
        return lag(self.pending_valid.sum(dim=1).tolist())

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        batch, self.catch_up = self.pending.size(0), (0.0, 0)
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            self.drafts = self.pending.new_empty(batch, 0)
            return Proposal(self.drafts, None)
        start, calls, behind = time.perf_counter(), self.lm.calls, self.lag() > 0
        logits = self.lm.prefill(self.pending, self.pending_valid)  # [B, V], after the pending tokens
        if behind:  # a prompt, or rounds it sat out: not what a round costs once in step
            self.catch_up = (time.perf_counter() - start, self.lm.calls - calls)
        drafts, qs = self.pending.new_empty(batch, gamma), []  # [B, γ], filled as they are drawn
        for i in range(gamma):
            q_i = sampling.probs(logits, drafts=drafts[:, :i])  # [B, V], after the drafts so far
            drafts[:, i] = sample(q_i, generator)  # [B]
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self.lm.feed(drafts[:, i: i + 1])[:, -1]  # [B, V]
        self.drafts = drafts  # [B, γ]
        return Proposal(self.drafts, torch.stack(qs, dim=1))  # [B, γ], [B, γ, V]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
               next_valid: torch.Tensor | None = None) -> None:
        """next_tokens [B]; or [B, k] with next_valid [B, k], right-aligned (each row's last
        column valid), for a draft that feeds a committed token as several of its own
        (`TLIDrafter`)."""
        next_tokens, next_valid = _columns(next_tokens, next_valid)  # [B, k], [B, k]
        gamma = self.drafts.size(1)
        if gamma == 0:  # nothing was fed this round: the next token joins the pending ones
            self.observe(self.drafts, num_accepted, next_tokens, next_valid)
            return
        # Fed drafts x_1..x_{γ-1}; those after the kept ones become holes.
        self.lm.discard_last((gamma - 1 - num_accepted).clamp(min=0))
        all_kept = (num_accepted == gamma).unsqueeze(1)  # [B, 1]
        last_draft = torch.where(all_kept, self.drafts[:, -1:], next_tokens[:, -1:])  # [B, 1]
        self.pending = torch.cat([last_draft, next_tokens], dim=1)  # [B, 1+k]
        self.pending_valid = torch.cat([all_kept, next_valid], dim=1)  # [B, 1+k]
        if not all_kept.any():
            self.pending, self.pending_valid = self.pending[:, 1:], self.pending_valid[:, 1:]

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor, next_valid: torch.Tensor | None = None) -> None:
        """A round this drafter did not feed: its committed tokens (each row's first
        num_accepted[b] of drafts[B, γ'], then next_tokens[b], as in `commit`) join the pending
        ones."""
        next_tokens, next_valid = _columns(next_tokens, next_valid)  # [B, k], [B, k]
        kept = torch.arange(drafts.size(1), device=drafts.device) < num_accepted.unsqueeze(1)  # [B, γ']
        tokens = torch.cat([self.pending, drafts, next_tokens], dim=1)  # [B, n]
        valid = torch.cat([self.pending_valid, kept, next_valid], dim=1)  # [B, n]
        used = valid.any(dim=0)  # [n], drop the columns that are holes in every row
        self.pending, self.pending_valid = tokens[:, used], valid[:, used]

    def select(self, rows: torch.Tensor) -> None:
        self.lm.select(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor, lazy: bool = False) -> None:
        """New rows (left-padded prompts [n, L]) join at a round boundary: their prompts minus the
        last token are prefilled on their own and merged into the cache; the last prompt token is
        pending, like the last committed token of the running rows. lazy: nothing is run now,
        the whole prompt is pending (the cache catches up when this drafter next proposes: for a
        draft that often sits rounds out, like the auto draft's model)."""
        prefilled = 0 if lazy else input_ids.size(1) - 1
        self.lm.join(input_ids[:, :prefilled], valid[:, :prefilled])
        new = (input_ids, valid) if lazy else (input_ids[:, -1:], valid[:, -1:])
        width = max(self.pending.size(1), new[0].size(1))
        pending = [_left_pad_holes(self.pending, self.pending_valid, width),
                   _left_pad_holes(*new, width)]
        self.pending = torch.cat([pending[0][0], pending[1][0]])  # [B+n, width]
        self.pending_valid = torch.cat([pending[0][1], pending[1][1]])  # [B+n, width]


def _columns(tokens: torch.Tensor, valid: torch.Tensor | None):
    """Committed tokens [B] or [B, k] as columns [B, k], with their valid mask (all valid if None)."""
    tokens = tokens.unsqueeze(1) if tokens.dim() == 1 else tokens  # [B, k]
    return tokens, torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid


def _left_pad_holes(tokens: torch.Tensor, valid: torch.Tensor, width: int):
    """tokens [B, k] and valid [B, k] left-padded to `width` columns with holes (id 0, invalid)."""
    pad = width - tokens.size(1)
    return (torch.cat([tokens.new_zeros(tokens.size(0), pad), tokens], dim=1),
            torch.cat([valid.new_zeros(valid.size(0), pad), valid], dim=1))
