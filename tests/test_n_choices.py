"""OpenAI's `n`: a request's choices as rows of the running batch, each with its own stream.

With a seed, choice i is plain decoding with `noise.choice_seed(seed, i)` (the coupled rule);
without one, the choices are independent draws from the target's p. The server, the `openai`
client and the tiny test models of tests/test_serve.py (the bundled model in one slow test)."""
import random
import re
import time

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import exactspec as es  # noqa: E402
from conftest import ALPHA, chi_square_pvalue  # noqa: E402
from exactspec.noise import choice_seed  # noqa: E402
from test_cli_generate import tiny_folders  # noqa: E402,F401  (the module-scoped fixture)
from test_serve import PROMPT, Server, generate_cli  # noqa: E402
from exactspec.serve.app import ServeConfig  # noqa: E402

MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def server(tiny_folders):  # noqa: F811
    """A model draft with a fixed γ: every first round drafts, so first tokens are accepted
    drafts or corrections, not only plain draws."""
    target, draft = tiny_folders
    srv = Server(ServeConfig(target=target, draft=draft, gamma=3, model_name="tiny"))
    yield srv
    srv.close()


def test_choice_seed():
    assert choice_seed(1234, 0) == 1234 and choice_seed(-5, 0) == -5  # n = 1 unchanged
    seeds = [choice_seed(1234, i) for i in range(16)]
    assert len(set(seeds)) == 16 and seeds == [choice_seed(1234, i) for i in range(16)]
    assert choice_seed(1235, 1) != seeds[1]
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match=f"index must be an integer >= 0, got {bad!r}"):
            choice_seed(1, bad)


def plain_text(capsys, target, kind, seed, max_tokens):
    """`exactspec generate --draft none` with this seed at temperature 1: plain decoding."""
    return generate_cli(capsys, target, "none", PROMPT, "--chat" if kind == "chat" else "--no-chat",
                        "--temperature", "1", "--seed", str(seed), "--max-new-tokens", str(max_tokens))


def create(server, kind, **kw):
    if kind == "chat":
        return server.client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)
    return server.client.completions.create(model="tiny", prompt=PROMPT, **kw)


