"""Logprobs read from the verifying pass (`exactspec.logprobs`): speculative decoding reports at
each emitted position what plain decoding reports there, and both equal the target's own
distribution at that prefix from a fresh full forward pass; broken variants (the shifted
position, the residual's probability for corrections) go red; nothing is computed unless asked.

A round's pass scores γ+1 positions at once, plain decoding one: the logits differ in the last
bits, so values are compared within ATOL (the largest difference seen is printed: run with -s)."""
import math

import pytest
import torch

import exactspec as es
from exactspec.batching import ContinuousBatching, RowSettings
from exactspec.drafters import NGramDrafter
from exactspec.engine import pad_prompts
from exactspec.logprobs import TokenLogprob
from exactspec.rows import EndRow
from exactspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-4
PROMPTS = [[1, 5, 9, 5, 9, 5], [1, 20, 21, 22, 20, 21], [1, 7]]
LARGEST = {"difference": 0.0}  # the largest difference any comparison saw


def ids(tokens):
    return torch.tensor([tokens])


def assert_same_logprobs(got: list[TokenLogprob], want: list[TokenLogprob], atol=ATOL) -> float:
    """Same tokens, log-probabilities within atol, the same top ids (in order, where their values
    differ by more than atol) with values within atol; returns the largest difference."""
    assert [t.token for t in got] == [t.token for t in want]
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        assert len(a.top) == len(b.top), i
        pairs = [(a.logprob, b.logprob)] + [(x[1], y[1]) for x, y in zip(a.top, b.top)]
        for x, y in pairs:
            if not (math.isinf(x) and x == y):
                worst = max(worst, abs(x - y))
        assert worst <= atol, f"position {i}: {a} vs {b}"
        for x, y in zip(a.top, b.top):  # ids may swap only where their values tie within atol
            assert x[0] == y[0] or abs(x[1] - y[1]) <= atol, f"position {i}: {a.top} vs {b.top}"
    LARGEST["difference"] = max(LARGEST["difference"], worst)
    return worst


