"""A draft language model with its own KV cache: q is its decoding distribution."""
from __future__ import annotations

import torch

from exactspec.cache import CachedModel
from exactspec.drafters.base import Proposal
from exactspec.models import check_compatible, check_context, unwrap_model
from exactspec.sampling import SamplingConfig, sample


class ModelDrafter:
    """A draft language model with its own KV cache.

    Drafts are sampled from q (never the argmax while q is a softmax: that would break
    exactness); at temperature 0, q is one-hot and sampling is the argmax. The cache holds each
    row's committed tokens except the `pending` ones: the last committed token, and after a round
    that kept every draft also the last draft (it was sampled but never fed). A round feeds the
    pending tokens (rows with fewer get a padding hole), then one token per further draft.
    """

    def __init__(self, model):
        self.model, self.tokenizer, self.name = unwrap_model(model, "draft")
        self.lm: CachedModel | None = None

    def bind(self, target, total_tokens: int) -> int:
        """The shared vocabulary: the draft's tokenizer must match the target's (the vocabulary
        rule), and prompt + budget must fit the draft's context too."""
        check_context(self.model, self.name, total_tokens)
        return check_compatible(target, (self.model, self.tokenizer))

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
        self.lm = CachedModel(self.model, self.name, vocab_size, input_ids.size(0))
        self.next_logits = self.lm.prefill(input_ids, valid)  # [B, V], used while nothing is pending
        self.pending = input_ids[:, :0]  # [B, 0]
        self.pending_valid = valid[:, :0]  # [B, 0]

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        batch = self.pending.size(0)
        if gamma == 0:  # the budget's last token: nothing to draft, nothing to feed
            self.drafts = self.pending.new_empty(batch, 0)
            return Proposal(self.drafts, None)
        if self.pending.size(1):
            logits = self.lm.feed(self.pending, self.pending_valid)[:, -1]  # [B, V]
        else:
            logits = self.next_logits  # [B, V], straight after the prefill
        tokens, qs = [], []
        for i in range(gamma):
            q_i = sampling.probs(logits)  # [B, V]
            x_i = sample(q_i, generator)  # [B]
            tokens.append(x_i)
            qs.append(q_i)
            if i + 1 < gamma:  # the last draft is fed next round, if it is kept
                logits = self.lm.feed(x_i.unsqueeze(1))[:, -1]  # [B, V]
        self.drafts = torch.stack(tokens, dim=1)  # [B, γ]
        return Proposal(self.drafts, torch.stack(qs, dim=1))  # [B, γ], [B, γ, V]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        gamma = self.drafts.size(1)
        if gamma == 0:  # nothing was fed this round: the next token joins the pending ones
            self.pending = torch.cat([self.pending, next_tokens.unsqueeze(1)], dim=1)
            self.pending_valid = torch.cat([self.pending_valid, torch.ones_like(next_tokens.unsqueeze(1),
                                                                                dtype=torch.bool)], dim=1)
            return
        # Fed drafts x_1..x_{γ-1}; those after the kept ones become holes.
        self.lm.discard_last((gamma - 1 - num_accepted).clamp(min=0))
        all_kept = (num_accepted == gamma).unsqueeze(1)  # [B, 1]
        last_draft = torch.where(all_kept, self.drafts[:, -1:], next_tokens.unsqueeze(1))
        self.pending = torch.cat([last_draft, next_tokens.unsqueeze(1)], dim=1)  # [B, 2]
        self.pending_valid = torch.cat([all_kept, torch.ones_like(all_kept)], dim=1)  # [B, 2]
        if not all_kept.any():
            self.pending, self.pending_valid = self.pending[:, 1:], self.pending_valid[:, 1:]

    def select(self, rows: torch.Tensor) -> None:
        self.lm.select(rows)
        self.pending, self.pending_valid = self.pending[rows], self.pending_valid[rows]
