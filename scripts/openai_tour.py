"""Every request field exactspec serves, sent with the official `openai` client to a running
`exactspec serve`, streamed and not; prints what came back and checks its shape (exit status 1
when a check fails). Issue 48's tour:

    exactspec serve --target smollm2-135m-instruct --port 8000 &
    python scripts/openai_tour.py --base-url http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jsonschema
import openai

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CALCULATOR = {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 16}},
              "required": ["expression"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "calculator": CALCULATOR}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"the {name} tool",
                                           "parameters": schema}} for name, schema in SCHEMAS.items()]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["name", "population"], "additionalProperties": False}
USER = [{"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"
NEAR_TIE = 0.01  # nats between the target's two likeliest tokens


class Tour:
    """The cases, each one request (or a pair: streamed and not) and its checks."""

    def __init__(self, client: openai.OpenAI, model: str, tool_tokens: int):
        self.client, self.model, self.tool_tokens = client, model, tool_tokens
        self.results: list[dict] = []

    def case(self, name: str, shown, ok: bool, why: str = "", near_tie: bool = False) -> None:
        self.results.append({"case": name, "ok": ok, "shown": shown, "near_tie": near_tie,
                             **({"why": why} if why else {})})

    def chat(self, stream: bool = False, **kwargs):
        kwargs = {"model": self.model, "messages": USER, "max_tokens": 12, **kwargs}
        return self.client.chat.completions.create(stream=stream, **kwargs)

    def completion(self, stream: bool = False, **kwargs):
        kwargs = {"model": self.model, "prompt": PROMPT, "max_tokens": 12, **kwargs}
        return self.client.completions.create(stream=stream, **kwargs)

    def run(self) -> list[dict]:
        for step in (self.models, self.sampling, self.stream_equals_whole, self.logprobs, self.choices,
                     self.penalties, self.structured, self.tools, self.tool_round_trip, self.refusals):
            started, cases = time.perf_counter(), len(self.results)
            try:
                step()
            except Exception as err:  # a case that raised: reported, the tour goes on
                self.case(step.__name__, None, False, f"{type(err).__name__}: {err}")
            for result in self.results[cases:]:  # a step's seconds, shared by its cases
                result["seconds"] = round((time.perf_counter() - started) / (len(self.results) - cases), 2)
        return self.results

    def models(self) -> None:
        ids = [m.id for m in self.client.models.list().data]
        self.case("GET /v1/models", ids, self.model in ids)

    def sampling(self) -> None:
        """temperature, top_p, top_k, min_p, seed, stop, max_tokens, gamma, verify; prompt as ids."""
        seeded = dict(temperature=0.8, top_p=0.9, seed=7, extra_body={"top_k": 40, "min_p": 0.05})
        first, again = self.completion(**seeded), self.completion(**seeded)
        self.case("completions: seeded sampling twice", first.choices[0].text,
                  first.choices[0].text == again.choices[0].text)
        spec = self.completion(temperature=0, extra_body={"gamma": 4, "verify": "block"})
        plain = self.completion(temperature=0, extra_body={"gamma": 0})
        self.same("completions: greedy, γ 4 (block rule) = γ 0", spec.choices[0].text, plain.choices[0].text,
                  temperature=0)
        stopped = self.chat(temperature=0, stop=[","], max_completion_tokens=24)
        self.case("chat: stop, max_completion_tokens", stopped.choices[0].message.content,
                  "," not in stopped.choices[0].message.content)
        ids = self.completion(prompt=[504, 1046], temperature=0, max_tokens=4)
        self.case("completions: prompt as token ids", ids.choices[0].text, ids.usage.prompt_tokens == 2)

    def same(self, name: str, text: str, plain: str, **request) -> None:
        """A text that must equal plain decoding's (`plain`, the same `request` at γ 0). Where
        they part at a near-tie of the target (its two likeliest tokens there within NEAR_TIE
        nats in the plain run), the case says so: on llama.cpp a pass over k tokens and one over
        a single token round differently, and a near-tie can go either way (docs/llamacpp.md)."""
        if text == plain:
            return self.case(name, text, True)
        common = next(i for i, (a, b) in enumerate(zip(text + "\0", plain + "\0")) if a != b)
        again = self.completion(logprobs=2, **{**request, "extra_body": {"gamma": 0}}).choices[0]
        spelled, gap = 0, float("inf")
        for token, top in zip(again.logprobs.tokens, again.logprobs.top_logprobs):
            spelled += len(token)
            if spelled > common:  # the token in which the texts part
                best = sorted(top.values(), reverse=True)
                gap = best[0] - best[1] if len(best) > 1 else gap
                break
        shown = {"texts": [text, plain], "parted_after": plain[:common], "gap_nats": round(gap, 5)}
        self.case(name, shown, False, f"a near-tie: {gap:.4f} nats" if gap < NEAR_TIE else "not at a near-tie",
                  near_tie=gap < NEAR_TIE)

    def stream_equals_whole(self) -> None:
        whole = self.chat(temperature=0)
        parts, usage = [], None
        for chunk in self.chat(stream=True, temperature=0, stream_options={"include_usage": True}):
            parts += [c.delta.content or "" for c in chunk.choices]
            usage = chunk.usage or usage
        metrics = (whole.model_extra or {}).get("metrics", {}).get("speculative_decoding", {})
        self.case("chat: streamed = whole, usage and metrics", {"text": "".join(parts), "metrics": metrics},
                  "".join(parts) == whole.choices[0].message.content and usage is not None
                  and usage.completion_tokens == whole.usage.completion_tokens and "num_draft_tokens" in metrics)

    def logprobs(self) -> None:
        chat = self.chat(temperature=0, logprobs=True, top_logprobs=3).choices[0]
        tokens = [(t.token, round(t.logprob, 3), len(t.top_logprobs)) for t in chat.logprobs.content]
        self.case("chat: logprobs, top_logprobs 3", tokens[:3],
                  all(k == 3 and lp <= 0 for _, lp, k in tokens))
        streamed = [t.token for chunk in self.chat(stream=True, temperature=0, logprobs=True, top_logprobs=3)
                    for c in chunk.choices if c.logprobs for t in c.logprobs.content]
        self.case("chat: logprobs streamed = whole", len(streamed), streamed == [t for t, _, _ in tokens])
        done = self.completion(temperature=0, logprobs=2).choices[0]
        self.case("completions: logprobs 2", done.logprobs.tokens[:3],
                  len(done.logprobs.top_logprobs[0]) == 2 and "".join(done.logprobs.tokens) == done.text)

    def choices(self) -> None:
        """n with a seed: reproducible; streamed, each chunk names its choice."""
        first = self.chat(n=2, seed=11, temperature=1.0)
        again = self.chat(n=2, seed=11, temperature=1.0)
        texts = [c.message.content for c in first.choices]
        self.case("chat: n 2, seeded twice", texts, texts == [c.message.content for c in again.choices]
                  and [c.index for c in first.choices] == [0, 1])
        parts = ["", ""]
        for chunk in self.chat(stream=True, n=2, seed=11, temperature=1.0):
            for c in chunk.choices:
                parts[c.index] += c.delta.content or ""
        self.case("chat: n 2 streamed = whole", parts, parts == texts)

    def penalties(self) -> None:
        penalised = self.completion(temperature=0, max_tokens=16, frequency_penalty=1.5, presence_penalty=0.5,
                                    extra_body={"repetition_penalty": 1.3})
        self.case("completions: frequency, presence and repetition penalties", penalised.choices[0].text,
                  penalised.usage.completion_tokens > 0)
        forced = self.completion(temperature=0, max_tokens=4, logprobs=0, logit_bias={"504": 100}).choices[0]
        tokens = forced.logprobs.tokens
        self.case("completions: logit_bias +100 forces token 504", tokens, len(tokens) == 4 and len(set(tokens)) == 1)
        banned = self.completion(prompt=[504, 504, 504], temperature=0, max_tokens=8, logprobs=0,
                                 logit_bias={"504": -100}).choices[0]
        self.case("completions: logit_bias -100 bans it", banned.logprobs.tokens, tokens[0] not in banned.logprobs.tokens)

    def structured(self) -> None:
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
        for stream in (False, True):
            text = self._text(self.chat(stream=stream, temperature=0, max_tokens=48, response_format=schema,
                                        messages=[{"role": "user", "content": "A big city, as JSON."}]))
            self.case(f"chat: response_format json_schema{' streamed' if stream else ''}", text,
                      _valid(text, CITY))
        text = self._text(self.chat(temperature=0, max_tokens=24, response_format={"type": "json_object"}))
        self.case("chat: response_format json_object", text, _valid(text, {"type": "object"}))

    def tools(self) -> None:
        ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = self.chat(messages=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                              temperature=0, max_tokens=self.tool_tokens).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or ()]
            self.case(f"chat: tools, tool_choice {json.dumps(choice)}", calls,
                      reply.finish_reason == "tool_calls" and _calls_valid(calls))
        calls = []
        for chunk in self.chat(stream=True, messages=ask, tools=TOOLS, tool_choice="required",
                               parallel_tool_calls=False, temperature=0, max_tokens=self.tool_tokens):
            for c in chunk.choices:
                calls += [(t.function.name, t.function.arguments) for t in c.delta.tool_calls or ()]
        self.case("chat: tools streamed", calls, _calls_valid(calls))
        none = self.chat(messages=ask, tools=TOOLS, tool_choice="none", temperature=0).choices[0]
        self.case("chat: tool_choice none", none.message.content,
                  none.message.tool_calls is None and bool(none.message.content))
        auto = self.chat(messages=ask, tools=TOOLS, tool_choice="auto", temperature=0,
                         max_tokens=48).choices[0]  # free text or calls: a call may be cut short
        calls = [(c.function.name, c.function.arguments) for c in auto.message.tool_calls or ()]
        self.case("chat: tool_choice auto", {"content": auto.message.content, "calls": calls},
                  _calls_valid(calls) if calls else bool(auto.message.content))

    def tool_round_trip(self) -> None:
        """An assistant message with tool_calls and the tool's result, sent back."""
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
        reply = self.chat(messages=messages, tools=TOOLS, tool_choice="none", temperature=0).choices[0]
        self.case("chat: a tool's result sent back", reply.message.content, bool(reply.message.content))

    def refusals(self) -> None:
        for field, value in (("echo", True), ("best_of", 3), ("functions", [{"name": "f"}])):
            try:
                self.completion(extra_body={field: value}) if field != "functions" else \
                    self.chat(extra_body={field: value})
                self.case(f"{field} = {value!r}: refused", None, False, "accepted")
            except openai.BadRequestError as err:
                param = err.body.get("param") if isinstance(err.body, dict) else None
                self.case(f"{field} = {value!r}: refused", f"400, param {param}", param == field)

    def _text(self, reply) -> str:
        if isinstance(reply, openai.Stream):
            return "".join(c.delta.content or "" for chunk in reply for c in chunk.choices)
        return reply.choices[0].message.content


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _calls_valid(calls: list[tuple[str, str]]) -> bool:
    return bool(calls) and all(name in SCHEMAS and _valid(arguments, SCHEMAS[name]) for name, arguments in calls)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's /v1, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", help="the served model's name (default: the first /v1/models lists)")
    parser.add_argument("--tool-tokens", type=int, default=120, help="max_tokens of a tool-call reply")
    parser.add_argument("--json", action="store_true", help="the results as JSON")
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    results = Tour(client, model, args.tool_tokens).run()
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for r in results:
            mark = "ok  " if r["ok"] else "tie " if r["near_tie"] else "FAIL"
            print(f"{mark} {r['seconds']:5.1f} s  {r['case']:<58} {json.dumps(r['shown'], ensure_ascii=False)[:90]}"
                  + (f"  ({r['why']})" if "why" in r else ""))
    ties = [r["case"] for r in results if r["near_tie"]]
    failed = [r["case"] for r in results if not r["ok"] and not r["near_tie"]]
    print(f"{len(results) - len(failed) - len(ties)}/{len(results)} cases ok"
          + (f"; parted at a near-tie: {ties}" if ties else "") + (f"; failed: {failed}" if failed else ""),
          file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