def reference(target, prompt: list[int], new: list[int], n: int, sampling=None) -> list[TokenLogprob]:
    """The target's log-probabilities of `new` after `prompt` from one full forward pass over the
    whole text (independent of the engine): raw log-softmax, or log p under `sampling`."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + new])).logits[0, len(prompt) - 1: -1].double()
    logs = logits.log_softmax(-1) if sampling is None else sampling.probs(logits).log()  # [n, V]
    out = []
    for i, token in enumerate(new):
        values, order = torch.sort(logs[i], descending=True, stable=True)
        out.append(TokenLogprob(token, logs[i, token].item(),
                                tuple(zip(order[:n].tolist(), values[:n].tolist()))))
    return out


def new_tokens(out, row=0, prompt=None):
    seq = out.sequences[row].tolist()
    return seq[len(prompt):]


# --------------------------------------------------------------------------- against plain decoding


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_greedy_speculative_logprobs_equal_plain_decodings(tiny_pair, gamma):
    target, draft = tiny_pair
    worst, kept = 0.0, 0
    for prompt in PROMPTS:
        plain = es.autoregressive_generate(target, ids(prompt), max_new_tokens=16, temperature=0,
                                           eos_token_id=[], logprobs=5)
        for drafter in (draft, NGramDrafter()):
            for verify in ("block", "token", "coupled"):
                out = es.speculative_generate(target, drafter, ids(prompt), gamma=gamma,
                                              max_new_tokens=16, temperature=0, eos_token_id=[],
                                              verify=verify, logprobs=5)
                assert out.sequences[0].tolist() == plain.sequences[0].tolist()
                kept += out.stats.accepted_drafts
                worst = max(worst, assert_same_logprobs(out.logprobs[0], plain.logprobs[0]))
    assert kept > 20  # drafts were kept: positions past the first of a pass were read
    print(f"greedy, gamma {gamma}: largest logprob difference {worst:.3g}")


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_coupled_sampling_logprobs_equal_plain_decodings(tiny_pair, mode):
    target, draft = tiny_pair
    settings = dict(temperature=0.9, top_k=12, max_new_tokens=20, eos_token_id=[], logprobs=5,
                    logprobs_mode=mode)
    worst = 0.0
    for seed in range(3):
        for prompt in PROMPTS:
            plain = es.autoregressive_generate(target, ids(prompt), seed=seed, **settings)
            for drafter, gamma in ((draft, 3), (NGramDrafter(), 4), (draft, 1)):
                out = es.speculative_generate(target, drafter, ids(prompt), gamma=gamma, seed=seed,
                                              verify="coupled", **settings)
                assert out.sequences[0].tolist() == plain.sequences[0].tolist()
                worst = max(worst, assert_same_logprobs(out.logprobs[0], plain.logprobs[0]))
    if mode == "processed":  # top-k 12: the 13th token on is excluded, never more than 12 finite
        assert all(math.isfinite(t.logprob) for t in out.logprobs[0])
    print(f"coupled sampling, {mode}: largest logprob difference {worst:.3g}")


# --------------------------------------------------------------------------- against a fresh pass


@pytest.mark.parametrize("verify", ["token", "block"])
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_reported_logprobs_are_the_targets_at_each_prefix(tiny_pair, verify, mode):
    """Sampling with rejections: corrections are drawn from the residual, yet each token's
    logprob is the target's own at its prefix. Two rows of different lengths (left padding)."""
    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0, top_p=0.9)
    prompts = [PROMPTS[0], PROMPTS[2]]
    input_ids, mask = pad_prompts([torch.tensor(p) for p in prompts])
    corrections = 0
    for seed in range(3):
        out = es.speculative_generate(target, draft, input_ids, attention_mask=mask, gamma=4,
                                      max_new_tokens=24, sampling=sampling, seed=seed,
                                      eos_token_id=[], verify=verify, logprobs=3,
                                      logprobs_mode=mode)
        corrections += out.stats.corrections
        for row, prompt in enumerate(prompts):
            new = new_tokens(out, row, prompt)
            want = reference(target, prompt, new, 3, None if mode == "raw" else sampling)
            assert_same_logprobs(out.logprobs[row], want)
    assert corrections > 5  # the residual was drawn from, often


def broken_shift(monkeypatch):
    """Report each token's logprob from the next position of the pass (an off-by-one)."""
    import exactspec.batching as batching

    honest = batching.emitted

    def shifted(logits, p, *args, **kwargs):
        return honest(logits.roll(-1, dims=1), p.roll(-1, dims=1), *args, **kwargs)
    monkeypatch.setattr(batching, "emitted", shifted)


def broken_residual(monkeypatch):
    """Report a correction's probability under the residual it was drawn from, normalized
    max(p − q, 0), instead of under p."""
    honest = ContinuousBatching._verify

    def verify(self, proposal, drafts, p):
        result = honest(self, proposal, drafts, p)
        for b, tau in enumerate(result.num_accepted.tolist()):
            if tau < drafts.size(1):  # rejected at tau: a correction
                residual = (p[b, tau] - proposal.q[b, tau].to(p)).clamp(min=0)
                p[b, tau] = residual / residual.sum()
        return result
    monkeypatch.setattr(ContinuousBatching, "_verify", verify)


@pytest.mark.parametrize("broken", [broken_shift, broken_residual])
def test_broken_variants_go_red(tiny_pair, monkeypatch, broken):
    target, draft = tiny_pair
    sampling = SamplingConfig(temperature=1.0)
    broken(monkeypatch)
    out = es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=4, max_new_tokens=24,
                                  sampling=sampling, seed=0, eos_token_id=[], verify="token",
                                  logprobs=3, logprobs_mode="processed")
    assert out.stats.corrections > 0
    want = reference(target, PROMPTS[0], new_tokens(out, 0, PROMPTS[0]), 3, sampling)
    with pytest.raises(AssertionError):
        assert_same_logprobs(out.logprobs[0], want)


