"""`exactspec serve` end to end: the real server (uvicorn on 127.0.0.1, port 0) and the real
`openai` client, on tiny models saved as folders (the bundled model in one slow test)."""
import asyncio
import concurrent.futures
import json
import re
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from exactspec.cli import main  # noqa: E402
from exactspec.serve.app import ServeConfig, create_app  # noqa: E402
from test_cli_generate import tiny_folders  # noqa: E402,F401  (the module-scoped fixture)

PROMPT = "w3 w7 w1 w9"


class Server:
    """uvicorn in a thread, on a free loopback port; stopped by `close`."""

    def __init__(self, config: ServeConfig):
        import uvicorn

        self.app = create_app(config)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        else:
            raise RuntimeError("the server did not become healthy")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    @property
    def state(self):
        return self.app.state.exactspec

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(self.url + "/metrics").text
        match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    def close(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_folders):  # noqa: F811
    target, draft = tiny_folders
    srv = Server(ServeConfig(target=target, draft=draft, gamma=3, model_name="tiny"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def auto_server(tiny_folders):  # noqa: F811
    """The server with its defaults: --draft auto (prompt lookup, else a bfloat16 copy of the
    target) and --gamma auto (one controller for the running batch)."""
    target, _ = tiny_folders
    config = ServeConfig(target=target, model_name="tiny")
    assert (config.draft, config.gamma) == ("auto", "auto")
    srv = Server(config)
    yield srv
    srv.close()


def generate_cli(capsys, target, draft, prompt, *flags):
    assert main(["generate", prompt, "--target", target, "--draft", draft, "--json",
                 "--temperature", "0", "--max-new-tokens", "12", *flags]) == 0
    return json.loads(capsys.readouterr().out)["text"]


def test_health_models_and_metrics(server):
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    text = httpx.get(server.url + "/metrics").text
    for name in ("exactspec:spec_decode_num_drafts_total", "exactspec:spec_decode_num_draft_tokens_total",
                 "exactspec:spec_decode_num_accepted_tokens_total", "exactspec:num_requests_running",
                 "exactspec:num_requests_waiting", "exactspec:time_to_first_token_seconds_bucket",
                 "exactspec:e2e_request_latency_seconds_bucket"):
        assert name in text


def test_greedy_completions_equal_generate(server, tiny_folders, capsys):  # noqa: F811
    target, draft = tiny_folders
    completion = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                                  temperature=0)
    for drafting in (draft, "none"):  # speculative and plain decoding
        assert completion.choices[0].text == generate_cli(capsys, target, drafting, PROMPT, "--no-chat")
    chat = server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == generate_cli(capsys, target, "none", PROMPT, "--chat")
    assert chat.usage.completion_tokens <= 12
    spec = chat.model_extra["metrics"]["speculative_decoding"]
    assert set(spec) == {"num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
                         "draft_acceptance_rate", "mean_acceptance_length", "by_source",
                         "num_draft_tokens_per_pos", "num_accepted_tokens_per_pos"}
    assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"] > 0


def test_defaults_are_auto_like_generate():
    from exactspec.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.draft, args.gamma) == ("auto", "auto")


def test_default_auto_greedy_equals_plain_decoding(auto_server, tiny_folders, capsys):  # noqa: F811
    """With --draft auto --gamma auto, greedy requests sent together (sharing the batch, joining
    it as they arrive) equal plain decoding of each prompt alone; prompts that repeat themselves
    give prompt lookup something to draft. A request with an integer gamma, or gamma "auto", too."""
    target, _ = tiny_folders
    prompts = [PROMPT, "w5 w9 w5 w9 w5 w9 w5", "w1 w2 w3 w1 w2 w3 w1", "w8", "w4 w4 w4 w4", "w6 w2"]
    gammas = [None, None, 3, None, "auto", 0]
    call = lambda args: auto_server.client.completions.create(
        model="tiny", prompt=args[0], max_tokens=12, temperature=0,
        extra_body=None if args[1] is None else {"gamma": args[1]})
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(call, zip(prompts, gammas)))
    for prompt, result in zip(prompts, results):
        assert result.choices[0].text == generate_cli(capsys, target, "none", prompt, "--no-chat")
    drafted = sum(r.model_extra["metrics"]["speculative_decoding"]["num_draft_tokens"] for r in results)
    assert drafted > 0
    chat = auto_server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == generate_cli(capsys, target, "none", PROMPT, "--chat")


