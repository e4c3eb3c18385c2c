"""Tool calls, the request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the
tool messages of a chat's history, and the grammar a reply follows.

The format is Qwen2.5's (and Hermes'): a call is
`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, parallel calls one after another
separated by "\\n", and one "\\n" may follow the last. The grammar (`tool_grammar`, a Lark grammar
in llguidance's dialect, made a `Constraint`) holds each function's JSON Schema inline (`%json`),
laid out as `json.dumps` writes it, so the name, the keys and the punctuation are forced tokens,
drafted for free:

- "required", or a named function: the reply is calls from its first token (only that function's
  when one is named); one call, or one or more when `parallel_tool_calls` (default true).
- "auto" (the default with tools): text that never spells `<tool_call>`, or such text followed by
  calls. Whatever follows a `<tool_call>` is a valid call; the text before it is free.
- "none": text that never spells `<tool_call>` (the tools are still in the prompt, as OpenAI's).

Where the tokenizer has `<tool_call>` (or `</tool_call>`) as one token of its own (Qwen2.5), the
grammar asks for that token, the model's own spelling; else for the text. Free text allows any
text, not other special tokens; the end (EOS) where the grammar may end.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from exactspec.constraints import JSON_LAYOUT, Constraint
from exactspec.serve.errors import bad

TOOL_CHOICES = ("auto", "none", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI's meaning of absent `parameters`


@dataclass(frozen=True)
class ToolRequest:
    """A request's checked tools. tools: OpenAI's {"type": "function", "function": {...}} each, as
    the chat template gets them; parameters: each function's JSON Schema by name, in order;
    choice: "auto", "none", "required" or "function" (then `name` is the function's)."""

    tools: tuple[dict, ...]
    parameters: dict
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the reply may hold calls (then it is parsed for them)."""
        return self.choice != "none"


def parse_tools(body: dict) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; None without tools
    (then only tool_choice "auto" / "none" is accepted). ApiError(400) naming the first bad field."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {parallel!r}")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of {{\"type\": \"function\", \"function\": ...}}, "
                           f"got {tools!r}")
    checked = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools or ())]
    parameters = {}
    for i, tool in enumerate(checked):
        name = tool["function"]["name"]
        if name in parameters:
            raise bad(f"tools[{i}].function.name", f"tools[{i}].function.name {name!r} is declared twice")
        parameters[name] = tool["function"]["parameters"]
    choice, name = _tool_choice(body.get("tool_choice"), parameters)
    if not checked:
        return None
    return ToolRequest(tuple(checked), parameters, choice, name,
                       True if parallel is None else parallel)


def _tool(tool, where: str) -> dict:
    """One checked tool, with `parameters` filled in; its JSON Schema compiled."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad(f"{where}.type", f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}, "
                                   f"got {tool!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad(f"{where}.function", f"{where}.function must be an object, got {function!r}")
    extra = sorted(set(tool) - {"type", "function"}) + sorted(set(function) - _FUNCTION_KEYS)
    if extra:
        key = extra[0]
        in_tool = key in tool and key not in ("type", "function")
        field = f"{where}.{key}" if in_tool else f"{where}.function.{key}"
        raise bad(field, f"{field} is not supported")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, "
                                            f"'_' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}.function.description", f"{where}.function.description must be a string, "
                                                   f"got {description!r}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):  # always strict here
        raise bad(f"{where}.function.strict", f"{where}.function.strict must be a boolean, got {strict!r}")
    described = {"description": description} if description else {}
    return {"type": "function", "function": {"name": name, **described,
                                             "parameters": _parameters(function.get("parameters"), where)}}


def _parameters(schema, where: str) -> dict:
    """A function's parameters: a JSON Schema of an object (absent: no parameters), compiled."""
    if schema is None:
        return dict(NO_PARAMETERS)
    field = f"{where}.function.parameters"
    if not isinstance(schema, dict):
        raise bad(field, f"{field} must be a JSON Schema object, got {schema!r}")
    if schema.get("type", "object") != "object":
        raise bad(field, f"{field} must describe an object (\"type\": \"object\"), got type "
                         f"{schema.get('type')!r}")
    try:
        Constraint.json_schema(schema)
    except ValueError as err:
        raise bad(field, f"{field}: {err}") from None
    return schema


def _tool_choice(value, parameters: dict) -> tuple[str, str | None]:
    """(choice, the named function or None). Without tools, only "auto" and "none"."""
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise bad("tool_choice", f"tool_choice must be one of {', '.join(map(repr, TOOL_CHOICES))} or "
                                     f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, "
                                     f"got {value!r}")
        if value == "required" and not parameters:
            raise bad("tool_choice", "tool_choice 'required' needs tools")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad("tool_choice", "tool_choice must be a string or {\"type\": \"function\", "
                                 f"\"function\": {{\"name\": ...}}}}, got {value!r}")
    if name not in parameters:
        declared = ", ".join(map(repr, parameters)) or "none"
        raise bad("tool_choice.function.name", f"tool_choice names the function {name!r}, which "
                                               f"tools does not declare (declared: {declared})")
    return "function", name


def tool_grammar(request: ToolRequest, open_token: bool, close_token: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a reply under `request` (see the module's
    docstring). open_token / close_token: the tokenizer has `<tool_call>` / `</tool_call>` as one
    special token of its own (the grammar then names it: `<tool_call>`), else they are text."""
    opening = OPEN if open_token else json.dumps(OPEN)
    closing = CLOSE if close_token else json.dumps(CLOSE)
    names = [request.name] if request.choice == "function" else list(request.parameters)
    more = f' ("\\n" {opening} call)*' if request.parallel else ""  # parallel calls, "\n" apart
    functions = " | ".join(f"fn_{i}" for i in range(len(names)))
    lines = [
        # text that never spells the opening tag: free text, and the text before calls
        r"TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/",
        f'calls: call{more} "\\n"?',  # a line end after the last call (Qwen2.5 writes one)
        f'call: "\\n" ({functions}) "\\n" {closing}',
        # the text before calls and the opening tag: one lexeme, ended by the tag's first
        # spelling (lazy) when the tag is text; the tag token ends the text by itself
        f"lead{'' if open_token else '[lazy]'}: TEXT {opening}",
    ]
    for i, name in enumerate(names):
        schema = {**request.parameters[name], "x-guidance": JSON_LAYOUT}
        head = json.dumps(f'{{"name": "{name}", "arguments": ')
        lines.append(f'fn_{i}: {head} %json {json.dumps(schema)} "}}"')
    start = {"none": "TEXT", "auto": "TEXT | lead calls"}.get(request.choice, f"{opening} calls")
    return "\n".join([f"start: {start}", *lines]) + "\n"


def tool_constraint(request: ToolRequest, tokenizer, matcher_tokenizer) -> Constraint:
    """The reply's Constraint for `request` on this tokenizer (the Hugging Face one, and
    llguidance's view of it, which says which tokens are special)."""
    return Constraint.lark(tool_grammar(request, *(_own_token(tag, tokenizer, matcher_tokenizer)
                                                   for tag in (OPEN, CLOSE))))


def _own_token(tag: str, tokenizer, matcher_tokenizer) -> bool:
    """Whether `tag` is one special token (to llguidance) of the tokenizer."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return len(ids) == 1 and matcher_tokenizer.is_special_token(ids[0])


# --------------------------------------------------------------------------- history messages

def assistant_calls(message: dict, content: str | None, where: str) -> dict:
    """An assistant message with OpenAI's `tool_calls` as Hugging Face templates take it: each
    call's `arguments` a JSON string parsed into an object."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where}.tool_calls", f"{where}.tool_calls must be a non-empty list")
    out = []
    for j, call in enumerate(calls):
        field = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{field}.function", f"{field} must be {{\"type\": \"function\", \"function\": "
                                           f"{{\"name\": ..., \"arguments\": ...}}}}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError as err:
            raise bad(f"{field}.function.arguments", f"{field}.function.arguments is not valid "
                                                     f"JSON: {err}") from None
        if not isinstance(arguments, dict):
            raise bad(f"{field}.function.arguments", f"{field}.function.arguments must be a JSON object")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return {"role": "assistant", "content": content or "", "tool_calls": out}


def tool_result(message: dict, content: str, where: str) -> dict:
    """A `role: "tool"` message (a call's result) as Hugging Face templates take it."""
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string, got {call_id!r}")
    out = {"role": "tool", "content": content}
    out.update({key: message[key] for key in ("tool_call_id", "name") if isinstance(message.get(key), str)})
    return out
