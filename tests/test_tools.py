"""Tool calls in /v1/chat/completions (`serve.tools`, `serve.tool_calls`): the request's checks,
the grammar, the prompt, the reply read back; end to end on tiny models whose tokenizer spells
every printable character (fast) and on the bundled SmolLM2 (slow). The real pair's 1.5B:
scripts/serve_fields_bench.py (ten prompts, every reply checked, γ "auto" = γ 0) and
scripts/openai_tour.py, run by hand (docs/serving.md)."""
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from exactspec.serve.app import ServeConfig  # noqa: E402
from exactspec.serve.errors import ApiError  # noqa: E402
from exactspec.serve.protocol import parse_request  # noqa: E402
from exactspec.serve.tool_calls import PREAMBLE, ToolCallReader, chat_prompt  # noqa: E402
from exactspec.serve.tools import parse_tools, tool_grammar  # noqa: E402
from test_cli_generate import tiny_folders  # noqa: E402,F401  (the module-scoped fixture)
from test_serve import Server  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query", "limit"], "additionalProperties": False}
CALCULATOR = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 16}},
              "required": ["expression"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "calculator": CALCULATOR}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
         for name, schema in SCHEMAS.items()]
QUESTION = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_calls(calls, allowed=tuple(SCHEMAS)) -> list[tuple[str, dict]]:
    """Each call names a declared function and its arguments validate against its schema."""
    assert calls, "no tool call"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


# --------------------------------------------------------------------------- the request

@pytest.mark.parametrize("body, param", [
    ({"tools": {"name": "x"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "bad name"}}]}, "tools[1].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]}, "tools[0].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools[0].function.examples"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": named("translate")}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "a"}]}, "messages[0].tool_call_id"),
])
def test_bad_tools_name_the_field(body, param):
    with pytest.raises(ApiError) as caught:
        parse_request({"messages": QUESTION, **body}, "chat")
    assert caught.value.status == 400 and caught.value.param == param and caught.value.message


def test_tool_request_defaults_and_history():
    params = parse_request({"messages": [
        *QUESTION,
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}], "tools": TOOLS}, "chat")
    assert (params.tools.choice, params.tools.name, params.tools.parallel) == ("auto", None, True)
    assert list(params.tools.parameters) == list(SCHEMAS)
    assert params.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert params.messages[2] == {"role": "tool", "content": "18 degrees", "tool_call_id": "call_1"}
    assert parse_tools({"tools": [], "tool_choice": "none"}) is None
    request = parse_tools({"tools": [{"type": "function", "function": {"name": "now"}}],
                           "tool_choice": named("now"), "parallel_tool_calls": False})
    assert (request.choice, request.name, request.parallel) == ("function", "now", False)
    assert request.parameters["now"] == {"type": "object", "properties": {}}


# --------------------------------------------------------------------------- the grammar

def matcher_for(tokenizer, grammar: str):
    import llguidance
    import llguidance.hf

    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[2])
    return lambda: llguidance.LLMatcher(view, llguidance.LLMatcher.grammar_from_lark(grammar))


def matches(make, tokenizer, text: str) -> bool:
    matcher = make()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
SEARCH_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "tea", "limit": 3}}\n</tool_call>'


