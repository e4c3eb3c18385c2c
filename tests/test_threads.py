"""`ThreadChoice`: the thread count that is fastest now, kept current by exploring."""
import pytest

from exactspec.threads import EXPLORE_EVERY, RECENT, ThreadChoice


def run(choice, seconds_of, units, size=1):
    """Drive `choice` for `units` units whose cost is seconds_of(count); return the counts run."""
    chosen = []
    for _ in range(units):
        count = choice.choose(size)
        choice.record(count, size, seconds_of(count))
        chosen.append(count)
    return chosen


def test_the_faster_count_runs_and_the_other_is_still_tried():
    choice = ThreadChoice((2, 1))
    idle = run(choice, {2: 0.010, 1: 0.016}.get, 64)
    assert idle[:2] == [2, 1] and idle.count(1) == 1 + 64 // EXPLORE_EVERY  # timed once, then explored
    busy = run(choice, {2: 0.055, 1: 0.022}.get, 64)  # another process took a core
    assert busy[-EXPLORE_EVERY:].count(1) == EXPLORE_EVERY - 1  # switched, within a few units
    assert busy.index(1) < EXPLORE_EVERY + RECENT
    assert choice.best() == 1


def test_sizes_are_timed_apart_and_counts_are_checked():
    choice = ThreadChoice((2, 1))
    run(choice, {2: 0.010, 1: 0.020}.get, 8, size=1)
    run(choice, {2: 0.040, 1: 0.020}.get, 8, size=8)
    assert (choice.best(1), choice.best(8), choice.best(3)) == (2, 1, None)
    assert ThreadChoice((1, 1)).counts == (1,)
    with pytest.raises(ValueError, match="counts must be positive integers"):
        ThreadChoice((0,))
    with pytest.raises(ValueError, match="explore_every must be at least 2, got 1"):
        ThreadChoice((2, 1), explore_every=1)