def text_of(choice) -> str:
    return choice.message.content if hasattr(choice, "message") else choice.text


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_seeded_choices_are_plain_decodes_with_choice_seeds(server, tiny_folders, capsys, kind):  # noqa: F811
    """n = 4, seed 1234, temperature 1: choice i's text is plain decoding's with
    choice_seed(1234, i), in the batch together; choice 0 is the n = 1 request's; the prompt is
    counted once in usage, the completion tokens of all four."""
    target, _ = tiny_folders
    reply = create(server, kind, n=4, seed=1234, temperature=1.0, max_tokens=16)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [text_of(c) for c in reply.choices]
    assert texts == [plain_text(capsys, target, kind, choice_seed(1234, i), 16) for i in range(4)]
    assert len(set(texts)) > 1
    single = create(server, kind, seed=1234, temperature=1.0, max_tokens=16)
    assert text_of(single.choices[0]) == texts[0]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert single.usage.completion_tokens <= reply.usage.completion_tokens <= 4 * 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    spec = reply.model_extra["metrics"]["speculative_decoding"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"] > 0


def slow_rounds(server, monkeypatch, seconds: float):
    scheduler = server.state.scheduler
    original = scheduler._round
    monkeypatch.setattr(scheduler, "_round", lambda: (time.sleep(seconds), original())[1])


def wait_for_running(server, count: float, seconds: float = 5) -> float:
    deadline = time.time() + seconds
    while server.metric("exactspec:num_requests_running") != count and time.time() < deadline:
        time.sleep(0.02)
    return server.metric("exactspec:num_requests_running")


def test_more_choices_than_the_batch_holds(server):
    """n = 12 on a server of max_batch 8: the last four wait for rows, and each choice is still
    its seed's text (so the same as in a request of n = 4)."""
    many = create(server, "completions", n=12, seed=99, temperature=1.0, max_tokens=10)
    few = create(server, "completions", n=4, seed=99, temperature=1.0, max_tokens=10)
    assert [c.index for c in many.choices] == list(range(12))
    assert [c.text for c in many.choices[:4]] == [c.text for c in few.choices]
    assert wait_for_running(server, 0) == 0


def test_unseeded_choices_differ(server):
    for kind in ("completions", "chat"):
        reply = create(server, kind, n=4, temperature=1.0, max_tokens=16)
        assert len({text_of(c) for c in reply.choices}) > 1


def test_logprobs_per_choice(server):
    """Each choice's logprobs are its own tokens' (they join into its own text, once special
    tokens, which the text skips, are taken out; one entry per token of the usage)."""
    unspecial = lambda text: re.sub(r" ?(<s>|</s>|<unk>)", "", text)
    reply = create(server, "completions", n=3, seed=7, temperature=1.0, max_tokens=8, logprobs=2)
    for choice in reply.choices:
        assert unspecial("".join(choice.logprobs.tokens)) == choice.text
        assert choice.logprobs.text_offset[0] == 0
    assert sum(len(c.logprobs.tokens) for c in reply.choices) == reply.usage.completion_tokens
    chat = create(server, "chat", n=3, seed=7, temperature=1.0, max_tokens=8, logprobs=True,
                  top_logprobs=2)
    for choice in chat.choices:
        assert unspecial("".join(t.token for t in choice.logprobs.content)) == choice.message.content
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert sum(len(c.logprobs.content) for c in chat.choices) == chat.usage.completion_tokens


@pytest.fixture
def repeatable_row_seeds(monkeypatch):
    """The random seeds the batch gives unseeded rows, from a fixed generator: the statistical
    tests below then repeat exactly (their stated false-failure rate holds for any seed)."""
    import exactspec.batching as batching

    rng = random.Random(20261206)
    monkeypatch.setattr(batching, "secrets", type("Seeds", (), {"randbits": staticmethod(rng.getrandbits)}))


def test_unseeded_first_tokens_follow_p(server, tiny_folders, repeatable_row_seeds):  # noqa: F811
    """First tokens of 40 unseeded requests of n = 16 (640 rows, the block rule, a model draft
    with γ = 3: each first token is an accepted draft or a correction) against the target's p:
    a chi-square test. And the choices of one request are independent: disjoint pairs of
    choices agree as often as two independent draws from p do (Σ p²), a binomial test. Each at
    false-failure rate ALPHA."""
    from scipy import stats

    target, _ = tiny_folders
    prompt = [1, 5, 9]
    loaded = es.load_model(target, dtype="float32", device="cpu")
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt])).logits[0, -1]
    p = es.probs_from_logits(logits.double(), temperature=1.0)  # [V]
    requests, n = 40, 16
    firsts = []
    for _ in range(requests):
        reply = server.client.completions.create(model="tiny", prompt=prompt, n=n, temperature=1.0,
                                                 max_tokens=3, logprobs=0)
        assert [c.index for c in reply.choices] == list(range(n))
        firsts.append([_token_id(loaded, c) for c in reply.choices])
    counts = torch.bincount(torch.tensor(firsts).flatten(), minlength=p.numel())
    assert chi_square_pvalue(counts, p) > ALPHA
    pairs = [(row[i], row[i + 1]) for row in firsts for i in range(0, n, 2)]
    agree = sum(a == b for a, b in pairs)
    assert stats.binomtest(agree, len(pairs), float((p ** 2).sum())).pvalue > ALPHA


def _token_id(loaded, choice) -> int:
    """The first token's id, from its text (the tiny tokenizer's words are whole tokens)."""
    word = choice.logprobs.tokens[0].strip()
    token = loaded.tokenizer.convert_tokens_to_ids(word)
    assert loaded.tokenizer.convert_ids_to_tokens(token) == word
    return token


