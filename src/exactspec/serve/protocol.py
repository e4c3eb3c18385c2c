"""The OpenAI request fields the server accepts, checked one by one, and its error shape.

Supported: `model`, `prompt` (completions: a string or a list of token ids) / `messages` (chat),
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop`, `stream`,
`stream_options.include_usage`, `frequency_penalty` and `presence_penalty` (in [-2, 2]),
`logit_bias` ({token id: bias in [-100, 100]}), and the extras `min_p` (in [0, 1]),
`repetition_penalty` (> 0), `logprobs` (chat: a boolean, with `top_logprobs` in [0, 20];
completions: an integer in [0, 20]; see `serve.logprobs`), `top_k`, `gamma` (an integer in [0, 32] or
"auto"), `verify` ("block", "token" or "coupled"; default: "coupled" for a request with a
`seed`, so its text does not depend on its company, else the server's rule), `n` (1 to
MAX_CHOICES choices, each its own row; `best_of` only as 1 or n); chat's `tools`, `tool_choice`
and `parallel_tool_calls`, and messages with `tool_calls` or `role: "tool"` (`serve.tools`).
Fields that only restate the default (`echo: false`, null values, ...) are accepted; any other field,
or a value the server cannot honour, is a 400 naming the field — never silently ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from exactspec.policy import MAX_GAMMA
from exactspec.constraints import Constraint
from exactspec.logprobs import MAX_TOP_LOGPROBS
from exactspec.penalties import logit_bias_pairs
from exactspec.rows import DecodeStats
from exactspec.serve.errors import ApiError, bad  # noqa: F401  (ApiError: re-exported)
from exactspec.serve.tools import ToolRequest, assistant_calls, parse_tools, tool_result
from exactspec.verify import VERIFY_RULES

MAX_STOPS = 4
MAX_CHOICES = 16  # the most choices (`n`) of one request: each is a row of the running batch
# Fields accepted when they hold their default (or null): they change nothing.
_NO_OPS = {"echo": False, "parallel_tool_calls": None, "tools": [], "functions": [],
           "user": "*", "tool_choice": "none"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "gamma", "verify", "response_format", "frequency_penalty",
          "presence_penalty", "repetition_penalty", "logit_bias", "min_p", "logprobs", "n", "best_of"}
FIELDS = {"completions": COMMON | {"prompt"},
          "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                            "parallel_tool_calls"}}
# The keys a message may hold besides role, content and name (null ones are ignored).
_MESSAGE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


@dataclass
class Params:
    """A checked request."""

    kind: str  # "completions" or "chat"
    model: str | None
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    gamma: int | str | None = None  # None: the server's default
    verify: str | None = None  # None: "coupled" with a seed, else the server's default
    constraint: Constraint | None = None  # from response_format
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] | None = None  # sorted (token id, bias) pairs
    min_p: float | None = None
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    tools: ToolRequest | None = None  # chat's tools, tool_choice and parallel_tool_calls
    n: int = 1  # choices: rows decoded independently, choice i seeded `noise.choice_seed(seed, i)`


def _number(body: dict, name: str, low: float, high: float, default, *, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
        raise bad(name, f"{name} must be {kind}, got {value!r}")
    if not math.isfinite(value) or (value <= low if low_open else value < low) or value > high:
        where = (f"in ({low:g}, {high:g}]" if math.isfinite(high) else f"> {low:g}") if low_open else (
            f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}")
        raise bad(name, f"{name} must be {kind} {where}, got {value!r}")
    return value


def _gamma(body: dict):
    value = body.get("gamma")
    if value is None or value == "auto":
        return value
    try:
        return _number(body, "gamma", 0, MAX_GAMMA, None, integer=True)
    except ApiError:
        raise bad("gamma", f"gamma must be an integer in [0, {MAX_GAMMA}] or 'auto', "
                           f"got {value!r}") from None


def _check_no_ops(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in FIELDS[kind] or value is None:
            continue
        if name in _NO_OPS and (_NO_OPS[name] == "*" or value == _NO_OPS[name]):
            continue
        what = f"{name} = {value!r}" if name in _NO_OPS else name
        raise bad(name, f"{what} is not supported by this server")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"stop must be a string or a list of strings, got {stop!r}")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"stop may hold at most {MAX_STOPS} strings, got {len(stops)}")
    return [s for s in stops if s]


def _messages(body: dict) -> list[dict]:
    """Chat messages as the chat template takes them; an assistant's `tool_calls` and a `tool`
    message (a call's result) as Hugging Face's templates expect them (`serve.tools`)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list, got {messages!r}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'")
        role, where = message["role"], f"messages[{i}]"
        extra = {k for k, v in message.items() if v is not None} - {"role", "content", "name"}
        extra -= _MESSAGE_KEYS.get(role, set())
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", f"{where}.{sorted(extra)[0]} is not supported")
        calls = role == "assistant" and message.get("tool_calls") is not None
        content = _content(message.get("content"), where, optional=calls)
        if calls:
            out.append(assistant_calls(message, content, where))
        elif role == "tool":
            out.append(tool_result(message, content, where))
        else:
            out.append({"role": role, "content": content})
    return out


def _content(content, where: str, optional: bool = False) -> str | None:
    """A message's content: a string, or text content parts joined (None where `optional`)."""
    if content is None and optional:
        return None
    if isinstance(content, list):  # content parts: only text parts
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"{where}.content", "only text content parts are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{where}.content", f"{where}.content must be a string")
    return content


def _prompt(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in prompt):
        return prompt
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt "
                        f"per request), got {type(prompt).__name__}")