# --------------------------------------------------------------------------- cuts, cost, bad input


def test_logprobs_are_cut_with_the_tokens(tiny_pair):
    """EOS, the budget and an EndRow callback cut the logprobs where they cut the tokens; the
    callback gets each round's logprobs beside its tokens."""
    target, draft = tiny_pair
    plain = es.autoregressive_generate(target, ids(PROMPTS[0]), max_new_tokens=12, temperature=0,
                                       eos_token_id=[], logprobs=2)
    new = plain.sequences[0].tolist()[len(PROMPTS[0]):]
    eos = new[5]
    seen = []

    def on_tokens(row, tokens, logprobs):
        seen.append((list(tokens), [t.token for t in logprobs]))
        return EndRow(1) if sum(len(t) for t, _ in seen) >= 4 else None
    for kwargs, length in ((dict(eos_token_id=[eos]), new.index(eos) + 1),
                           (dict(eos_token_id=[], max_new_tokens=3), 3),
                           (dict(eos_token_id=[], on_tokens=on_tokens), None)):
        out = es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=4, temperature=0,
                                      logprobs=2, **{"max_new_tokens": 12, **kwargs})
        got = out.sequences[0].tolist()[len(PROMPTS[0]):]
        assert length is None or len(got) == length
        assert [t.token for t in out.logprobs[0]] == got
        assert_same_logprobs(out.logprobs[0], plain.logprobs[0][: len(got)])
    assert seen and all(tokens == chosen for tokens, chosen in seen)


def test_nothing_is_computed_unless_asked(tiny_pair, monkeypatch):
    import exactspec.batching as batching

    def fail(*args, **kwargs):
        raise AssertionError("logprobs computed though not asked")
    monkeypatch.setattr(batching, "emitted", fail)
    target, draft = tiny_pair
    calls = []
    out = es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=3, max_new_tokens=8,
                                  temperature=0, on_tokens=lambda row, new: calls.append(new))
    assert out.logprobs is None and calls
    assert es.autoregressive_generate(target, ids(PROMPTS[0]), max_new_tokens=4).logprobs is None


def test_zero_alternatives_and_greedy_processed(tiny_pair):
    target, _ = tiny_pair
    out = es.autoregressive_generate(target, ids(PROMPTS[1]), max_new_tokens=5, temperature=0,
                                     logprobs=0, logprobs_mode="processed")
    assert all(t.top == () and t.logprob == 0.0 for t in out.logprobs[0])  # a point mass


@pytest.mark.parametrize("kwargs,message", [
    (dict(logprobs=21), "logprobs must be an integer in \\[0, 20\\] or None, got 21"),
    (dict(logprobs=-1), "logprobs must be an integer in \\[0, 20\\] or None, got -1"),
    (dict(logprobs=True), "logprobs must be an integer .* got True"),
    (dict(logprobs=2, logprobs_mode="logits"), "logprobs_mode must be one of .* got 'logits'"),
])
def test_bad_logprobs_name_themselves(tiny_pair, kwargs, message):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match=message):
        es.speculative_generate(target, draft, ids(PROMPTS[0]), gamma=2, max_new_tokens=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        es.autoregressive_generate(target, ids(PROMPTS[0]), max_new_tokens=2, **kwargs)
    if "logprobs_mode" not in kwargs:
        with pytest.raises(ValueError, match=message):
            RowSettings(max_new_tokens=2, **kwargs)


def test_largest_difference_is_reported():
    """Runs last in this file: the largest difference the comparisons above saw (-s shows it)."""
    print(f"largest logprob difference in this run: {LARGEST['difference']:.3g} (atol {ATOL})")
    assert LARGEST["difference"] <= ATOL
