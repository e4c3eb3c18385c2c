"""How many threads repeated work of one kind runs on, from what each count delivers now.

On an idle machine a llama.cpp draft decodes fastest on every core it may use; with one other
busy process on 2 cores its two threads wait for each other at every barrier while one of them
is descheduled, and one thread is 2-3x faster (measured: 52-62 ms against 22-24 ms a token for
the bundled model's 4-bit draft). Which holds changes while a process runs, so the choice is
measured, not configured.
"""
from __future__ import annotations

import statistics
import time
import weakref

RECENT = 5  # a count's speed is the median of its last few timings
EXPLORE_EVERY = 16  # every this many units run a count not chosen, to keep its timing current
# A target's passes try a count other than the fastest one in this many: a tried count runs
# slower on an idle machine (one thread: about 1.6x a token for a llama.cpp target), so a
# target, whose passes are the whole cost, tries less often than a draft does.
TARGET_EXPLORE_EVERY = 64


def size_class(tokens: int) -> int:
    """The size a unit of this many tokens is timed under: 1, 2-3, 4-7, 8-15, ... tokens."""
    return tokens.bit_length()


class ThreadChoice:
    """Chooses among thread counts for units of like work (keyed by their size: a decode of B
    tokens): each count's speed is the median of its last RECENT seconds at that size; the
    fastest runs, and every `explore_every`-th unit another count runs instead, so that a change
    in the machine shows within a few dozen units. Counts not yet timed at a size run first."""

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
        """The thread count for the next unit of `size`."""
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


_TORCH: "weakref.WeakKeyDictionary[object, dict[int, ThreadChoice]]" = weakref.WeakKeyDictionary()


def torch_choice(model, configured: int) -> ThreadChoice | None:
    """The thread choice of a torch model's passes on the CPU: between torch's thread count as
    configured now and one thread (None when that is already one). It belongs to the model
    (weakly: freed with it), one per configured count, so a generation starts from the last
    one's timings and a model loaded later at the same address starts afresh."""
    if configured < 2:
        return None
    choices = _TORCH.setdefault(model, {})
    if configured not in choices:
        choices[configured] = ThreadChoice((configured, 1), TARGET_EXPLORE_EVERY)
    return choices[configured]
