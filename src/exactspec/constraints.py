"""Structured output: a JSON Schema, any JSON object, a regular expression or a Lark grammar, as
the tokens allowed after each prefix (llguidance's matcher).

The **constrained target**: at each position, the target's logits with the tokens the grammar
does not allow after the row's prefix set to −inf, then the row's settings (temperature, top-k,
top-p; greedy is the argmax of the allowed tokens). The prefix of a position is the row's
committed tokens, then the drafts before that position. q is made the same way from the draft's
logits (the same-processing rule), so the verification rule is unchanged and the output follows
the constrained target exactly. EOS is allowed where the grammar may end, and is the only token
allowed once it must.

A row's matcher holds its committed tokens; a position after drafts consumes them, reads the mask
and rolls them back (`RowMatchers.allowed`), so no rejected draft stays in it. Masks are kept for
the round: the draft's mask after drafts x_1..x_i is the target's at the same position, computed
once. A draft the grammar does not allow has p(x) = 0, so it is rejected; the positions after it
are never kept, and are given the mask at the last allowed prefix (any distribution would do).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np
import torch

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON as `json.dumps` writes it (", " and ": ", no other whitespace): one layout, so the keys
# and punctuation of a schema are forced tokens (`RowMatchers.forced`).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_FORCED_MAX = 256  # tokens of forced text drafted at once, at most
# Text that ends a JSON value, tried in turn where a copied value seems to end (`RowMatchers.chain`).
VALUE_ENDS = ('",', '"', ",", "}", "]")


def _llguidance():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401  (the tokenizer bridge)
    except ImportError as error:
        raise ImportError("constraints need llguidance: pip install llguidance") from error
    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What a row's output must match. kind: "json_schema" (text: the schema as JSON),
    "json_object" (any JSON object; text ""), "regex" (the whole output matches it) or "lark"
    (a Lark grammar, llguidance's dialect). Checked when made: a bad one raises ValueError."""

    kind: str
    text: str = ""
    grammar: str = field(default="", compare=False, repr=False)  # llguidance's form, made here

    def __post_init__(self):
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")
        if not isinstance(self.text, str):
            raise ValueError(f"constraint text must be a string, got {type(self.text).__name__}")
        object.__setattr__(self, "grammar", _compile(self.kind, self.text))

    @classmethod
    def json_schema(cls, schema: dict | str) -> "Constraint":
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        return cls("lark", grammar)

    def schema(self) -> dict | None:
        """The JSON Schema an output must validate against (None for regex and Lark)."""
        if self.kind == "json_object":
            return {"type": "object"}
        return json.loads(self.text) if self.kind == "json_schema" else None


def _compile(kind: str, text: str) -> str:
    """llguidance's grammar for a constraint, validated: ValueError naming the kind otherwise."""
    LLMatcher = _llguidance().LLMatcher
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(text) if kind == "json_schema" else {"type": "object"}
        except json.JSONDecodeError as error:
            raise ValueError(f"json_schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(text)
    else:
        grammar = LLMatcher.grammar_from_lark(text)
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        lines = problem.strip().splitlines()  # llguidance's first line, and its "error:" lines
        said = [lines[0], *(line.strip() for line in lines[1:] if line.strip().startswith("error:"))]
        raise ValueError(f"{kind} is not valid: {'; '.join(said)}")
    return grammar


def as_constraint(value) -> Constraint | None:
    """A `Constraint`, None, or a dict {"json_schema": ...} / {"regex": ...} / {"lark": ...} /
    {"json_object": True}."""
    if value is None or isinstance(value, Constraint):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (kind, text), = value.items()
        if kind == "json_object":
            return Constraint.json_object()
        if kind == "json_schema":
            return Constraint.json_schema(text)
        return Constraint(kind, text)
    raise ValueError(f"constraint must be a Constraint or a dict with one of the keys "
                     f"{CONSTRAINT_KINDS}, got {value!r}")


def matcher_tokenizer(tokenizer, vocab: int, eos: set[int], memory=None):
    """llguidance's view of a Hugging Face (fast) tokenizer over the first `vocab` token ids,
    made once per vocabulary and EOS set (~1 s) and kept in `memory` (the target's
    `models.loaded.Memory`, whose tokenizer this is; None: made afresh)."""
    if tokenizer is None:
        raise ValueError("a constraint needs the target's tokenizer: pass the model with its "
                         "tokenizer (a LoadedModel or (model, tokenizer))")
    known = {} if memory is None else memory.matcher_tokenizers
    key = (vocab, tuple(sorted(eos)))
    if key not in known:
        size = max(vocab, len(tokenizer))
        known[key] = _llguidance().hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=list(key[1]))
    return known[key]


