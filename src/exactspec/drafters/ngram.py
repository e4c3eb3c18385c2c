"""Prompt lookup: a point-mass draft copied from earlier in the sequence, at zero model cost."""
from __future__ import annotations

import torch

from exactspec.drafters.base import Drafter, Proposal
from exactspec.models import usable_vocab
from exactspec.models.loaded import Memory
from exactspec.sampling import SamplingConfig


ONE_TOKEN_MATCH = "ngram-1"  # the source of a lookup whose longest match is one token


def space_folding(tokenizer, memory: Memory | None = None) -> dict[int, int]:
    """token → the token of the same text without its leading space (byte-level BPE's "Ġ",
    SentencePiece's "▁"), for the tokens that have one; computed once and kept in `memory` (the
    target's, whose tokenizer this is; None: computed afresh). A value copied into a JSON string
    starts without the space it has in the passage ("Maria" against " Maria"), so matching folded
    tokens lets lookup find the passage from a value's first word."""
    if memory is not None and memory.folding is not None:
        return memory.folding
    vocab = tokenizer.get_vocab()  # text → token
    folding = {token: vocab[text[1:]] for text, token in vocab.items()
               if text[:1] in ("Ġ", "▁") and text[1:] in vocab}
    if memory is not None:
        memory.folding = folding
    return folding


