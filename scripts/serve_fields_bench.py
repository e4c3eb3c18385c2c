"""Two of issue 48's costs, measured through a running `exactspec serve` with the `openai` client:

- tool calls: 10 tool-use prompts (two or three functions each), greedy, γ "auto" (drafts,
  grammar-forced tokens free) against γ 0 (plain constrained decoding: one target pass a token),
  interleaved; every reply checked (finish "tool_calls", a declared function, arguments valid
  against its schema) and the two modes' replies compared;
- logprobs: chat prompts at γ "auto", `logprobs` with `top_logprobs` 5 against none, interleaved.

Tokens/s = completion tokens / wall seconds over all prompts of a repeat, the median over repeats.

    python scripts/serve_fields_bench.py --target llamacpp:qwen2.5-coder-1.5b-instruct \\
        --draft llamacpp:qwen2.5-coder-0.5b-instruct --repeats 3 --json fields.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jsonschema
import openai

from exactspec.serve.bench import DEFAULT_PROMPTS, Mode, ServerProcess


def _schema(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


TEXT = {"type": "string", "maxLength": 24}
FUNCTIONS = {
    "get_weather": _schema(city=TEXT, unit={"enum": ["celsius", "fahrenheit"]}),
    "search": _schema(query=TEXT, limit={"type": "integer", "minimum": 1, "maximum": 9}),
    "calculator": _schema(expression=TEXT),
    "get_time": _schema(timezone=TEXT),
    "convert_currency": _schema(amount={"type": "number"}, source={"type": "string", "maxLength": 3},
                                target={"type": "string", "maxLength": 3}),
    "send_email": _schema(to=TEXT, subject=TEXT),
}
DESCRIPTIONS = {"get_weather": "Current weather in a city", "search": "Search the web",
                "calculator": "Evaluate an arithmetic expression", "get_time": "Current time in a timezone",
                "convert_currency": "Convert an amount between ISO currency codes",
                "send_email": "Send an email"}
PROMPTS = [  # (the user's message, the functions offered)
    ("What is the weather in Paris, in celsius?", ("get_weather", "search")),
    ("Search the web for green tea recipes, five results.", ("search", "calculator")),
    ("What is 17 times 23?", ("calculator", "search", "get_time")),
    ("What time is it in Tokyo?", ("get_time", "get_weather")),
    ("Convert 250 US dollars to euros.", ("convert_currency", "calculator")),
    ("Email bob@example.com that the meeting moved, subject 'Meeting'.", ("send_email", "search")),
    ("Is it raining in London? Use fahrenheit.", ("get_weather", "get_time", "search")),
    ("How much is 1200 yen in British pounds?", ("convert_currency", "search", "calculator")),
    ("Find three articles about speculative decoding.", ("search", "send_email")),
    ("What is the square root of 1764?", ("calculator", "get_weather")),
]


def tools(names) -> list[dict]:
    return [{"type": "function", "function": {"name": n, "description": DESCRIPTIONS[n],
                                              "parameters": FUNCTIONS[n]}} for n in names]


def check(choice, names) -> str | None:
    """Why a reply is not a valid call of one of `names`; None when it is."""
    if choice.finish_reason != "tool_calls" or not choice.message.tool_calls:
        return f"finish {choice.finish_reason}, no call"
    for call in choice.message.tool_calls:
        if call.function.name not in names:
            return f"undeclared function {call.function.name}"
        try:
            jsonschema.validate(json.loads(call.function.arguments), FUNCTIONS[call.function.name])
        except (ValueError, jsonschema.ValidationError) as err:
            return f"arguments: {err}"[:120]
    return None


def timed(client, **kwargs):
    started = time.perf_counter()
    reply = client.chat.completions.create(model="bench", temperature=0, **kwargs)
    return reply, time.perf_counter() - started


def measure_tools(client, repeats: int, max_tokens: int) -> dict:
    """γ auto vs γ 0 on every tool prompt, in alternating order; checks and agreement."""
    runs = {"auto": [], 0: []}
    problems, disagree, replies = [], 0, {}
    for r in range(repeats):
        totals = {"auto": [0, 0.0], 0: [0, 0.0]}
        for i, (text, names) in enumerate(PROMPTS):
            for gamma in (("auto", 0) if (r + i) % 2 == 0 else (0, "auto")):
                reply, seconds = timed(client, messages=[{"role": "user", "content": text}], tools=tools(names),
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=max_tokens,
                                       extra_body={"gamma": gamma})
                totals[gamma][0] += reply.usage.completion_tokens
                totals[gamma][1] += seconds
                choice = reply.choices[0]
                if (why := check(choice, names)) is not None:
                    problems.append(f"prompt {i}, γ {gamma}: {why}")
                calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
                replies.setdefault((r, i), {})[gamma] = calls
        for gamma, (tokens, seconds) in totals.items():
            runs[gamma].append(tokens / seconds)
    disagree = sum(1 for pair in replies.values() if pair["auto"] != pair[0])
    first = {i: replies[(0, i)]["auto"] for i in range(len(PROMPTS))}
    return {"tokens_per_s": {"auto": statistics.median(runs["auto"]), "plain": statistics.median(runs[0])},
            "runs": {"auto": runs["auto"], "plain": runs[0]},
            "speedup": statistics.median(runs["auto"]) / statistics.median(runs[0]),
            "invalid": problems, "greedy_disagree": disagree, "calls": first}


def measure_logprobs(client, repeats: int, max_tokens: int) -> dict:
    """logprobs + top_logprobs 5 vs none at γ auto, alternating; the texts must agree."""
    runs = {"on": [], "off": []}
    differ = 0
    for r in range(repeats):
        totals = {"on": [0, 0.0], "off": [0, 0.0]}
        for i, text in enumerate(DEFAULT_PROMPTS):
            texts = {}
            for mode in (("on", "off") if (r + i) % 2 == 0 else ("off", "on")):
                extra = {"logprobs": True, "top_logprobs": 5} if mode == "on" else {}
                reply, seconds = timed(client, messages=[{"role": "user", "content": text}],
                                       max_tokens=max_tokens, extra_body={"gamma": "auto"}, **extra)
                totals[mode][0] += reply.usage.completion_tokens
                totals[mode][1] += seconds
                texts[mode] = reply.choices[0].message.content
            differ += texts["on"] != texts["off"]
        for mode, (tokens, seconds) in totals.items():
            runs[mode].append(tokens / seconds)
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    return {"tokens_per_s": {"on": on, "off": off}, "runs": runs, "on_over_off": on / off,
            "texts_differ": differ}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--parts", default="tools,logprobs", help="which to measure (comma-separated)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    server = ServerProcess(args.target, Mode("drafting", args.draft, "auto"), max_batch=1)
    try:
        url = server.wait_ready()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
        result = {"target": args.target, "draft": args.draft, "repeats": args.repeats,
                  "max_tokens": args.max_tokens}
        for part, measure in (("tools", measure_tools), ("logprobs", measure_logprobs)):
            if part in args.parts.split(","):
                print(f"{part}: warming up, then measuring", file=sys.stderr)
                measure(client, 1, 16)
                result[part] = measure(client, args.repeats, args.max_tokens)
    finally:
        server.close()
    if "tools" in result:
        t = result["tools"]
        print(f"tool calls ({len(PROMPTS)} prompts): γ auto {t['tokens_per_s']['auto']:.1f} tok/s, plain "
              f"constrained {t['tokens_per_s']['plain']:.1f} tok/s, {t['speedup']:.2f}×; invalid "
              f"{len(t['invalid'])}, greedy replies differing {t['greedy_disagree']}")
        for problem in t["invalid"]:
            print("  invalid:", problem)
    if "logprobs" in result:
        lp = result["logprobs"]
        print(f"logprobs ({len(DEFAULT_PROMPTS)} prompts, γ auto): on {lp['tokens_per_s']['on']:.1f} tok/s, off "
              f"{lp['tokens_per_s']['off']:.1f} tok/s, on/off {lp['on_over_off']:.3f}; texts differing "
              f"{lp['texts_differ']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
