"""`ThreadChoice`: the thread count that is fastest now, kept current by exploring."""
import pytest
import torch

from exactspec.threads import EXPLORE_EVERY, RECENT, TRIED_UP_TO, ThreadChoice, size_class


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
    run(choice, {2: 0.040, 1: 0.020}.get, 8, size=3)
    assert (choice.best(1), choice.best(3), choice.best(2)) == (2, 1, None)
    assert ThreadChoice((1, 1)).counts == (1,)
    with pytest.raises(ValueError, match="counts must be positive integers"):
        ThreadChoice((0,))
    with pytest.raises(ValueError, match="explore_every must be at least 2, got 1"):
        ThreadChoice((2, 1), explore_every=1)


def test_a_large_unit_is_not_tried_on_another_count_but_follows_the_smaller_ones():
    """A catch-up or a prompt (above TRIED_UP_TO) runs on the count fastest at the largest size
    tried so far, all threads before any: trying one thread on a prefill costs it twice over."""
    choice, large = ThreadChoice((2, 1)), TRIED_UP_TO + 2
    assert run(choice, {2: 0.003, 1: 0.006}.get, 40, size=large) == [2] * 40
    run(choice, {2: 0.050, 1: 0.020}.get, 8, size=2)  # busy: one thread wins the round's decodes
    assert run(choice, {2: 0.003, 1: 0.006}.get, 40, size=large) == [1] * 40
    run(choice, {2: 0.010, 1: 0.030}.get, 8, size=TRIED_UP_TO)  # the largest tried size decides
    assert choice.choose(large) == 2


def test_run_sets_the_count_then_times_per_token_by_size_class():
    choice, used = ThreadChoice((2, 1)), []
    assert choice.run(5, used.append, lambda: "done") == "done"
    choice.run(6, used.append, lambda: None)  # 4-7 tokens: the same class, so the other count
    choice.run(1, used.append, lambda: None)
    assert used == [2, 1, 2]
    assert sorted(choice.samples) == [(1, size_class(5)), (2, size_class(1)), (2, size_class(5))]
    assert [size_class(n) for n in (1, 2, 3, 4, 7, 8)] == [1, 2, 2, 3, 3, 4]


def test_every_pass_of_a_torch_target_runs_on_torchs_configured_count():
    """A seed names one text: no pass of a CPU target is tried on another thread count (a
    reduction split otherwise can round otherwise), and torch's count is as configured after."""
    from conftest import make_tiny_llama
    from exactspec.engine import autoregressive_generate

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        model, seen = make_tiny_llama(0), []
        model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
        autoregressive_generate(model, torch.tensor([[1, 5, 9]]), max_new_tokens=80,
                                temperature=0.0, eos_token_id=[])
        assert len(seen) == 80 and set(seen) == {2} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_exactspec_threads_sets_a_llama_cpp_targets_thread_count(monkeypatch):
    """EXACTSPEC_THREADS, when set, is every llama.cpp target's thread count; a value that is not
    a positive integer is refused, naming the variable."""
    from exactspec.models.llamacpp import target_threads, usable_cores

    monkeypatch.setenv("EXACTSPEC_THREADS", "3")
    assert target_threads() == 3
    monkeypatch.delenv("EXACTSPEC_THREADS")
    assert target_threads() == usable_cores()
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("EXACTSPEC_THREADS", bad)
        with pytest.raises(ValueError, match=f"EXACTSPEC_THREADS must be an integer >= 1, got '{bad}'"):
            target_threads()