def test_seeded_text_does_not_depend_on_company_or_gamma(auto_server, tiny_folders, capsys):  # noqa: F811
    """With the server's defaults (--draft auto --gamma auto), a seeded sampled request gets the
    coupled rule: alone, in company (other seeded and unseeded requests joining the batch), with
    a fixed γ or none, its text is plain decoding's with that seed (`exactspec generate --draft
    none --seed`)."""
    target, _ = tiny_folders
    prompt = "w5 w9 w5 w9 w5 w9 w5"
    args = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0.8, seed=1234)
    call = lambda kw: auto_server.client.completions.create(**kw).choices[0].text
    alone = call(args)
    assert alone == generate_cli(capsys, target, "none", prompt, "--no-chat", "--temperature",
                                 "0.8", "--seed", "1234")
    company = [args] + [dict(model="tiny", prompt=f"w{i} w{i + 2} w{i}", max_tokens=10 + i,
                             temperature=1.0, **({"seed": i} if i % 2 else {})) for i in range(5)]
    with concurrent.futures.ThreadPoolExecutor(len(company)) as pool:
        together = list(pool.map(call, company))
    assert together[0] == alone
    assert all(call({**args, "extra_body": {"gamma": g}}) == alone for g in (0, 1, 16))


def test_the_rule_follows_the_seed():
    """A seeded request gets the coupled rule, an unseeded one the server's; asking wins."""
    from exactspec.serve.app import ServerState, _rule
    from exactspec.serve.protocol import parse_request

    state = ServerState(ServeConfig(verify="token"))
    rule = lambda **body: _rule(state, parse_request({"prompt": "w1", **body}, "completions"))
    assert (rule(seed=3), rule(), rule(seed=3, verify="block")) == ("coupled", "token", "block")


def test_stream_arrives_in_chunks_and_matches(server):
    args = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
                temperature=0.8, seed=5, extra_body={"top_k": 10})
    whole = server.client.chat.completions.create(**args)
    chunks = list(server.client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) > 1
    assert "".join(texts) == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.model_extra["metrics"]["speculative_decoding"]["num_spec_steps"] > 0


def test_stop_string_ends_the_text(server):
    full = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                            temperature=0).choices[0].text
    word = full.split()[3]
    cut = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                           temperature=0, stop=[word]).choices[0]
    assert cut.text == full[: full.index(word)] and cut.finish_reason == "stop"


def test_concurrent_requests_with_different_settings(server):
    """8 requests at once: greedy ones equal their solo output, a seeded sampled one its solo text."""
    requests = [dict(prompt=f"w{i} w{i + 1} w2", max_tokens=6 + 3 * i, temperature=0,
                     extra_body={"gamma": i % 4}) for i in range(5)]
    requests += [dict(prompt="w5 w6", max_tokens=25, temperature=1.0, seed=11,
                      extra_body={"top_k": 8, "verify": "token"}),
                 dict(prompt="w8", max_tokens=20, temperature=0.7, top_p=0.9, seed=3),
                 dict(prompt="w4 w4", max_tokens=10, temperature=1.3)]
    call = lambda kw: server.client.completions.create(model="tiny", **kw).choices[0].text
    solo = [call(kw) for kw in requests[:7]]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(call, requests))
    assert together[:7] == solo


def test_disconnect_frees_the_row(server, monkeypatch):
    scheduler = server.state.scheduler
    original = scheduler._round
    monkeypatch.setattr(scheduler, "_round", lambda: (time.sleep(0.02), original())[1])
    cancelled = server.metric("exactspec:request_cancelled_total")
    # greedy decoding of these ids does not reach EOS within 100 tokens: only a cancel ends it early
    body = {"model": "tiny", "prompt": [1, 5, 9], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()  # kept open: breaking out of it would close the stream
        assert next(line for line in lines if line.startswith("data:"))
        deadline = time.time() + 5
        while server.metric("exactspec:num_requests_running") != 1 and time.time() < deadline:
            time.sleep(0.02)
        assert server.metric("exactspec:num_requests_running") == 1, httpx.get(server.url + "/metrics").text
    deadline = time.time() + 5
    while server.metric("exactspec:num_requests_running") and time.time() < deadline:
        time.sleep(0.02)
    assert server.metric("exactspec:num_requests_running") == 0
    assert server.metric("exactspec:request_cancelled_total") == cancelled + 1


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": 7}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
    ({"prompt": PROMPT, "n": 0}, 400, "n"),  # tests/test_n_choices.py: n > 1
    ({"prompt": PROMPT, "n": 17}, 400, "n"),
    ({"prompt": PROMPT, "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": PROMPT, "logprobs": 21}, 400, "logprobs"),  # tests/test_logprobs.py: the rest
    ({"prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
    ({"prompt": " ".join(["w1"] * 200)}, 400, "prompt"),
    ({"prompt": PROMPT, "max_tokens": 500}, 400, "prompt"),
    ({"prompt": PROMPT, "gamma": "fast"}, 400, "gamma"),
    ({"prompt": PROMPT, "verify": "tree"}, 400, "verify"),
])
def test_bad_requests_get_openai_errors(server, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(server.url + "/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param
    ok = server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert ok.usage.completion_tokens >= 1  # still serving


def test_openai_client_sees_the_errors(server):
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\], got 17"):
        server.client.completions.create(model="tiny", prompt=PROMPT, n=17)
    with pytest.raises(openai.BadRequestError, match="echo = True is not supported"):
        server.client.completions.create(model="tiny", prompt=PROMPT, echo=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "w1"}])
    with pytest.raises(openai.BadRequestError, match="tools"):
        server.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])


