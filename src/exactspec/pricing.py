"""The price of a round from recent timings: T(k), the seconds of a target pass over k tokens,
and the draft's seconds per token. An estimate is the median of its last RECENT samples, so
it follows the machine as it is now and one outlier either way does not move it."""
from __future__ import annotations

import statistics

RECENT = 5  # an estimate is the median of this many latest samples
STEADY_SPREAD = 1.5  # steady: the largest recent sample at most this times the smallest
PRIOR_SLOPE = 0.05  # past the pass sizes seen, a token costs this share of the cheapest pass


def record(samples: dict, key, seconds: float) -> None:
    """Keep `seconds` among the last RECENT samples under `key`."""
    recent = samples.setdefault(key, [])
    recent.append(seconds)
    del recent[:-RECENT]


def estimate(samples: list[float]) -> float:
    """The median of the recent samples: current, and robust to one outlier either way."""
    return statistics.median(samples)


def steady(samples: list[float], floor: float = 0.0) -> bool:
    """Whether recent samples agree: at least 3, the largest within STEADY_SPREAD times the
    smallest (or within `floor` seconds of it: costs too small to matter)."""
    return len(samples) >= 3 and max(samples) <= max(STEADY_SPREAD * min(samples), min(samples) + floor)


def pass_estimates(passes: dict[int, list[float]]) -> dict[int, float]:
    """k → the estimate of a k-token pass. A size whose pass took longer than k one-token passes
    is set aside as an outlier (a first call's set-up, a busy moment) until it is measured again
    within that bound."""
    seen = {size: estimate(samples) for size, samples in passes.items()}
    if 1 in seen:
        seen = {size: t for size, t in seen.items() if t <= size * seen[1]}
    return seen


def between(seen: dict[int, float], k: int) -> float:
    """T(k) for a k not seen, from the (size, seconds) seen, priced to be tried: the nearest size
    below plus PRIOR_SLOPE of the cheapest pass per further token, unless the line to the nearest
    size above is cheaper. Not a line through all sizes: on a CPU, pass times are not monotone
    in k (llama.cpp's kernels take some sizes in tiles: on the Qwen 1.5B a pass of 16 tokens cost
    less than one of 12, docs/drafting.md), so a size is known only once it has run; priced low,
    it runs when a round at high α would want it, and from then on at its measured cost. Below
    the sizes seen, the nearest above less PRIOR_SLOPE per token."""
    below = max((s for s in seen if s < k), default=None)
    above = min((s for s in seen if s > k), default=None)
    per_token = PRIOR_SLOPE * min(seen.values())
    if below is None:
        return max(seen[above] - per_token * (above - k), per_token)
    hopeful = seen[below] + per_token * (k - below)
    if above is None:
        return hopeful
    return min(hopeful, seen[below] + (seen[above] - seen[below]) * (k - below) / (above - below))
