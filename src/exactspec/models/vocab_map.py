"""The token-level intersection (TLI) of two vocabularies: the tokens whose text is one token on
both sides, paired one to one (Timor et al., ICML 2025).

A draft whose tokenizer differs from the target's drafts through it (`drafters.tli`): its q is
restricted to the intersection, renormalized and placed at the target's ids, zero elsewhere.
The target verifies with the usual rule, and since q is the distribution the drafts were
sampled from, every emitted token follows p exactly; the map decides only how often drafts
are kept.

A token's text is decode([anchor, t]) less the anchor's own text, so a leading space survives:
'Ġa' (byte-level BPE) and '▁a' (SentencePiece, whose decoder drops a first token's space) are
both " a". Left out of the intersection: special tokens, tokens whose text is empty or not
whole UTF-8 (U+FFFD), and on each side all but one of the tokens that share a text (the one
that encodes its own text, else the lowest id), so that the map is one to one.
"""
from __future__ import annotations

import functools

import torch

from exactspec.models.loaded import tokenizer_size

MIN_SHARED = 0.1  # the fewest of the draft's ordinary tokens the intersection must hold
ANCHOR_TEXT = "\n"  # what a committed token's text is encoded after, then cut off (see `VocabMap.to_draft`)


class VocabMap:
    """The intersection as index tensors: target_ids[i] and draft_ids[i] have the same text.

    target_size, draft_size: the usable vocabularies V_t and V_d; texts: each target id's text
    (special tokens as decoded alone), used to encode a committed token the draft lacks;
    draft_texts: each draft id's text, None for a special token or one whose text cannot be told
    (what a string-level draft writes, `drafters.strings`)."""

    def __init__(self, target_ids: list[int], draft_ids: list[int], target_size: int,
                 draft_size: int, texts: list[str], draft_tokenizer,
                 draft_texts: list[str | None]):
        self.target_ids = torch.tensor(target_ids, dtype=torch.long)  # [n]
        self.draft_ids = torch.tensor(draft_ids, dtype=torch.long)  # [n]
        self.target_size, self.draft_size, self.texts = target_size, draft_size, texts
        self.draft_texts = draft_texts
        self.draft_of = dict(zip(target_ids, draft_ids))
        self.target_of = torch.full((draft_size,), -1, dtype=torch.long)  # [V_d], -1 outside
        self.target_of[self.draft_ids] = self.target_ids
        self.tokenizer = draft_tokenizer
        self._pieces: dict[int, list[int]] = {}  # target id → draft ids, for ids the draft lacks

    def __len__(self) -> int:
        return self.target_ids.numel()

    def describe(self) -> str:
        """The method in words, for logs and `TLIDrafter.method`."""
        return (f"token-level intersection: {len(self)} of the target's {self.target_size} tokens "
                "can be drafted")

    def logits_to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., V_d] → [..., V_t]: the intersection's at their target ids, −inf
        elsewhere (softmax then gives q restricted to the intersection, renormalized)."""
        out = logits.new_full((*logits.shape[:-1], self.target_size), -torch.inf)  # [..., V_t]
        out[..., self.target_ids.to(logits.device)] = logits[..., self.draft_ids.to(logits.device)]
        return out

    def probs_to_draft(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V_t] → [..., V_d]: the intersection's probabilities at their draft ids, 0 elsewhere."""
        out = probs.new_zeros((*probs.shape[:-1], self.draft_size))  # [..., V_d]
        out[..., self.draft_ids.to(probs.device)] = probs[..., self.target_ids.to(probs.device)]
        return out

    def probs_to_target(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., V_d] → [..., V_t]: the intersection's probabilities at their target ids, 0 elsewhere."""
        out = probs.new_zeros((*probs.shape[:-1], self.target_size))  # [..., V_t]
        out[..., self.target_ids.to(probs.device)] = probs[..., self.draft_ids.to(probs.device)]
        return out

    def tokens_to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft ids of the intersection → their target ids (same shape); refuses any other id."""
        mapped = self.target_of.to(tokens.device)[tokens]
        if (mapped < 0).any():
            raise ValueError(f"draft token {tokens[mapped < 0][0].item()} is not in the intersection")
        return mapped

    def to_draft(self, target_tokens: list[int]) -> list[int]:
        """Committed target tokens as draft tokens: a token of the intersection as its partner,
        any other as the draft tokenizer's encoding of its text (after ANCHOR_TEXT, whose ids are
        then cut off, so that a SentencePiece tokenizer adds no space in front of a piece)."""
        out = []
        for token in target_tokens:
            if token in self.draft_of:
                out.append(self.draft_of[token])
            else:
                if token not in self._pieces:
                    self._pieces[token] = encode_piece(self.tokenizer, self.texts[token])
                out += self._pieces[token]
        return out


def encode_piece(tokenizer, text: str) -> list[int]:
    """`text` in `tokenizer`'s ids as it reads inside a longer text (see `VocabMap.to_draft`);
    the unknown token (else EOS) for a text that encodes to nothing, so each piece feeds one."""
    head = tokenizer.encode(ANCHOR_TEXT, add_special_tokens=False)
    ids = tokenizer.encode(ANCHOR_TEXT + text, add_special_tokens=False)
    ids = ids[len(head):] if ids[:len(head)] == head else tokenizer.encode(text, add_special_tokens=False)
    return ids or [_filler(tokenizer)]


def _filler(tokenizer) -> int:
    """The id fed for a text that encodes to nothing: the unknown token, else EOS."""
    return tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.eos_token_id


def encode_text(tokenizer, text: str) -> list[int]:
    """A whole text (a prompt) in `tokenizer`'s ids, with its BOS in front when it adds one
    (`_filler` for a text that encodes to nothing)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer.encode("a")[:1] == [bos]
    ids = [bos] + ids if adds_bos and ids[:1] != [bos] else ids
    return ids or [_filler(tokenizer)]