def test_full_queue_answers_429(server, monkeypatch):
    monkeypatch.setattr(server.state.scheduler, "max_queue", 0)
    with pytest.raises(openai.RateLimitError, match="queue is full"):
        server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    monkeypatch.undo()
    assert server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_bounded_load_run(server):
    """200 short requests at concurrency 16 over loopback: all succeed (no 5xx, none lost), the
    batch empties, and memory does not keep growing (the second 100 add < 30 MB)."""
    async def one(client, i, gate):
        async with gate:
            kw = dict(model="tiny", prompt=f"w{i % 29} w{(i * 7) % 29}", max_tokens=1 + i % 6,
                      temperature=(i % 3) / 2, seed=i, stream=i % 4 == 0)
            if kw["stream"]:
                return "".join([c.choices[0].text async for c in await client.completions.create(**kw)
                                if c.choices])
            return (await client.completions.create(**kw)).choices[0].text

    async def run(start, n):
        gate = asyncio.Semaphore(16)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i, gate) for i in range(start, start + n)))

    first = asyncio.run(run(0, 100))
    after_first = rss_mb()
    second = asyncio.run(run(100, 100))
    assert len(first) + len(second) == 200 and all(isinstance(t, str) for t in first + second)
    assert rss_mb() - after_first < 30
    assert server.metric("exactspec:num_requests_running") == 0
    assert server.metric("exactspec:request_rejected_total", '{status="500"}') == 0