def parse_request(body, kind: str) -> Params:
    """Check an endpoint's JSON body; raise ApiError(400) naming the first bad field."""
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_no_ops(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"model must be a string, got {model!r}")
    params = Params(kind=kind, model=model)
    if kind == "chat":
        params.messages = _messages(body)
        params.tools = parse_tools(body)
    else:
        params.prompt = _prompt(body)
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params.max_tokens = _number(body, limit, 1, math.inf, None, integer=True)
    params.temperature = float(_number(body, "temperature", 0, 2, 1.0))
    params.top_p = _number(body, "top_p", 0, 1, None, low_open=True)
    params.top_k = _number(body, "top_k", 1, math.inf, None, integer=True)
    params.seed = _number(body, "seed", -(2 ** 63), 2 ** 64 - 1, None, integer=True)
    params.gamma = _gamma(body)
    params.stop = _stop(body)
    for flag in ("stream",):
        if not isinstance(body.get(flag, False), bool) and body.get(flag) is not None:
            raise bad(flag, f"{flag} must be a boolean, got {body[flag]!r}")
    params.stream = bool(body.get("stream"))
    params.include_usage = _include_usage(body.get("stream_options"), params.stream)
    verify = body.get("verify")
    if verify is not None and verify not in VERIFY_RULES:
        raise bad("verify", f"verify must be one of {', '.join(map(repr, VERIFY_RULES))}, "
                            f"got {verify!r}")
    params.verify = verify
    params.constraint = _response_format(body.get("response_format"))
    if params.constraint is not None and params.tools is not None and params.tools.calls:
        raise bad("response_format", "response_format with tools needs tool_choice = 'none' (a reply "
                                     "that may call tools follows the tools' grammar)")
    _penalties(body, params)
    params.logprobs = _logprobs(body, kind)
    params.n = _choices(body)
    return params


def _choices(body: dict) -> int:
    """`n` in [1, MAX_CHOICES]; `best_of` (the best n of best_of candidates) only where it picks
    nothing: 1 or n."""
    n = _number(body, "n", 1, MAX_CHOICES, 1, integer=True)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or not isinstance(best_of, int)
                                or best_of not in (1, n)):
        raise bad("best_of", f"best_of must be 1 or n ({n}): choosing the best of more candidates "
                             f"is not supported, got {best_of!r}")
    return n


def _logprobs(body: dict, kind: str) -> int | None:
    """The alternatives per token asked for: completions' `logprobs` N, chat's `top_logprobs`
    (0 when absent) once `logprobs` is true; None when not asked."""
    if kind == "completions":
        return _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    asked = body.get("logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise bad("logprobs", f"logprobs must be a boolean, got {asked!r}")
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    if top is not None and not asked:
        raise bad("top_logprobs", "top_logprobs needs logprobs = true")
    return (top or 0) if asked else None


def _penalties(body: dict, params: Params) -> None:
    """frequency_penalty, presence_penalty, repetition_penalty, min_p and logit_bias (OpenAI's
    ranges; repetition_penalty and min_p as vLLM's) into params."""
    params.frequency_penalty = float(_number(body, "frequency_penalty", -2, 2, 0.0))
    params.presence_penalty = float(_number(body, "presence_penalty", -2, 2, 0.0))
    params.repetition_penalty = float(_number(body, "repetition_penalty", 0, math.inf, 1.0,
                                              low_open=True))
    params.min_p = _number(body, "min_p", 0, 1, None)
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise bad("logit_bias", f"logit_bias must be an object mapping token ids to biases, got {bias!r}")
    pairs = {}
    for key, value in bias.items():
        try:  # JSON object keys are strings: "50256"
            token = int(key) if isinstance(key, str) and key.strip().isascii() else None
        except ValueError:
            token = None
        if token is None or token < 0:
            raise bad("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        pairs[token] = value
    try:
        params.logit_bias = logit_bias_pairs(pairs)
    except ValueError as err:
        raise bad("logit_bias", str(err)) from None


def _response_format(value) -> Constraint | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad("response_format", "response_format must be {\"type\": \"text\"}, "
                                     f"\"json_object\" or \"json_schema\", got {value!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad("response_format.json_schema", "response_format.json_schema must be an object "
                                                 "with the schema under \"schema\"")
    try:
        return Constraint.json_schema(spec.get("schema", {}))
    except ValueError as err:
        raise bad("response_format.json_schema.schema", str(err)) from None


def _include_usage(options, stream: bool) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", f"stream_options supports only include_usage, got {options!r}")
    if not stream:
        raise bad("stream_options", "stream_options needs stream = true")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise bad("stream_options.include_usage", f"include_usage must be a boolean, got {value!r}")
    return value


def speculative_metrics(*stats) -> dict:
    """vLLM's per-request `metrics.speculative_decoding`, from the DecodeStats of a request's rows
    (one per choice) summed, a row never admitted (None) adding nothing; and by source (who
    drafted each round: "model", "ngram", "ngram-1", "grammar", or "plain" for the rounds without
    drafts) the same three counts, which add up to the totals; per position i of a round's block,
    the rounds with a draft there and those whose draft there was accepted."""
    total = DecodeStats()
    for row in (row for row in stats if row is not None):
        total.add(row, rounds=True)
    steps, drafted, accepted = total.rounds, total.drafted_tokens, total.accepted_drafts
    by_source = {name: {"num_spec_steps": share.rounds, "num_draft_tokens": share.drafted_tokens,
                        "num_accepted_draft_tokens": share.accepted_drafts}
                 for name, share in sorted(total.by_source.items())}
    drafted_per_pos, accepted_per_pos = total.drafted_per_pos, total.accepted_per_pos
    return {"num_spec_steps": steps, "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / steps if steps else None,
            "by_source": by_source, "num_draft_tokens_per_pos": drafted_per_pos,
            "num_accepted_tokens_per_pos": accepted_per_pos}
