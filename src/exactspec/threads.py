"""How many threads a llama.cpp draft's decodes run on, from what each count delivers now.

Beside a busy process on few cores, threads wait at every barrier for a descheduled one, and one
thread can beat all of them (docs/llamacpp.md: threads). Which holds changes while a process
runs, so a draft's count is measured, not configured. Only drafts choose: a draft's numerics
shape q, never which text a greedy or coupled generation writes; a target's thread count is
fixed for every pass (`LlamaCppModel.n_threads`, torch's configured count).
"""
from __future__ import annotations

import statistics
import time

RECENT = 5  # a count's speed is the median of its last few timings
EXPLORE_EVERY = 16  # every this many units run a count not chosen, to keep its timing current
TRIED_UP_TO = 4  # size classes of up to 15 tokens (a round's decodes) try every count; see choose


def size_class(tokens: int) -> int:
    """The size a unit of this many tokens is timed under: 1, 2-3, 4-7, 8-15, ... tokens."""
    return tokens.bit_length()


class ThreadChoice:
    """Chooses among thread counts for units of like work (keyed by their size: a decode of B
    tokens): each count's speed is the median of its last RECENT seconds at that size; the
    fastest runs, and every `explore_every`-th unit another count runs instead, so that a change
    in the machine shows within a few dozen units. Counts not yet timed at a size run first;
    units above TRIED_UP_TO follow the smaller ones (`choose`)."""

    def __init__(self, counts, explore_every: int = EXPLORE_EVERY):
        self.counts = tuple(dict.fromkeys(int(n) for n in counts))
        if not self.counts or min(self.counts) < 1:
            raise ValueError(f"counts must be positive integers, got {counts!r}")
        if explore_every < 2:
            raise ValueError(f"explore_every must be at least 2, got {explore_every!r}")
        self.explore_every = explore_every
        self.samples: dict[tuple[int, int], list[float]] = {}
        self.units = 0

    def choose(self, size: int = 1) -> int:
        """The thread count for the next unit of `size`. A unit larger than TRIED_UP_TO (a
        catch-up, a prompt) is not tried on other counts, since a wrong count costs it whole: it
        runs on the count fastest at the largest size class tried so far."""
        if size > TRIED_UP_TO:
            tried = (self.best(s) for s in range(TRIED_UP_TO, 0, -1))
            return next((count for count in tried if count is not None), self.counts[0])
        self.units += 1
        ranked = self._ranked(size)
        if len(ranked) < len(self.counts):
            return next(n for n in self.counts if n not in ranked)  # untimed at this size
        if len(ranked) > 1 and self.units % self.explore_every == 0:
            return ranked[1 + (self.units // self.explore_every) % (len(ranked) - 1)]
        return ranked[0]

    def record(self, count: int, size: int, seconds: float) -> None:
        recent = self.samples.setdefault((count, size), [])
        recent.append(seconds)
        del recent[:-RECENT]

    def run(self, tokens: int, use, work):
        """`work()` on the count chosen for a unit of `tokens` tokens (`use(count)` sets it
        first), timed for that count and size class in seconds per token."""
        size = size_class(tokens)
        count = self.choose(size)
        use(count)
        started = time.perf_counter()
        result = work()
        self.record(count, size, (time.perf_counter() - started) / tokens)
        return result

    def best(self, size: int = 1) -> int | None:
        """The count now believed fastest at `size` (None before any timing there)."""
        ranked = self._ranked(size)
        return ranked[0] if ranked else None

    def _ranked(self, size: int) -> list[int]:
        """The counts timed at `size`, fastest first (by the median of their recent timings)."""
        timed = [n for n in self.counts if self.samples.get((n, size))]
        return sorted(timed, key=lambda n: statistics.median(self.samples[(n, size)]))