def test_serve_command_prints_its_port(tiny_folders):  # noqa: F811
    import subprocess
    import sys

    target, _ = tiny_folders
    proc = subprocess.Popen([sys.executable, "-m", "exactspec", "serve", "--target", target,
                             "--draft", "ngram", "--port", "0", "--model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"http://\S+:\d+", line)
        assert found, f"stdout {line!r}; stderr {proc.stderr.read() if proc.poll() is not None else ''!r}"
        url = found.group(0)
        deadline = time.time() + 60
        while httpx.get(url + "/health").status_code == 503 and time.time() < deadline:
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3,
                                       temperature=0).choices[0].text
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_bundled_model_greedy_chat_equals_generate(capsys):
    from exactspec.models import BUNDLED_MODEL, BundledModelMissing, load_model

    try:
        load_model(BUNDLED_MODEL)
    except BundledModelMissing as err:
        pytest.skip(str(err))
    srv = Server(ServeConfig(target=BUNDLED_MODEL))  # the defaults: --draft auto --gamma auto
    try:
        question = "What is the capital of France?"
        reply = srv.client.chat.completions.create(
            model=BUNDLED_MODEL, messages=[{"role": "user", "content": question}], max_tokens=12,
            temperature=0).choices[0].message.content
        assert reply == generate_cli(capsys, BUNDLED_MODEL, "none", question, "--chat")
    finally:
        srv.close()


# --------------------------------------------------------------------------- response_format

SCHEMA = {"type": "object", "properties": {"ab": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "cd": {"type": "string", "maxLength": 3}},
          "required": ["ab", "cd"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pair", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def grammar_server(tmp_path_factory):
    """The server on tiny models whose tokenizer llguidance reads (byte-level BPE), prompt
    lookup as the draft (the grammar drafts what it forces)."""
    from conftest import GRAMMAR_VOCAB, make_grammar_tokenizer, make_tiny_llama

    folder = tmp_path_factory.mktemp("grammar-target")
    make_tiny_llama(0, vocab_size=GRAMMAR_VOCAB).save_pretrained(folder)
    make_grammar_tokenizer().save_pretrained(folder)
    srv = Server(ServeConfig(target=str(folder), draft="ngram", gamma="auto", model_name="tiny"))
    yield srv, str(folder)
    srv.close()


def test_response_format_json_schema(grammar_server, tmp_path, capsys):
    """Greedy, seeded and streamed replies to a json_schema request validate against the schema;
    the greedy one is `exactspec generate --json-schema` with plain decoding; requests are counted."""
    jsonschema = pytest.importorskip("jsonschema")
    srv, folder = grammar_server
    before = srv.metric("exactspec:request_constrained_total", '{kind="json_schema"}')
    call = lambda **kw: srv.client.completions.create(  # (legacy completions: response_format as extra_body)
        model="tiny", prompt='{"ab": 1', max_tokens=40, extra_body={"response_format": JSON_SCHEMA}, **kw)
    greedy = call(temperature=0).choices[0].text
    sampled = [call(temperature=1.0, seed=seed).choices[0].text for seed in range(4)]
    streamed = "".join(c.choices[0].text for c in call(temperature=1.0, seed=0, stream=True))
    assert streamed == sampled[0]
    for text in [greedy, *sampled]:
        jsonschema.validate(json.loads(text), SCHEMA)
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    assert main(["generate", '{"ab": 1', "--target", folder, "--draft", "none", "--json",
                 "--temperature", "0", "--max-new-tokens", "40", "--json-schema",
                 str(tmp_path / "schema.json")]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == greedy
    after = srv.metric("exactspec:request_constrained_total", '{kind="json_schema"}')
    assert after == before + 6


def test_response_format_json_object(grammar_server):
    srv, _ = grammar_server
    replies = [srv.client.completions.create(model="tiny", prompt="ab", max_tokens=60, seed=seed,
                                             extra_body={"response_format": {"type": "json_object"}}).choices[0]
               for seed in range(4)]
    assert all(reply.text.startswith("{") for reply in replies)
    finished = [reply.text for reply in replies if reply.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)


@pytest.mark.parametrize("response_format, param", [
    ({"type": "yaml"}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema"),
])
def test_bad_response_formats_get_openai_errors(grammar_server, response_format, param):
    srv, _ = grammar_server
    response = httpx.post(srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "ab", "response_format": response_format})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param and response.json()["error"]["message"]


def test_response_format_needs_a_tokenizer_llguidance_reads(server):
    """The word-level tiny tokenizer has no byte-level decoder: a 400 naming response_format."""
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "response_format": {"type": "json_object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


@pytest.mark.slow
def test_a_prompt_cache_feeds_a_chats_next_turn_only_its_new_tokens():
    """`serve --prompt-cache` on a llama.cpp target: the second turn's batch resumes the first's
    KV cache (its context fed fewer tokens than the prompt holds) and its greedy reply is plain
    decoding's of the whole conversation by a target without the cache (@invariant: no
    near-tie between the two)."""
    import torch

    from exactspec.engine import autoregressive_generate
    from exactspec.models import load_model

    pytest.importorskip("llama_cpp", reason="the llamacpp extra is not installed")
    spec = "llamacpp:smollm2-135m-instruct@invariant"
    srv = Server(ServeConfig(target=spec, draft="none", prompt_cache=True, model_name="tiny"))
    try:
        messages = [{"role": "user", "content": "Name three colours."}]
        first = srv.client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                   temperature=0).choices[0].message.content
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Two more?"}]
        encoded = srv.state.target.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        second = srv.client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                    temperature=0)
        deadline, left = time.time() + 30, []
        while not left and time.time() < deadline:  # the batch's context, once it is freed
            left = [rows for rows in srv.state.target.model.gguf.idle if rows.fed[:1] and
                    rows.fed[0][:len(ids)] == ids]
            time.sleep(0.05)
    finally:
        srv.close()
    assert left and left[0].tokens_fed < len(ids) == second.usage.prompt_tokens
    plain = load_model(spec)
    out = autoregressive_generate(plain, torch.tensor([ids]), max_new_tokens=16, temperature=0.0)
    expected = plain.tokenizer.decode(out.sequences[0, len(ids):].tolist(), skip_special_tokens=True)
    assert second.choices[0].message.content == expected


def test_serve_refuses_a_prompt_cache_without_a_llama_cpp_target(capsys):
    assert main(["serve", "--target", "smollm2-135m-instruct", "--prompt-cache"]) == 2
    assert "--prompt-cache: only a llama.cpp target keeps one" in capsys.readouterr().err
