"""The grammar draft: the tokens a constraint forces next, proposed as point-mass drafts, in front
of any other drafter (which drafts the rounds where the grammar forces nothing)."""
from __future__ import annotations

import os
import re

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.drafters.ngram import space_folding
from exactspec.sampling import SamplingConfig

GRAMMAR = "grammar"  # the source of a round of grammar-forced drafts
WORD_TAIL = 3  # tokens read back for the word being written (`text_rest`)
REST_CHARS = 48  # the most of the earlier text `text_rest` reads after a word's start
LOOKAHEAD = 2  # tokens of the passage read past a continuation for where its clause ends
CLAUSE_END = re.compile(r"[,.;!?](?=\s|$)")  # a copied value most often ends right before one


def text_rest(tokenizer, tokens: list[int], n: int) -> tuple[list[int], bool]:
    """The text after the word the context ends inside, as the earlier context goes on after every
    word that starts so: their common part in whole words (`_shared_words`), each read up to where
    its clause ends (`_clause`), tokenized, at most n; and whether every one's clause ends right
    there. ([], False) when the context does not end inside a word or the earlier text never
    starts a word so. A value copied into a JSON string can split a word unlike the passage
    (`"Val` + `encia` against ` Valencia`), where token lookup finds nothing; the text still does,
    and where the word is whole already, its clause's end says where the value ends. A
    point-mass guess like any lookup draft: exact whatever it is."""
    if tokenizer is None or len(tokens) <= WORD_TAIL:
        return [], False
    partial = re.search(r"\w+$", tokenizer.decode(tokens[-WORD_TAIL:]))
    if partial is None:
        return [], False
    before = tokenizer.decode(tokens[:-WORD_TAIL])
    rests = [_clause(before, found.end())
             for found in re.finditer(rf"(?<!\w){re.escape(partial.group())}", before)]
    if not rests:
        return [], False
    common = _shared_words([text for text, _ in rests])
    ends = all(text == common and end for text, end in rests)
    tokens = tokenizer.encode(common, add_special_tokens=False) if common else []
    return tokens[:n], ends and len(tokens) <= n


def _shared_words(texts: list[str]) -> str:
    """The longest common start of the texts that ends where a word ends in every one of them
    (the rest of the word being written counts as one), without trailing space."""
    common = os.path.commonprefix(texts)
    if any(re.match(r"\w", text[len(common):]) for text in texts):
        common = re.sub(r"\w+$", "", common)
    return common.rstrip()


def _clause(text: str, start: int) -> tuple[str, bool]:
    """text[start:] up to the first clause end (`CLAUSE_END`), line end or REST_CHARS, whichever
    comes first, and whether it stopped at a clause end."""
    stop = min(len(text), start + REST_CHARS)
    line = text.find("\n", start, stop)
    stop = stop if line < 0 else line
    found = CLAUSE_END.search(text, start)
    if found is not None and found.start() <= stop:
        return text[start:found.start()], True
    return text[start:stop], False


def chain_score(guess: list[int], kept: int, token: int) -> tuple[int, int]:
    """(hits, misses) of a point-mass chain's first guess against what its round committed there:
    a hit when the round kept it, or when the token after no kept draft (the correction of a
    rejected first draft, or the token of a plain step, by which a round at γ = 0 scores its
    chain) is the guess; nothing without a guess. A point-mass draft x is kept with probability
    p(x), as often as a committed token is x, so both count. Only the first: a lookup round fails
    mostly there (a value's first token, a new match), and once that is kept the copy mostly goes
    on; so α of first guesses prices a round's risk, and the geometric model then prices longer
    blocks low rather than high, the safe side where a pass costs more the longer it is (on a
    2-core CPU the 1.5B target's pass over 4 tokens costs two of one)."""
    if not guess:
        return 0, 0
    hit = int(kept > 0 or guess[0] == token)
    return hit, 1 - hit


