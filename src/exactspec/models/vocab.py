"""Can two models share a round? Their vocabularies, compared token by token (the same map, or
drafting through their token-level intersection: `vocab_map`); and prompt encoding."""
from __future__ import annotations

import functools

import torch

from exactspec.models.loaded import (
    LoadedModel, output_vocab_size, tokenizer_size, unwrap_model, vocabulary,
)
from exactspec.models.vocab_map import MIN_SHARED, VocabMap, intersect, ordinary_count

SHARED, INTERSECTION = "shared vocabulary", "token-level intersection"  # `pair_method`'s answers
STRING_LEVEL = "string-level: the draft's text in the target's tokens, proposed as point-mass drafts"


def _describe(obj, role: str) -> str:
    return f"{role} {obj.name!r}" if isinstance(obj, LoadedModel) else role


def check_compatible(target, draft) -> int:
    """Check that target and draft number tokens the same way; return the usable vocabulary V.

    Each argument is a LoadedModel, a (model, tokenizer) pair, or a bare model. With both
    tokenizers, their token → id maps must be equal (sizes alone prove nothing); the output
    layers may be padded past V, differently for each model. Without a tokenizer on a side, the
    two output sizes must be equal, since padding cannot be told from real ids.
    Raises ValueError naming the first id that differs.
    """
    t_model, t_tok, _ = unwrap_model(target, "target")
    d_model, d_tok, _ = unwrap_model(draft, "draft")
    t_name, d_name = _describe(target, "target"), _describe(draft, "draft")
    t_rows, d_rows = output_vocab_size(t_model), output_vocab_size(d_model)

    if t_tok is not None and d_tok is not None:
        if t_tok is not d_tok and not _same_vocabulary(t_tok, d_tok):
            t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
            raise ValueError(_vocab_difference(t_vocab, d_vocab, t_name, d_name))
        size = tokenizer_size(t_tok)
    elif t_tok is None and d_tok is None:
        if t_rows != d_rows:
            raise ValueError(f"{t_name} and {d_name} have no tokenizers to compare, and their "
                             f"output sizes differ: {t_rows} vs {d_rows} token ids")
        size = t_rows
    else:
        size = tokenizer_size(t_tok if t_tok is not None else d_tok)
        if t_rows != d_rows:
            missing = d_name if d_tok is None else t_name
            raise ValueError(f"{missing} has no tokenizer to compare, and the output sizes differ: "
                             f"{t_name} {t_rows}, {d_name} {d_rows} token ids")
    for label, rows in ((t_name, t_rows), (d_name, d_rows)):
        if rows < size:
            raise ValueError(f"{label} scores only {rows} token ids, but the tokenizer has {size}")
    return size


def check_token_list(target, tokens: list[str], draft_name: str) -> int:
    """Check a draft known by its token list (id i is tokens[i], as in a GGUF file) against the
    target's tokenizer; return the usable vocabulary V. Raises ValueError naming the first id
    that differs, as `check_compatible` does."""
    _, t_tok, _ = unwrap_model(target, "target")
    t_name = _describe(target, "target")
    if t_tok is None:
        raise ValueError(f"{t_name} has no tokenizer to compare with the {draft_name}'s token list")
    if not _same_tokens(t_tok, tuple(tokens)):
        t_vocab, d_vocab = dict(vocabulary(t_tok)), {token: i for i, token in enumerate(tokens)}
        raise ValueError(_vocab_difference(t_vocab, d_vocab, t_name, draft_name))
    return tokenizer_size(t_tok)


def pair_method(target, draft) -> str:
    """How `draft` drafts for `target`: SHARED when their tokenizers map tokens to ids alike, or a
    side has no tokenizer to tell (`check_compatible` then compares output sizes); INTERSECTION
    when both have tokenizers whose maps differ (`check_intersection`, `drafters.tli`)."""
    _, t_tok, _ = unwrap_model(target, "target")
    _, d_tok, _ = unwrap_model(draft, "draft")
    if t_tok is None or d_tok is None or t_tok is d_tok or _same_vocabulary(t_tok, d_tok):
        return SHARED
    return INTERSECTION


def token_list_method(target, tokens: tuple[str, ...]) -> str:
    """`pair_method` for a draft known by its token list (a GGUF's): SHARED when the target has
    no tokenizer to tell (`check_token_list` then refuses it) or maps tokens to ids as the list
    does, else INTERSECTION."""
    _, t_tok, _ = unwrap_model(target, "target")
    return SHARED if t_tok is None or _same_tokens(t_tok, tuple(tokens)) else INTERSECTION


def describe_pair(target, draft) -> str:
    """Which way `draft` drafts for `target` by default, in words: SHARED, or STRING_LEVEL
    (`drafters.strings`) for a draft of another vocabulary."""
    return SHARED if pair_method(target, draft) == SHARED else STRING_LEVEL