def sse(response) -> list:
    """The `data:` payloads of a server-sent-event stream, [DONE] as the string."""
    import json

    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_chunks_carry_their_choice(server, kind):
    """Streamed n = 3: each chunk carries one choice and its index; chat opens each choice with
    its role; each choice ends with one finish chunk; per index the text is the non-streamed
    reply's; include_usage's chunk sums the choices, then [DONE]."""
    body = {"model": "tiny", "n": 3, "seed": 21, "temperature": 1.0, "max_tokens": 12}
    body.update({"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT})
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    whole = httpx.post(server.url + path, json=body, timeout=60).json()
    with httpx.stream("POST", server.url + path, timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        events = sse(response)
    assert events[-1] == "[DONE]"
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert all(len(chunk["choices"]) == 1 for chunk in chunks)
    texts, finishes, roles = ["", "", ""], [[], [], []], [[], [], []]
    for chunk in chunks:
        choice = chunk["choices"][0]
        index = choice["index"]
        if kind == "chat":
            roles[index] += [choice["delta"]["role"]] if "role" in choice["delta"] else []
            texts[index] += choice["delta"].get("content") or ""
        else:
            texts[index] += choice["text"]
        if choice["finish_reason"] is not None:
            assert not finishes[index], "a choice went on after its finish chunk"
        finishes[index] += [choice["finish_reason"]] if choice["finish_reason"] else []
    key = (lambda c: c["message"]["content"]) if kind == "chat" else (lambda c: c["text"])
    assert texts == [key(c) for c in whole["choices"]]
    assert finishes == [[c["finish_reason"]] for c in whole["choices"]]
    if kind == "chat":
        assert roles == [["assistant"]] * 3


def test_openai_client_streams_n(server):
    stream = server.client.completions.create(model="tiny", prompt=PROMPT, n=2, seed=3,
                                              temperature=1.0, max_tokens=8, stream=True)
    seen = {c.choices[0].index for c in stream if c.choices}
    assert seen == {0, 1}


def test_disconnect_cancels_every_choice(server, monkeypatch):
    """A client that goes away mid-stream frees all n rows; so does one that stops waiting for a
    non-streamed reply."""
    slow_rounds(server, monkeypatch, 0.1)  # 100 tokens take over 2.5 s: 4 at most per round
    cancelled = server.metric("exactspec:request_cancelled_total")
    # greedy decoding of these ids does not reach EOS within 100 tokens (tests/test_serve.py)
    body = {"model": "tiny", "prompt": [1, 5, 9], "max_tokens": 100, "temperature": 0, "n": 3}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=30) as response:
        lines = response.iter_lines()  # kept open: breaking out of it would close the stream
        assert next(line for line in lines if line.startswith("data:"))
        assert wait_for_running(server, 3) == 3
    assert wait_for_running(server, 0) == 0
    assert server.metric("exactspec:request_cancelled_total") == cancelled + 3
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1)
    assert wait_for_running(server, 0) == 0
    assert server.metric("exactspec:request_cancelled_total") == cancelled + 6


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"n": 2.5}, "n"), ({"n": "2"}, "n"), ({"n": True}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"), ({"best_of": 2}, "best_of"), ({"n": 2, "best_of": "2"}, "best_of"),
])
def test_bad_n_is_a_400_naming_it(server, body, param):
    for path, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = httpx.post(server.url + path, json={**base, **body}, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"]


def test_best_of_equal_to_n_is_accepted(server):
    reply = httpx.post(server.url + "/v1/completions", timeout=30, json={
        "prompt": PROMPT, "n": 2, "best_of": 2, "max_tokens": 3, "seed": 1}).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1]


def test_n_beyond_the_queue_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.state.scheduler, "max_queue", 2)
    response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "n": 3}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


@pytest.mark.slow
def test_bundled_model_seeded_choices_are_plain_decodes(bundled_pair):
    """The bundled SmolLM2 (float32 target, its bfloat16 copy drafting, γ auto): chat with n = 4,
    seed 7, temperature 1 — choice i's reply is `autoregressive_generate` with choice_seed(7, i)."""
    from exactspec.models import eos_token_ids

    target, draft = bundled_pair
    messages = [{"role": "user", "content": "Name a colour and say why you like it."}]
    srv = Server(ServeConfig(target=target, draft=draft, model_name="smol"))
    try:
        reply = srv.client.chat.completions.create(model="smol", messages=messages, n=4, seed=7,
                                                   temperature=1.0, max_tokens=16)
    finally:
        srv.close()
    ids = target.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if not hasattr(ids, "keys") else ids["input_ids"]
    plain, tokens = [], 0
    for i in range(4):
        out = es.autoregressive_generate(target, ids, max_new_tokens=16, temperature=1.0,
                                         seed=choice_seed(7, i), eos_token_id=eos_token_ids(target))
        new = out.sequences[0][ids.size(1):].tolist()
        tokens += len(new)
        plain.append(target.tokenizer.decode(new, skip_special_tokens=True))
    assert [c.message.content for c in reply.choices] == plain
    assert len(set(plain)) > 1 and reply.usage.completion_tokens == tokens