def special_ids(tokenizer) -> set[int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, t in decoder.items() if getattr(t, "special", False)}


def token_texts(tokenizer, size: int) -> list[str | None]:
    """Each id's text in context (see the module docstring); None where it cannot be told."""
    specials = special_ids(tokenizer)
    anchor = next(i for i in range(size) if i not in specials and tokenizer.decode([i]).strip())
    head = tokenizer.decode([anchor], clean_up_tokenization_spaces=False)
    pairs = tokenizer.batch_decode([[anchor, i] for i in range(size)], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return [pair[len(head):] if pair.startswith(head) else None for pair in pairs]


def _by_text(tokenizer, texts: list[str | None]) -> dict[str, int]:
    """text → id over the ordinary tokens of whole, non-empty text (`texts`: `token_texts`), one
    id per text."""
    specials, by_text = special_ids(tokenizer), {}
    for i, text in enumerate(texts):
        if i in specials or not text or "\ufffd" in text:
            continue
        by_text.setdefault(text, []).append(i)
    return {text: _canonical(tokenizer, text, ids) for text, ids in by_text.items()}


def _canonical(tokenizer, text: str, ids: list[int]) -> int:
    """Of the ids sharing a text, the one the tokenizer encodes the text as, else the lowest."""
    if len(ids) > 1:
        own = encode_piece(tokenizer, text)
        if len(own) == 1 and own[0] in ids:
            return own[0]
    return ids[0]


@functools.lru_cache(maxsize=8)
def intersect(target_tokenizer, draft_tokenizer) -> VocabMap:
    """The token-level intersection of two tokenizers (memoized per pair)."""
    t_size, d_size = tokenizer_size(target_tokenizer), tokenizer_size(draft_tokenizer)
    t_texts = token_texts(target_tokenizer, t_size)
    target = _by_text(target_tokenizer, t_texts)
    d_texts = token_texts(draft_tokenizer, d_size)
    draft = _by_text(draft_tokenizer, d_texts)
    shared = sorted((target[text], draft[text]) for text in target.keys() & draft.keys())
    texts = [text if text is not None else target_tokenizer.decode([i]) for i, text in enumerate(t_texts)]
    specials = special_ids(draft_tokenizer)
    written = [None if i in specials or not text or "\ufffd" in text else text
               for i, text in enumerate(d_texts)]
    return VocabMap([t for t, _ in shared], [d for _, d in shared], t_size, d_size, texts,
                    draft_tokenizer, written)


def ordinary_count(tokenizer) -> int:
    """How many of a tokenizer's tokens could be shared at most: its ids less its special ones."""
    return tokenizer_size(tokenizer) - len(special_ids(tokenizer))