@pytest.mark.parametrize("tags_are_tokens", [False, True])
@pytest.mark.parametrize("choice, parallel, accepted", [
    ("auto", True, {"text", "call", "text+call", "two", "call+newline"}),
    ("required", True, {"call", "two", "call+newline"}),
    ("required", False, {"call", "call+newline"}),
    ("search", True, set()),
    ("none", True, {"text"}),
])
def test_grammar_allows_exactly_the_replies(tags_are_tokens, choice, parallel, accepted):
    """Which replies each choice allows, the tags spelled as text or as tokens of their own;
    whatever follows an opening tag must be a valid call, in every choice."""
    tokenizer = printable_tokenizer(tags_are_tokens)
    request = parse_tools({"tools": TOOLS, "parallel_tool_calls": parallel,
                           "tool_choice": named(choice) if choice == "search" else choice})
    make = matcher_for(tokenizer, tool_grammar(request, tags_are_tokens, tags_are_tokens))
    replies = {"text": "It is sunny.", "call": WEATHER_CALL, "text+call": f"Let me look.\n{WEATHER_CALL}",
               "two": f"{WEATHER_CALL}\n{SEARCH_CALL}", "call+newline": f"{WEATHER_CALL}\n"}
    assert {name for name, text in replies.items() if matches(make, tokenizer, text)} == accepted
    assert matches(make, tokenizer, SEARCH_CALL) == (choice in ("auto", "required", "search"))
    for bad in ('<tool_call>\n{"name": "translate", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                'Hi <tool_call> there'):
        assert not matches(make, tokenizer, bad)


# --------------------------------------------------------------------------- the prompt and the reply

HISTORY = [*QUESTION,
           {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "unit": "celsius"}}}]},
           {"role": "tool", "content": "18", "tool_call_id": "a"}, {"role": "tool", "content": "sunny"}]


def test_fallback_prompt_for_a_template_without_tools():
    tokenizer = printable_tokenizer(False)
    request = parse_tools({"tools": TOOLS})
    messages, tools = chat_prompt(tokenizer, HISTORY, request)
    assert tools is None and messages[0]["role"] == "system"
    assert messages[0]["content"] == PREAMBLE.format(tools="\n".join(json.dumps(t) for t in request.tools))
    assert messages[2] == {"role": "assistant", "content": WEATHER_CALL}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18\n</tool_response>\n"
                                                      "<tool_response>\nsunny\n</tool_response>"}
    system = [{"role": "system", "content": "Be brief."}, *QUESTION]
    assert chat_prompt(tokenizer, system, request)[0][0]["content"].startswith("Be brief.\n\n# Tools\n")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<tools>" in text and WEATHER_CALL in text


def test_a_template_with_tools_gets_them():
    tokenizer = printable_tokenizer(True)
    request = parse_tools({"tools": TOOLS})
    messages, tools = chat_prompt(tokenizer, HISTORY, request)
    assert messages is HISTORY and tools == list(request.tools)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert json.dumps(request.tools[2]) in text and WEATHER_CALL in text


