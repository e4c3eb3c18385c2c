"""The grammar draft: the tokens a constraint forces next, proposed as point-mass drafts, in front
of any other drafter (which drafts the rounds where the grammar forces nothing)."""
from __future__ import annotations

import re

import torch

from exactspec.drafters.base import Proposal, drafter_lag
from exactspec.drafters.ngram import space_folding
from exactspec.sampling import SamplingConfig

GRAMMAR = "grammar"  # the source of a round of grammar-forced drafts
WORD_TAIL = 3  # tokens read back for the word being written (`word_rest`)
LOOKAHEAD = 2  # tokens of the passage read past a continuation for where its clause ends
CLAUSE_END = re.compile(r"[,.;!?](?=\s|$)")  # a copied value most often ends right before one


def word_rest(tokenizer, tokens: list[int], n: int) -> tuple[list[int], bool]:
    """The rest of the word the context ends inside, when the earlier context completes it one way
    only, tokenized, at most n, and whether a clause ends right after it there; ([], False)
    otherwise. A value copied into a JSON string can split its first word unlike the passage
    (`"Val` + `encia` against ` Valencia`), where token lookup finds nothing; the text still does.
    A point-mass guess like any lookup draft: exact whatever it is."""
    if tokenizer is None or len(tokens) <= WORD_TAIL:
        return [], False
    partial = re.search(r"\w+$", tokenizer.decode(tokens[-WORD_TAIL:]))
    if partial is None:
        return [], False
    before = tokenizer.decode(tokens[:-WORD_TAIL])
    rests = {(found.group(1), CLAUSE_END.match(before, found.end()) is not None)
             for found in re.finditer(rf"(?<!\w){re.escape(partial.group())}(\w+)", before)}
    if len(rests) != 1:
        return [], False
    rest, ends = rests.pop()
    tokens = tokenizer.encode(rest, add_special_tokens=False)
    return tokens[:n], ends and len(tokens) <= n


def clause_cut(tokenizer, tokens: list[int], n: int) -> tuple[list[int], bool]:
    """The first n of a passage's tokens, cut before the first clause end (`CLAUSE_END`) within
    them, and whether it was cut there."""
    for i in range(min(n + 1, len(tokens))):
        if CLAUSE_END.match(tokenizer.decode(tokens[i:i + LOOKAHEAD])):
            return tokens[:i], True
    return tokens[:n], False