class SuffixIndex:
    """Where each n-gram (n = 1..max_n) of one row's tokens ends, updated as tokens arrive:
    appending a token costs max_n dictionary inserts, whatever the length of the context.
    With a `folding` (`space_folding`), n-grams are matched by their folded tokens; what a
    match proposes is still the row's own tokens."""

    def __init__(self, tokens: list[int], max_n: int, folding: dict[int, int] | None = None):
        self.tokens, self.keys, self.max_n, self.ends = [], [], max_n, {}
        self.folding = folding or {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            self.keys.append(self.folding.get(token, token))
            end = len(self.keys) - 1
            for n in range(1, min(self.max_n, end + 1) + 1):
                self.ends.setdefault(tuple(self.keys[end - n + 1:]), []).append(end)

    def lookup(self, min_n: int, rule: str) -> tuple[int, int | None]:
        """(n, end) of the longest earlier match of the last n tokens (n ≥ min_n), the earliest or
        the latest occurrence by `rule`; (0, None) when nothing matches."""
        last = len(self.keys) - 1
        for n in range(min(self.max_n, last), min_n - 1, -1):
            ends = self.ends.get(tuple(self.keys[last - n + 1:]), [])
            if len(ends) > 1:  # the last entry is the suffix itself
                return n, ends[0] if rule == "earliest" else ends[-2]
        return 0, None

    def continuation(self, extra: list[int], gamma: int, min_n: int, rule: str) -> list[int]:
        """The lookup as if `extra` followed the tokens (read only): what followed the chosen
        earlier occurrence of the longest suffix (n ≥ min_n) of tokens + extra, at most γ."""
        extra = [self.folding.get(token, token) for token in extra]
        tail, last = (self.keys + extra)[-self.max_n - 1:], len(self.tokens) - 1
        for n in range(min(self.max_n, len(tail) - 1), min_n - 1, -1):
            ends = [e for e in self.ends.get(tuple(tail[-n:]), []) if e < last]  # a token follows
            if ends:
                end = ends[0] if rule == "earliest" else ends[-1]
                return self.tokens[end + 1: end + 1 + gamma]
        return []


class NGramDrafter(Drafter):
    """Prompt lookup: propose the tokens that followed an earlier occurrence of the longest
    suffix of the row's context (prompt + generated tokens) that occurred before, up to max_ngram
    tokens long (`SuffixIndex`). rule "latest" (the default) takes the most recent occurrence,
    "earliest" the first: on six grounded prompts both kept the same tokens per round, and
    "latest" wasted fewer drafts. Zero model cost; a point-mass draft (q = None),
    exact by the point-mass rule. A row with fewer than γ tokens to propose is padded by
    repeating its last proposal (or last token): any deterministic proposal is exact.

    It also scores itself (`evidence`): before each token a row commits, the token its lookup
    would have proposed there is compared with it. A point-mass draft x is kept with probability
    p(x), and a committed token equals x with that same probability, so the hit rate estimates
    the lookup's α at every committed position, drafted or not, from committed tokens alone."""

    sources = ("ngram", ONE_TOKEN_MATCH)

    name = "ngram"
    calls = tokens_fed = padding_fed = 0
    folding = None  # set by `fold_spaces` for one generation

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1, rule: str = "latest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if rule not in ("earliest", "latest"):
            raise ValueError(f"rule must be 'earliest' or 'latest', got {rule!r}")
        self.max_ngram, self.min_ngram, self.rule = max_ngram, min_ngram, rule

    def bind(self, target, total_tokens: int) -> int:
        return usable_vocab(target)  # it proposes tokens of the sequence itself

    def start(self, input_ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> None:
        self.rows, self.tallies, self.folding = [], [], None
        self.join(input_ids, valid)

    def fold_spaces(self, folding: dict[int, int]) -> None:
        """Until the next `start`, match n-grams by their folded tokens (`space_folding`); the
        rows so far are indexed again."""
        self.folding = folding
        self.rows = [SuffixIndex(row.tokens, self.max_ngram, folding) for row in getattr(self, "rows", [])]

    def next_source(self) -> str:
        return self.source(self.match_length())

    @staticmethod
    def source(match: int) -> str:
        """"ngram", or ONE_TOKEN_MATCH when the longest match (`match_length`) is one token: the
        γ controller keeps α per source, and a lookup from a one-token match (a common word, a
        newline) is kept far less often than one from a longer match."""
        return "ngram" if match >= 2 else ONE_TOKEN_MATCH

    def prompt_lookup(self) -> NGramDrafter:
        return self

    def match_length(self) -> int:
        """The longest match any row has now: how much the context supports a lookup."""
        return max(row.lookup(self.min_ngram, self.rule)[0] for row in self.rows)

    def lookup(self, row: SuffixIndex, gamma: int) -> list[int]:
        """The tokens that followed the chosen earlier match of the row's longest suffix, at most
        γ: how far to trust a match is the γ controller's call (α per source, "ngram" or
        ONE_TOKEN_MATCH, against the target's pass times; on a CPU a 5-token pass can cost less
        than a 3-token one, so a length rule of the drafter's own, such as 2n for a match of n,
        priced rounds it could not see)."""
        _, end = row.lookup(self.min_ngram, self.rule)
        return [] if end is None else row.tokens[end + 1: end + 1 + gamma]

    def propose(self, gamma: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        found = [self.lookup(row, gamma) for row in self.rows]
        width = max(len(f) for f in found)
        padded = [f + [(f or row.tokens)[-1]] * (width - len(f)) for f, row in zip(found, self.rows)]
        self.drafts = torch.tensor(padded, dtype=torch.long).view(len(padded), width)  # [B, γ']
        self.lengths = [len(f) for f in found]
        return Proposal(self.drafts, None, self.lengths)

    def commit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.observe(self.drafts, num_accepted, next_tokens)

    def observe(self, drafts: torch.Tensor, num_accepted: torch.Tensor,
                next_tokens: torch.Tensor) -> None:
        """Append what each row committed: its first num_accepted[b] drafts, then next_tokens[b],
        each scored against the lookup made just before it (`evidence`)."""
        for row, tally, kept, n, nxt in zip(self.rows, self.tallies, drafts.tolist(),
                                            num_accepted.tolist(), next_tokens.tolist()):
            for token in kept[:n] + [nxt]:
                match, end = row.lookup(self.min_ngram, self.rule)
                if end is not None:
                    tally[self.source(match)][0 if row.tokens[end + 1] == token else 1] += 1
                row.extend([token])

    def evidence(self) -> dict[str, list[tuple[int, int]]]:
        """source → each row's (hits, misses) of its lookups scored against the tokens committed
        since the last call (see the class docstring); the tallies restart."""
        out = {source: [tuple(tally[source]) for tally in self.tallies] for source in self.sources}
        self.tallies = [self._tally() for _ in self.rows]
        return out

    def _tally(self) -> dict[str, list[int]]:
        return {source: [0, 0] for source in self.sources}

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in rows.tolist()]
        self.tallies = [self.tallies[i] for i in rows.tolist()]

    def join(self, input_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """New rows (left-padded prompts [n, L]) join at a round boundary."""
        self.rows += [SuffixIndex(ids[ok].tolist(), self.max_ngram, self.folding)
                      for ids, ok in zip(input_ids, valid)]
        self.tallies += [self._tally() for _ in range(input_ids.size(0))]