@pytest.mark.parametrize("text, content, calls", [
    (f"Let me look.\n{WEATHER_CALL}\n{SEARCH_CALL}\n", "Let me look.", ["get_weather", "search"]),
    (WEATHER_CALL, None, ["get_weather"]),
    ("Plain text, < and <tool and\n", "Plain text, < and <tool and\n", []),
    (f"{WEATHER_CALL}\n<tool_call>\n{{\"name\": \"sea", f"<tool_call>\n{{\"name\": \"sea", ["get_weather"]),
    ("a <tool_call>\nnot json\n</tool_call>", "a <tool_call>\nnot json\n</tool_call>", []),
])
def test_reader_whole_and_in_pieces(text, content, calls):
    """The reply read at once and read a few characters at a time give the same content and
    calls; whitespace around blocks is dropped, a block cut short stays text."""
    for size in (len(text), 1, 3, 7):
        reader, sent = ToolCallReader(), ""
        for start in range(0, len(text), size):
            sent += reader.push(text[start:start + size])[0]
        sent += reader.flush()
        assert (sent or None) == content and [c["function"]["name"] for c in reader.calls] == calls
    if calls:
        assert json.loads(reader.calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


# --------------------------------------------------------------------------- tiny models, end to end

def printable_tokenizer(tags_are_tokens: bool):
    """A byte-level BPE tokenizer of <unk> <s> </s>, newline and the 95 printable ASCII
    characters (no merges); with tags_are_tokens, also `<tool_call>` and `</tool_call>` as tokens
    of their own (as Qwen2.5's) and a chat template that renders tools, else a plain one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {10: "Ċ", 32: "Ġ", **{b: chr(b) for b in range(33, 127)}}  # the byte-level alphabet's
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *(chars[b] for b in [10, *range(32, 127)])])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="</s>")
    if tags_are_tokens:
        tokenizer.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("</tool_call>", special=False)])
    tokenizer.chat_template = TOOLS_TEMPLATE if tags_are_tokens else PLAIN_TEMPLATE
    return tokenizer


PLAIN_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                  "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
TOOLS_TEMPLATE = (  # Qwen2.5's, in short
    "{% if tools %}<s>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module", params=[False, True], ids=["tags-as-text", "tags-as-tokens"])
def tool_server(request, tmp_path_factory):
    """A server on tiny random models with `printable_tokenizer` and a model draft, γ 3."""
    from conftest import make_tiny_llama

    tokenizer = printable_tokenizer(request.param)
    folders = []
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        folder = tmp_path_factory.mktemp(f"tools-{name}")
        make_tiny_llama(seed, num_layers=layers, vocab_size=len(tokenizer),
                        max_position_embeddings=2048).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders.append(str(folder))
    srv = Server(ServeConfig(target=folders[0], draft=folders[1], gamma=3, model_name="tiny"))
    yield srv
    srv.close()


def ask(srv, tool_choice, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 160, "parallel_tool_calls": False, **kwargs}
    return srv.client.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS,
                                              tool_choice=tool_choice, **kwargs).choices[0]


@pytest.mark.parametrize("choice", ["required", "search"])
def test_tiny_calls_are_valid_and_speculation_changes_nothing(tool_server, choice):
    """Greedy replies are valid calls (of the named function when one is named), the same tokens
    with γ 0, γ 3 (the server's) and γ "auto"; seeded samples are valid calls too."""
    tool_choice = named(choice) if choice == "search" else choice
    replies = [ask(tool_server, tool_choice, extra_body={"gamma": gamma}, logprobs=True)
               for gamma in (0, None, "auto")]
    tokens = [[t.token for t in reply.logprobs.content] for reply in replies]
    assert tokens[0] == tokens[1] == tokens[2]
    allowed = (choice,) if choice == "search" else tuple(SCHEMAS)
    for reply in replies:
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        check_calls(reply.message.tool_calls, allowed)
    for seed in range(1):
        sampled = ask(tool_server, tool_choice, temperature=1.0, seed=seed, parallel_tool_calls=True)
        check_calls(sampled.message.tool_calls, allowed)


def test_tiny_stream_sends_the_calls(tool_server):
    whole = ask(tool_server, "required", seed=5, temperature=1.0, parallel_tool_calls=True)
    stream = ask_stream(tool_server, "required", seed=5, temperature=1.0, parallel_tool_calls=True)
    assert stream["finish"] == whole.finish_reason
    assert stream["calls"] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert stream["content"] == (whole.message.content or "")


def test_tiny_n_choices_each_read_their_calls(tool_server):
    """n = 2 with a seed: each choice reads its own calls, and is the reply that choice's seed
    (`noise.choice_seed`) gives alone — choice 0 the request's seed."""
    from exactspec.noise import choice_seed

    both = tool_server.client.chat.completions.create(
        model="tiny", messages=QUESTION, tools=TOOLS, tool_choice="required", n=2, seed=5,
        temperature=1.0, max_tokens=160, parallel_tool_calls=True).choices
    for choice in both:
        alone = ask(tool_server, "required", seed=choice_seed(5, choice.index), temperature=1.0,
                    parallel_tool_calls=True)
        assert choice.finish_reason == alone.finish_reason
        assert choice.message.content == alone.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        assert calls == [(c.function.name, c.function.arguments) for c in alone.message.tool_calls or ()]
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls, tuple(SCHEMAS))
    assert [c.finish_reason for c in both].count("tool_calls") >= 1


def ask_stream(srv, tool_choice, messages=QUESTION, model="tiny", **kwargs) -> dict:
    """A streamed reply's content, calls (name, arguments) and finish reason."""
    kwargs = {"temperature": 0, "max_tokens": 160, "parallel_tool_calls": False, **kwargs}
    chunks = srv.client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True,
                                                tool_choice=tool_choice, **kwargs)
    content, calls, finish = "", [], None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            assert call.index == len(calls) and call.id.startswith("call_")
            calls.append((call.function.name, call.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "calls": calls, "finish": finish}


def test_tiny_none_and_auto(tool_server):
    """"none" gives content and no calls; "auto" a reply that is text or valid calls."""
    for choice in ("none", "auto"):
        reply = ask(tool_server, choice, max_tokens=40, temperature=1.0, seed=3)
        assert reply.finish_reason in ("stop", "length", "tool_calls")
        if choice == "none" or reply.finish_reason != "tool_calls":
            assert reply.message.tool_calls is None and "<tool_call>" not in (reply.message.content or "")
        else:
            check_calls(reply.message.tool_calls)


def test_tools_need_a_tokenizer_llguidance_reads(tiny_folders):  # noqa: F811
    """The word-level tiny tokenizer has no byte-level decoder: a 400 naming tools."""
    srv = Server(ServeConfig(target=tiny_folders[0], draft="none", model_name="tiny"))
    try:
        tool = {"type": "function", "function": {"name": "f"}}  # (a short prompt: 128 positions)
        response = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                              json={"messages": [{"role": "user", "content": "w1"}], "tools": [tool],
                                    "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.json()
        response = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                              json={"messages": QUESTION, "tools": TOOLS, "tool_choice": "maybe"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    finally:
        srv.close()


# --------------------------------------------------------------------------- real models (slow)

PROMPTS = ["What is the weather in Paris, in celsius?", "Search the web for green tea recipes.",
           "What is 17 times 23?"]


def real_server(target: str):
    """A server on the bundled model, its default draft; skipped when the package that ships it
    is absent."""
    from exactspec.models import BundledModelMissing
    from exactspec.models.loading import bundled_gguf_path

    try:
        bundled_gguf_path()
    except BundledModelMissing as err:
        pytest.skip(str(err))
    return Server(ServeConfig(target=target, gamma="auto", model_name="real"))


def greedy_calls(srv, prompt: str, tool_choice, gamma, parallel: bool = True) -> tuple[list, list]:
    """(tokens, calls) of a greedy reply, its calls checked."""
    reply = srv.client.chat.completions.create(
        model="real", messages=[{"role": "user", "content": prompt}], tools=TOOLS, tool_choice=tool_choice,
        temperature=0, max_tokens=120, logprobs=True, parallel_tool_calls=parallel,
        extra_body={"gamma": gamma}).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    allowed = (tool_choice["function"]["name"],) if isinstance(tool_choice, dict) else tuple(SCHEMAS)
    return [t.token for t in reply.logprobs.content], check_calls(reply.message.tool_calls, allowed)


@pytest.mark.slow
def test_bundled_model_tool_calls():
    """SmolLM2 (its template has no tools: the preamble): greedy replies to two prompts, "required"
    and named, are valid calls, token for token the same with γ 0 and "auto" (γ 4: the
    tiny model's tests); streamed, the same call; "none" gives text. One call a reply
    (parallel_tool_calls false): after a call, greedy SmolLM2 would start another rather than end
    (it was not trained on tools), until max_tokens."""
    srv = real_server("smollm2-135m-instruct")
    try:
        for i, (prompt, name) in enumerate(zip(PROMPTS[:2], SCHEMAS)):
            tool_choice = named(name) if i % 2 else "required"
            plain = greedy_calls(srv, prompt, tool_choice, 0, parallel=False)
            assert greedy_calls(srv, prompt, tool_choice, "auto", parallel=False) == plain, (prompt, tool_choice)
        messages = [{"role": "user", "content": PROMPTS[0]}]
        whole = srv.client.chat.completions.create(model="real", messages=messages, tools=TOOLS, temperature=0,
                                                   max_tokens=160, tool_choice="required",
                                                   parallel_tool_calls=False).choices[0]
        streamed = ask_stream(srv, "required", messages, "real")
        assert streamed["calls"] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert streamed["finish"] == whole.finish_reason
        text = srv.client.chat.completions.create(model="real", messages=messages, tools=TOOLS,
                                                  tool_choice="none", temperature=0, max_tokens=24).choices[0]
        assert text.message.content and text.message.tool_calls is None
    finally:
        srv.close()