class GrammarDrafter:
    """Before each round, from the committed tokens only (the past-only rule): when a row's
    grammar forces its next tokens (the keys and punctuation of a schema, a closing quote: its
    matcher's fast-forward tokens), the round drafts them (source "grammar", point-mass: the
    target keeps each with probability p(x) under its mask, exact by the point-mass rule);
    otherwise `inner` drafts, and its point-mass drafts are cut before the first token the row's
    grammar does not allow (that token could only be rejected). Point-mass drafts go on up to γ
    (`RowMatchers.chain`): forced tokens, else prompt lookup's continuation after the drafts so
    far (`_follow`: a value copied from the prompt, ended where the passage's clause ends, then
    the punctuation and key after it); a lookup round is that chain from its first token. The
    inner drafter sees a round it did not draft afterwards (`observe`), as the auto draft's idle
    one does.

    A grammar round drafts every forced token, then up to γ more (γ = 0: the forced ones only):
    under the mask a forced token is the only one allowed, p(x) = 1, so it is always kept and
    costs only its share of the pass (`free`: the controller prices them as kept and chooses the
    tail after them). Forced bytes no token is forced for are drafted too, as the tokenizer writes
    them, but those are a guess the target may reject (`RowMatchers.forced`). Prompt lookup matches tokens folded to their
    text without a leading space (`ngram.space_folding`): a value starts a JSON string without the
    space it has in the passage.
    `matchers` (a `constraints.RowMatchers`) is the Decoder's, kept at the committed tokens;
    `budget()` the most tokens any row may still generate; `inner` needs
    `observe(drafts, num_accepted, next_tokens)` (every drafter here has one)."""

    def __init__(self, inner, matchers, budget):
        self.inner, self.matchers, self.budget, self.source = inner, matchers, budget, None
        self.own = False  # whether this round's drafts are ours (forced, or the inner's cut)
        self.forced: list[list[int]] = []  # each row's forced tokens, for the round
        self.scored = True  # whether the last round's evidence counts (`evidence`)
        self.lookup = inner if hasattr(inner, "match_length") else getattr(inner, "lookup", None)
        self.name = inner.name  # timings belong to the model draft; α is kept per source
        self._fold()  # rows joining a running batch: the lookup has started

    calls = property(lambda self: self.inner.calls)
    tokens_fed = property(lambda self: self.inner.tokens_fed)
    padding_fed = property(lambda self: self.inner.padding_fed)
    catch_up = property(lambda self: (0.0, 0) if self.source == GRAMMAR
                        else getattr(self.inner, "catch_up", (0.0, 0)))

    def bind(self, target, total_tokens: int) -> int:
        return self.inner.bind(target, total_tokens)

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.inner.start(input_ids, valid, vocab_size)
        self._fold()

    def _fold(self) -> None:
        if self.lookup is not None and self.matchers.tokenizer is not None:
            self.lookup.fold_spaces(space_folding(self.matchers.tokenizer))

    def lag(self) -> int:
        return 0 if self.next_source() == GRAMMAR else drafter_lag(self.inner)

    def next_source(self) -> str:
        if self.source is None:
            self.forced = self.matchers.forced(None)
            self.source = GRAMMAR if any(self.forced) else self.inner.next_source()
        return self.source

    def free(self) -> int:
        """The forced drafts of the next round that every row has (0 unless a grammar round),
        within the budget: drafted whatever γ is, and kept (forced bytes no token is forced for
        are a guess, priced as kept too: a text laid out as the tokenizer writes it keeps them)."""
        if self.next_source() != GRAMMAR:
            return 0
        return min(min(len(forced), self._room()) for forced in self.forced)

    def _room(self) -> int:
        """The most drafts a row may have: one token of the budget is the round's own."""
        return max(self.budget() - 1, 0)

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        self.own = True
        if self.next_source() == GRAMMAR:  # every forced token, then up to γ more, within the budget
            cap = self._room()
            return self._point_mass([self._chain(b, [], min(len(forced) + gamma, cap))
                                     for b, forced in enumerate(self.forced)])
        proposal = self.inner.propose(gamma, sampling, generator)
        if proposal.q is not None:  # model drafts come from a masked q: all allowed
            self.own = False
            return proposal
        if self.lookup is not None:  # prompt lookup's round: its proposal, read by `_follow`
            return self._point_mass([self._chain(b, [], gamma) for b in range(len(self.forced))])
        drafts = proposal.tokens.tolist()
        lengths = proposal.lengths or [len(row) for row in drafts]
        starts = [row[: min(n, self.matchers.allowed_prefix(b, row[:n]))]
                  for b, (row, n) in enumerate(zip(drafts, lengths))]
        return self._point_mass([self._chain(b, start, gamma) for b, start in enumerate(starts)])

    def _chain(self, b: int, start: list[int], gamma: int) -> list[int]:
        index = self.lookup.rows[b] if self.lookup is not None else None
        return self.matchers.chain(b, start, gamma, None if index is None else
                                   lambda drafts, n, forced: self._follow(index, drafts, n, forced))

    def _follow(self, index, drafts: list[int], n: int, forced: int) -> tuple[list[int], bool]:
        """Prompt lookup's next tokens after the drafts, at most n: the token lookup's
        continuation, else the rest of a split word (`word_rest`); and whether the passage's
        clause ends right after them, where the chain guesses that the value ends too. After
        `forced` drafts of forced text the match must reach past them: a key and its `": "`
        are the same before every value, so a match of them alone proposes the wrong value."""
        tokenizer, min_n = self.matchers.tokenizer, max(self.lookup.min_ngram, forced + 1)
        more = index.continuation(drafts, n + LOOKAHEAD, min_n, self.lookup.rule)
        if more:
            return clause_cut(tokenizer, more, n) if tokenizer is not None else (more[:n], False)
        return word_rest(tokenizer, index.tokens + drafts, n)

    def _point_mass(self, rows: list[list[int]]) -> Proposal:
        """Drafts per row, padded to the longest by repeating a row's last (any deterministic
        padding is exact; per-row decoding verifies only `lengths`)."""
        width = max(len(row) for row in rows)
        padded = [row + [row[-1] if row else 0] * (width - len(row)) for row in rows]
        self.drafts = torch.tensor(padded, dtype=torch.long).view(len(rows), width)  # [B, γ']
        return Proposal(self.drafts, None, [len(row) for row in rows])

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        if self.own:
            self.inner.observe(self.drafts, num_accepted, next_tokens)
        else:
            self.inner.commit(num_accepted, next_tokens)
        self.scored = self.source != GRAMMAR
        self.source, self.own = None, False

    def evidence(self) -> dict:
        """The inner drafter's scores of itself (`NGramDrafter.evidence`), except after a grammar
        round: where the grammar forces the tokens, lookup never drafts, so its hits and misses
        there say nothing about the rounds it does draft."""
        scores = self.inner.evidence() if hasattr(self.inner, "evidence") else {}  # drained
        return scores if self.scored else {}

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        self.inner.join(input_ids, valid)
        self.source = None
