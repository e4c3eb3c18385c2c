"""A draft model of another vocabulary, drafting text: string-level drafts (SLEM-style).

The rule: the draft writes the next tokens in its own vocabulary, greedily; their text is encoded
by the target's tokenizer and proposed as point-mass drafts (q = None). The target keeps a draft
x with probability p(x), else draws from p with x removed, so each emitted token y has
probability p(x)·[y = x] + (1 − p(x)) · p(y)[y ≠ x] / (1 − p(x)) = p(y), whatever x was
(`exactspec.verify`). Unlike the token-level intersection (`drafters.tli`), any target token can
be drafted, including one the draft spells with several of its own.

The boundary: the target token that covers the end of the draft's text may change once more text
follows (" retu" then "rn"), so the draft writes γ + 1 tokens and the last target token of their
text is not proposed, unless the draft stopped at a special token (then its text is whole).

The draft's context follows the committed target text: after a round its cache keeps the longest
run of its written tokens whose text is a proper prefix of the text committed, and the rest of
that text is fed in the draft tokenizer's ids (`encode_piece`); the rest of its tokens are
rolled back. The context decides only how often drafts are kept, never what is emitted.
"""
from __future__ import annotations

import torch

from exactspec.drafters.base import Proposal
from exactspec.drafters.tli import TLIDrafter, _right_aligned
from exactspec.models import usable_vocab
from exactspec.models.loaded import unwrap_model
from exactspec.models.vocab import STRING_LEVEL
from exactspec.models.vocab_map import encode_piece, intersect
from exactspec.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)  # the draft's most likely text: where p(x) is largest


class StringDrafter(TLIDrafter):
    """A model draft over its own vocabulary whose text is proposed in the target's tokens
    (module docstring). `model`: as for `TLIDrafter` (a draft model, or a `ModelDrafter` /
    `LlamaCppDrafter` with its tokenizer)."""

    def __init__(self, model):
        super().__init__(model)
        self.name = f"string:{self.inner.name}"
        self.method = STRING_LEVEL

    def bind(self, target, total_tokens: int) -> int:
        """The target's vocabulary V_t. Any pair of tokenizers can draft this way; the texts of
        both vocabularies come from their intersection's map (`intersect`, memoized per pair)."""
        scored = self.inner.bind_own(target, total_tokens)
        self.target_tokenizer = unwrap_model(target, "target")[1]
        if self.target_tokenizer is None:
            raise ValueError("the target has no tokenizer: string-level drafts need one to encode "
                             "the draft's text")
        self.map = intersect(self.target_tokenizer, self.inner.tokenizer)
        if scored < self.map.draft_size:
            raise ValueError(f"draft {self.inner.name!r} scores only {scored} token ids, but its "
                             f"tokenizer has {self.map.draft_size}")
        return usable_vocab(target)

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        """Up to γ target tokens per row (shorter rows padded by repeating their last one, exact
        as any point-mass draft); `lengths` says how many each row wrote."""
        written = self.inner.propose(gamma + 1 if gamma else 0, GREEDY, None).tokens  # [B, γ+1]
        self.written = written.tolist()
        proposed = [self.target_tokens(row)[:gamma] for row in self.written]
        width = max(map(len, proposed))
        padded = [row + [row[-1] if row else 0] * (width - len(row)) for row in proposed]
        drafts = torch.tensor(padded, dtype=torch.long).view(len(padded), width)  # [B, γ']
        self.drafts = drafts.to(written.device)
        return Proposal(self.drafts, None, [len(row) for row in proposed])

    def target_tokens(self, written: list[int]) -> list[int]:
        """The draft's tokens → the target's tokens of their text, the last one left out unless
        the text is whole (the module's boundary rule)."""
        pieces, whole = [], False
        for token in written:
            text = self.map.draft_texts[token]
            if text is None:
                whole = True
                break
            pieces.append(text)
        text = "".join(pieces)
        if not text:
            return []
        tokens = encode_piece(self.target_tokenizer, text)
        return tokens if whole else tokens[:-1]

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Each row's committed tokens (its first num_accepted[b] proposals, then next_tokens[b])
        as text: the draft keeps the written tokens that spell a proper prefix of it and is fed
        the rest (`follow`)."""
        texts = self.committed_texts(self.drafts, num_accepted, next_tokens)  # kept padding too
        kept, rest = zip(*(self.follow(written, text)
                           for written, text in zip(self.written, texts)))
        tokens, valid = _right_aligned(list(rest), next_tokens.device)
        self.inner.commit(torch.tensor(kept, device=num_accepted.device), tokens, valid)

    def follow(self, written: list[int], text: str) -> tuple[int, list[int]]:
        """(how many of the written draft tokens spell a proper prefix of `text`, the draft's ids
        for the rest of it): at least one id is fed, so the draft's next logits follow it."""
        at, kept = 0, 0
        for token in written:
            piece = self.map.draft_texts[token]
            if piece is None or not text.startswith(piece, at) or at + len(piece) >= len(text):
                break
            at, kept = at + len(piece), kept + 1
        return kept, encode_piece(self.inner.tokenizer, text[at:])

    def committed_texts(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                        next_tokens: torch.Tensor) -> list[str]:
        """Each row's committed text: its first num_accepted[b] of drafts[B, γ'], then
        next_tokens[b]."""
        return ["".join(self.map.texts[token] for token in row[:n] + [x]) for row, n, x in
                zip(drafts.tolist(), num_accepted.tolist(), next_tokens.tolist())]

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        """A round someone else drafted (in target ids): its committed text, in the draft's ids."""
        rows = [encode_piece(self.inner.tokenizer, text)
                for text in self.committed_texts(drafts, num_accepted, next_tokens)]
        tokens, valid = _right_aligned(rows, next_tokens.device)
        self.inner.observe(tokens[:, :0], num_accepted, tokens, valid)