def check_intersection(target, draft) -> VocabMap:
    """The token-level intersection of the target's and the draft's tokenizers (both needed).
    Raises ValueError, naming the first id that differs and the intersection's size, when it
    holds fewer than MIN_SHARED of the draft's ordinary (not special) tokens."""
    _, t_tok, _ = unwrap_model(target, "target")
    _, d_tok, _ = unwrap_model(draft, "draft")
    t_name, d_name = _describe(target, "target"), _describe(draft, "draft")
    if t_tok is None or d_tok is None:
        missing = t_name if t_tok is None else d_name
        raise ValueError(f"{missing} has no tokenizer: a token-level intersection needs both")
    shared, ordinary = intersect(t_tok, d_tok), ordinary_count(d_tok)
    if len(shared) < max(1, MIN_SHARED * ordinary):
        t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
        raise ValueError(f"{t_name} and {d_name} have different vocabularies ({len(t_vocab)} vs "
                         f"{len(d_vocab)} tokens): {_first_difference(t_vocab, d_vocab, t_name, d_name)}, "
                         f"and their token-level intersection holds {len(shared)} of the {d_name}'s "
                         f"{ordinary} ordinary tokens (drafting through it needs {MIN_SHARED:.0%})")
    return shared


@functools.lru_cache(maxsize=16)
def _same_vocabulary(tokenizer, other) -> bool:
    """Whether two tokenizers map tokens to ids alike; memoized (each generation with a model
    draft checks it, and comparing 49k pairs takes ~28 ms: 1 % of a 32-token generation)."""
    return vocabulary(tokenizer) == vocabulary(other)


@functools.lru_cache(maxsize=4)
def _same_tokens(tokenizer, tokens: tuple[str, ...]) -> bool:
    """Whether a tokenizer's map is the token list's; memoized (each generation checks it, and
    comparing 49k pairs takes tens of ms)."""
    return vocabulary(tokenizer) == _sorted_token_list(tokens)


@functools.lru_cache(maxsize=4)
def _sorted_token_list(tokens: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """A token list as `vocabulary` gives a tokenizer's map: (token, id) pairs, sorted."""
    return tuple(sorted((token, i) for i, token in enumerate(tokens)))


def _vocab_difference(t_vocab: dict, d_vocab: dict, t_name: str, d_name: str) -> str:
    return (f"{t_name} and {d_name} have different vocabularies ({len(t_vocab)} vs {len(d_vocab)} "
            f"tokens): {_first_difference(t_vocab, d_vocab, t_name, d_name)}; a draft that shares "
            "the target's rounds token for token needs the same tokenizer vocabulary (a TLIDrafter "
            "drafts through the token-level intersection instead)")


def _first_difference(t_vocab: dict, d_vocab: dict, t_name: str, d_name: str) -> str:
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    d_by_id = {i: tok for tok, i in d_vocab.items()}
    absent = "absent"
    for i in sorted(set(t_by_id) | set(d_by_id)):
        t_tok, d_tok = t_by_id.get(i, absent), d_by_id.get(i, absent)
        if t_tok != d_tok:
            where = f"token id {i} is {t_tok!r} in the {t_name}'s vocabulary but {d_tok!r} in the {d_name}'s"
            break
    else:  # same ids and tokens one way round, so a token has two ids on one side
        tok = next(t for t in sorted(set(t_vocab) | set(d_vocab)) if t_vocab.get(t) != d_vocab.get(t))
        where = f"token {tok!r} has id {t_vocab.get(tok)} in the {t_name}'s vocabulary but {d_vocab.get(tok)} in the {d_name}'s"
    return where


def encode_prompt(loaded: LoadedModel, text: str, chat: bool | None = None,
                  reply_start: str = "", history=()) -> torch.Tensor:
    """Token ids [1, L] of one user prompt: through the tokenizer's chat template when `chat`
    is True, or when it is None and the tokenizer has a template; plain encoding otherwise.
    reply_start: text the reply begins with, encoded after the prompt (no special tokens);
    history: earlier turns, (role, content) pairs put before the prompt (a chat template's only)."""
    if not text.strip():
        raise ValueError("the prompt is empty")
    tokenizer = loaded.tokenizer
    if tokenizer is None:
        raise ValueError(f"model {loaded.name!r} has no tokenizer to encode the prompt")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if (chat or history) and not has_template:
        raise ValueError(f"chat: the tokenizer of {loaded.name!r} has no chat template")
    if chat or history or (chat is None and has_template):
        turns = [*({"role": role, "content": content} for role, content in history),
                 {"role": "user", "content": text}]
        encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_tensors="pt")
        ids = encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]
    else:
        ids = tokenizer(text, return_tensors="pt").input_ids
    if reply_start:
        start = tokenizer(reply_start, add_special_tokens=False, return_tensors="pt").input_ids
        ids = torch.cat([ids, start], dim=1)  # [1, L]
    return ids.to(torch.long)  # [1, L]
