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
from test_cli_generate import tiny_folders  # noqa: F401  (the module-scoped fixture)

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


def test_top_alternatives_are_a_full_stable_sorts():
    """`_top` (a top-k, then the ties at its edge) lists what a stable descending sort of the
    whole vocabulary lists first, ties lowest id first: on random logs with many ties and -inf."""
    from exactspec.logprobs import _top

    gen = torch.Generator().manual_seed(0)
    logs = torch.randint(-6, 0, (3, 4, 50), generator=gen).double()  # [a, k, V], ties everywhere
    logs[0, 0, 10:] = -math.inf
    for n in (1, 5, 20):
        values, ids = torch.sort(logs, dim=-1, descending=True, stable=True)
        want = [[list(zip(i[:n].tolist(), v[:n].tolist())) for i, v in zip(row_i, row_v)]
                for row_i, row_v in zip(ids, values)]
        assert _top(logs, n) == want, n


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


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def lp_server(tiny_folders):  # noqa: F811
    pytest.importorskip("fastapi")
    from test_serve import Server
    from exactspec.serve.app import ServeConfig

    target, draft = tiny_folders
    srv = Server(ServeConfig(target=target, draft=draft, gamma=3, model_name="tiny"))
    yield srv
    srv.close()


def library_logprobs(server, prompt_ids: list[int], n: int, max_tokens: int):
    """Plain greedy decoding's logprobs of the server's own target, spelled as the server does."""
    from exactspec.serve.logprobs import Spelling

    target = server.state.target
    out = es.autoregressive_generate(target, ids(prompt_ids), max_new_tokens=max_tokens,
                                     temperature=0, logprobs=n)
    spelled = Spelling(target.tokenizer).spell(out.logprobs[0])
    return [(entry["token"], t.logprob, [(e["token"], v) for e, (_, v) in zip(top, t.top)])
            for (entry, top), t in zip(spelled, out.logprobs[0])]


def assert_server_matches(got, want):
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, value, top), (_, ref, ref_top) in zip(got, want):
        assert abs(value - ref) <= ATOL
        assert len(top) == len(ref_top)
        assert all(abs(a[1] - b[1]) <= ATOL and (a[0] == b[0] or abs(a[1] - b[1]) <= ATOL)
                   for a, b in zip(top, ref_top))
        LARGEST["difference"] = max(LARGEST["difference"], abs(value - ref))


@pytest.mark.parametrize("stream", [False, True])
def test_server_chat_logprobs_match_the_library(lp_server, stream):
    client, tokenizer = lp_server.client, lp_server.state.target.tokenizer
    messages = [{"role": "user", "content": "w3 w7 w1 w9"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    args = dict(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=4)
    if stream:
        content = []
        for chunk in client.chat.completions.create(stream=True, **args):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                content += chunk.choices[0].logprobs.content
    else:
        reply = client.chat.completions.create(**args)
        content = reply.choices[0].logprobs.content
    got = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert_server_matches(got, library_logprobs(lp_server, prompt, 4, len(got)))
    assert len(got) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_server_completions_logprobs_match_the_library(lp_server, stream):
    prompt = [1, 6, 10, 4, 12]
    args = dict(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    if stream:
        tokens, values, tops, offsets, text = [], [], [], [], ""
        for chunk in lp_server.client.completions.create(stream=True, **args):
            text += chunk.choices[0].text
            lp = chunk.choices[0].logprobs
            if lp is not None:
                tokens += lp.tokens
                values += lp.token_logprobs
                tops += lp.top_logprobs
                offsets += lp.text_offset
    else:
        reply = lp_server.client.completions.create(**args)
        lp, text = reply.choices[0].logprobs, reply.choices[0].text
        tokens, values, tops, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    got = [(t, v, list(top.items())) for t, v, top in zip(tokens, values, tops)]
    assert_server_matches(got, library_logprobs(lp_server, prompt, 3, len(got)))
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(tokens) == text


def test_server_without_logprobs_sends_none(lp_server):
    reply = lp_server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w3"}], max_tokens=3)
    assert reply.choices[0].logprobs is None
    reply = lp_server.client.completions.create(model="tiny", prompt="w3 w4", max_tokens=3)
    assert reply.choices[0].logprobs is None


def test_server_rows_in_one_batch_ask_their_own(lp_server):
    """Requests sent at once (sharing batches as they arrive), asking for different N or none:
    each gets its own."""
    import concurrent.futures

    prompt = [1, 6, 10, 4, 12]
    want = library_logprobs(lp_server, prompt, 5, 10)

    def ask(n):
        reply = lp_server.client.completions.create(model="tiny", prompt=prompt, max_tokens=10,
                                                    temperature=0, logprobs=n)
        return reply.choices[0].logprobs
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, [5, None, 2]))
    assert replies[1] is None
    for lp, n in ((replies[0], 5), (replies[2], 2)):
        got = [(t, v, list(top.items())) for t, v, top in
               zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]
        assert_server_matches(got, [(t, v, top[:n]) for t, v, top in want])


@pytest.mark.parametrize("path, body, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_server_bad_logprobs_are_400s_naming_the_field(lp_server, path, body, param):
    import httpx

    base = ({"messages": [{"role": "user", "content": "w3"}]} if path == "chat"
            else {"prompt": "w3 w4"})
    url = lp_server.url + ("/v1/chat/completions" if path == "chat" else "/v1/completions")
    response = httpx.post(url, json={**base, **body, "max_tokens": 2}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_cli_prints_logprobs(tiny_folders, capsys):  # noqa: F811
    import json

    from exactspec.cli import main

    target, draft = tiny_folders
    argv = ["generate", "w3 w7 w3 w7", "--target", target, "--draft", draft, "--gamma", "3",
            "--temperature", "0", "--max-new-tokens", "6", "--no-chat", "--json"]
    assert main(argv + ["--logprobs", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [e["token"] for e in result["logprobs"]] == result["token_ids"]
    assert all(len(e["top"]) == 2 and e["top"][0]["logprob"] >= e["logprob"] - ATOL
               for e in result["logprobs"])
    assert main(argv) == 0 and "logprobs" not in json.loads(capsys.readouterr().out)
    assert main(argv + ["--logprobs", "21"]) == 2
    assert "logprobs must be an integer in [0, 20]" in capsys.readouterr().err


def test_largest_difference_is_reported():
    """Runs last in this file: the largest difference the comparisons above saw (-s shows it)."""
    print(f"largest logprob difference in this run: {LARGEST['difference']:.3g} (atol {ATOL})")
    assert LARGEST["difference"] <= ATOL