class RowMatchers:
    """One llguidance matcher per row of a batch (None for an unconstrained row), in batch order,
    each holding the tokens its row has committed. `memory`: the target's (`models.loaded.Memory`),
    where the tables made from its tokenizer are kept."""

    def __init__(self, tokenizer, vocab: int, eos: set[int], memory=None):
        self.tokenizer, self.vocab, self.eos, self.memory = tokenizer, vocab, eos, memory
        self.rows: list = []  # LLMatcher or None per row
        self.consumed: list[int] = []  # new tokens each matcher holds
        self.masks: dict = {}  # (row, drafts before) → bool[V], for the round
        self.seconds = 0.0  # spent in the matchers: masks, consuming, forced tokens

    def __bool__(self) -> bool:
        return any(m is not None for m in self.rows)

    def join(self, constraints) -> None:
        """Rows appended at the end of the batch, each with its Constraint or None."""
        constraints = list(constraints)
        if any(constraints):
            if not self.eos:
                raise ValueError("a constraint needs an end-of-sequence token to end on: "
                                 "eos_token_id is empty")
            llg, tokenizer = _llguidance(), matcher_tokenizer(self.tokenizer, self.vocab, self.eos,
                                                                 self.memory)
        for constraint in constraints:
            self.rows.append(None if constraint is None
                             else llg.LLMatcher(tokenizer, constraint.grammar, log_level=0))
            self.consumed.append(0)
        self.masks = {}

    def select(self, going: torch.Tensor) -> None:
        keep = going.tolist()
        self.rows = [self.rows[i] for i in keep]
        self.consumed = [self.consumed[i] for i in keep]
        self.masks = {}

    def advance(self, new: list[list[int]]) -> None:
        """Each row's matcher takes the tokens its row committed since (new[b]: all of them)."""
        started = time.perf_counter()
        for b, (matcher, tokens) in enumerate(zip(self.rows, new)):
            if matcher is None or self.consumed[b] == len(tokens):
                continue
            fresh = [t for t in tokens[self.consumed[b]:] if t not in self.eos]
            if fresh and not matcher.consume_tokens(fresh):
                raise RuntimeError(f"row {b} committed tokens its grammar does not allow: "
                                   f"{matcher.get_error()}")
            self.consumed[b] = len(tokens)
        self.masks = {}
        self.seconds += time.perf_counter() - started

    def forced(self, limit: int | None) -> list[list[int]]:
        """Each row's forced text as tokens, at most `limit` (None: all of them); [] for an
        unconstrained row. The forced text is what the grammar allows next and nothing else: first
        the tokens it forces (llguidance's fast-forward tokens, each the only token allowed: p = 1
        under the mask), then the forced bytes no token is forced for, as the tokenizer writes
        them (`_forced_next`)."""
        return [self.chain(b, [], _FORCED_MAX if limit is None else limit) for b in range(len(self.rows))]

    def _forced_next(self, matcher) -> list[int]:
        """The tokens the matcher's grammar forces next; when it forces none, the tokenizer's own
        tokens for the bytes it forces (the part it allows, which may be none). Those bytes have
        another spelling in tokens (after '": ' the grammar forces ' "', and a token starting
        ' "' and going on into the value would also be allowed), so the mask allows more than the
        canonical token and the target may reject it: a guess, made from the prefix alone, which
        a text laid out as the tokenizer writes it keeps. A value then starts right after a pass:
        its first token is that pass's bonus."""
        tokens = matcher.compute_ff_tokens()
        if tokens:
            return tokens
        try:
            text = matcher.compute_ff_bytes().decode("utf-8")
        except UnicodeDecodeError:  # forced bytes end inside a character
            return []
        return self._spelled(matcher, text)

    def _spelled(self, matcher, text: str) -> list[int]:
        """`text` as the tokenizer writes it, within the vocabulary, cut to what the matcher allows."""
        tokens = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        tokens = [t for t in tokens if t < self.vocab]
        return tokens[: matcher.validate_tokens(tokens)]

    def chain(self, b: int, start: list[int], gamma: int, lookup=None) -> list[int]:
        """Row b's point-mass drafts: `start` (allowed by its grammar), then, while shorter than
        γ, its forced text (`_forced_next`), else the continuation of `lookup(drafts so far, n,
        how many of them end in forced text)` → (tokens, whether the value they copy ends after
        them) cut where the grammar stops allowing it. Where the value seems to end (lookup says
        so, or the grammar cut its continuation), the value's end is guessed (`_value_end`) and
        the chain stops: the next value's first token is the pass's bonus. The matcher is rolled
        back afterwards."""
        matcher = self.rows[b]
        if matcher is None:
            return list(start)
        started = time.perf_counter()
        drafts = list(start)
        taken = matcher.try_consume_tokens(drafts)
        guessed = False  # a value's end was guessed: what comes after it is the next pass's
        forced = 0  # drafts at the end that are forced text
        while len(drafts) < gamma and not guessed:
            more = self._forced_next(matcher)
            if more:
                forced += len(more)
            elif lookup is not None:
                more, ends = lookup(drafts, gamma - len(drafts), forced)
                allowed = matcher.validate_tokens(more)
                more, ends, forced = more[:allowed], ends or allowed < len(more), 0
                if ends:
                    more, guessed = more + self._value_end(matcher, more), True
            more = more[: gamma - len(drafts)]
            if not more:
                break
            taken += matcher.try_consume_tokens(more)
            drafts += more
        matcher.rollback(taken)
        self.seconds += time.perf_counter() - started
        return drafts

    def _value_end(self, matcher, before: list[int]) -> list[int]:
        """The tokens that end the value after `before` (allowed), as the tokenizer writes them:
        the first of `VALUE_ENDS` the grammar allows there, then the text it forces after that
        (`", "city": "` closing one string and opening the next key's); [] if none is allowed.
        A guess from the prefix alone, a point-mass draft: exact whatever it is."""
        taken = matcher.try_consume_tokens(before)
        guess = []
        for text in VALUE_ENDS:
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            if matcher.validate_tokens(tokens) == len(tokens):
                ended = matcher.try_consume_tokens(tokens)
                forced = matcher.compute_ff_bytes()
                matcher.rollback(ended)
                try:
                    text += forced.decode("utf-8")
                except UnicodeDecodeError:  # forced bytes end inside a character
                    pass
                guess = self._spelled(matcher, text)
                break
        matcher.rollback(taken)
        return guess

    def allowed_prefix(self, b: int, drafts: list[int]) -> int:
        """How many of `drafts` row b's grammar allows in a row (all of them unconstrained)."""
        matcher = self.rows[b]
        return len(drafts) if matcher is None else matcher.validate_tokens(drafts)

    def allowed(self, drafts: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """bool[b, n, V]: the tokens allowed at each of n positions, position j after the drafts
        drafts[:, : k − n + 1 + j] (k = drafts.size(1); the last position follows every draft);
        None when no row is constrained."""
        if not self:
            return None
        k = 0 if drafts is None else drafts.size(1)
        if k < n - 1:
            raise ValueError(f"drafts must hold at least n - 1 = {n - 1} tokens per row, got {k}")
        rows = [[] for _ in self.rows] if drafts is None else drafts.tolist()
        out = torch.ones(len(self.rows), n, self.vocab, dtype=torch.bool)  # [b, n, V]
        for b, matcher in enumerate(self.rows):
            if matcher is not None:
                for j in range(n):
                    out[b, j] = self._mask(b, tuple(rows[b][: k - n + 1 + j]))
        return out

    def _mask(self, b: int, before: tuple[int, ...]) -> torch.Tensor:
        """bool[V]: what row b's grammar allows after its committed tokens and `before`."""
        key = (b, before)
        if key not in self.masks:
            started = time.perf_counter()
            matcher = self.rows[b]
            taken = matcher.try_consume_tokens(list(before))  # stops at a token not allowed
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            matcher.rollback(taken)
            mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))
            if not mask.any():
                raise RuntimeError(f"row {b}'s grammar allows no token: {matcher.get_error()}")
            self.masks[key] = mask
            self.seconds += time.perf_counter() - started
        return self.masks[key]

    def bind(self, sampling) -> "Masked":
        """The round's settings with each row's mask applied first."""
        return Masked(sampling, self)


class Masked:
    """A round's settings (any object with `probs(logits, drafts=...)`) with each row's grammar
    mask applied to the logits before them: the constrained target's p, or the draft's q."""

    def __init__(self, sampling, matchers: RowMatchers):
        self.sampling, self.matchers = sampling, matchers

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """logits[b, n, V] (or [b, V], n = 1) → probabilities, position j after the drafts
        drafts[:, : k − n + 1 + j] (see `RowMatchers.allowed`)."""
        single = logits.dim() == 2
        scores = logits.unsqueeze(1) if single else logits  # [b, n, V]
        allowed = self.matchers.allowed(drafts, scores.size(1))  # [b, n, V]
        if allowed is not None:
            scores = scores.masked_fill(~allowed.to(scores.device), -torch.inf)  # [b, n, V]
        return self.sampling.probs(scores[:, 0] if single else scores, drafts=drafts)