def clause_cut(tokenizer, tokens: list[int], n: int) -> tuple[list[int], bool]:
    """The first n of a passage's tokens, cut before the first clause end (`CLAUSE_END`) within
    them, and whether it was cut there."""
    for i in range(min(n + 1, len(tokens))):
        if CLAUSE_END.match(tokenizer.decode(tokens[i:i + LOOKAHEAD])):
            return tokens[:i], True
    return tokens[:n], False


class GrammarDrafter(Drafter):
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
        self.guesses: list[list[int]] | None = None  # a lookup round's chains, scored at commit
        self.scores: dict = {}  # the last lookup round's scores (`evidence`)
        self.lookup = inner.prompt_lookup()
        self.name = inner.name  # timings belong to the model draft; α is kept per source
        self._fold()  # rows joining a running batch: the lookup has started

    calls = property(lambda self: self.inner.calls)
    tokens_fed = property(lambda self: self.inner.tokens_fed)
    padding_fed = property(lambda self: self.inner.padding_fed)
    catch_up = property(lambda self: (0.0, 0) if self.source == GRAMMAR
                        else self.inner.catch_up)

    def bind(self, target, total_tokens: int) -> int:
        return self.inner.bind(target, total_tokens)

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.inner.start(input_ids, valid, vocab_size)
        self._fold()

    def _fold(self) -> None:
        if self.lookup is not None and self.matchers.tokenizer is not None:
            self.lookup.fold_spaces(space_folding(self.matchers.tokenizer, self.matchers.memory))

    def lag(self) -> int:
        return 0 if self.next_source() == GRAMMAR else self.inner.lag()

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
            proposal = self._point_mass([self._chain(b, [], min(len(forced) + gamma, cap))
                                         for b, forced in enumerate(self.forced)])
            proposal.forced = [min(len(forced), cap) for forced in self.forced]
            return proposal
        proposal = self.inner.propose(gamma, sampling, generator)
        if proposal.q is not None:  # model drafts come from a masked q: all allowed
            self.own = False
            return proposal
        if self.lookup is not None:  # prompt lookup's round: its proposal, read by `_follow`
            rows = range(len(self.forced))
            if self.source not in self.lookup.sources:
                return self._point_mass([self._chain(b, [], gamma) for b in rows])
            self.guesses = [self._chain(b, [], max(gamma, 1)) for b in rows]  # scored at γ = 0 too
            return self._point_mass([guess[:gamma] for guess in self.guesses])
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
        continuation, else the text after the word being written (`text_rest`); and whether the
        passage's clause ends right after them, where the chain guesses that the value ends too.
        After `forced` drafts of forced text the match must reach past them: a key and its `": "`
        are the same before every value, so a match of them alone proposes the wrong value."""
        tokenizer, min_n = self.matchers.tokenizer, max(self.lookup.min_ngram, forced + 1)
        more = index.continuation(drafts, n + LOOKAHEAD, min_n, self.lookup.rule)
        if more:
            return clause_cut(tokenizer, more, n) if tokenizer is not None else (more[:n], False)
        return text_rest(tokenizer, index.tokens + drafts, n)

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
        if self.guesses is not None:
            self.scores = {self.source: [chain_score(guess, kept, token) for guess, kept, token
                                         in zip(self.guesses, num_accepted.tolist(),
                                                next_tokens.tolist())]}
        self.source, self.own, self.guesses = None, False, None

    def evidence(self) -> dict:
        """Prompt lookup's scores of itself: with a lookup, those of the chains this drafter
        proposed (`chain_score`), in its lookup rounds only (where the grammar forces the tokens,
        or the model drafts, lookup does not); the inner's own (`NGramDrafter.evidence`) score a
        bare lookup, which the chain outdoes, so they are dropped. Without one, the inner's
        scores, except after a grammar round."""
        scores = self.inner.evidence()  # drained
        if self.lookup is not None:
            scores, self.scores = self.scores, {}
        return scores if self.scored else {}

    def select(self, rows: torch.Tensor) -> None:
        self.inner.select(rows)

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        self.inner.join(input_ids, valid)
        self.source = None
