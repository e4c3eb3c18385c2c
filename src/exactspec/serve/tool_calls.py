"""Tool calls, the prompt and the reply: a chat rendered with its tools, and a reply's
`<tool_call>` blocks read back as OpenAI's `tool_calls` (whole, or streamed).

The prompt: a chat template that knows tools (its text mentions `tools`, as Qwen2.5's does) gets
them as Hugging Face passes them (`apply_chat_template(messages, tools=...)`), with the history's
tool calls and tool results as messages. A template that does not (SmolLM2's) gets the fallback:
the tools, as JSON, in a system-prompt preamble (`PREAMBLE`, Qwen2.5's own words and format),
each earlier call written out as its `<tool_call>` block in the assistant's text, and each tool
result as a user turn holding `<tool_response>\\n...\\n</tool_response>` (as Qwen2.5 renders it).

The reply (`ToolCallReader`): each complete `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>` block becomes a call; the text before the first is the content (the whitespace
right before a block, and between and after blocks, is dropped); a block cut short (by
`max_tokens` or a stop string) stays in the content as it was written. Streamed, text is sent as
it comes except what may be the start of a block, and a call is sent whole, in one delta, once
its block is complete.
"""
from __future__ import annotations

import json
import uuid

from exactspec.serve.tools import CLOSE, OPEN, ToolRequest

PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def knows_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools (its text mentions `tools`)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in texts)


def chat_prompt(tokenizer, messages: list[dict], tools: ToolRequest | None) -> tuple[list[dict], list | None]:
    """(messages, tools) for `apply_chat_template`: as they are for a template that knows tools,
    else the fallback's messages and no tools."""
    if knows_tools(tokenizer):
        return messages, list(tools.tools) if tools is not None else None
    out = []
    for i, message in enumerate(messages):
        if message["role"] == "tool" and i and messages[i - 1]["role"] == "tool":  # one turn
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{_plain(message)['content']}"}
        else:
            out.append(_plain(message))
    if tools is not None:
        preamble = PREAMBLE.format(tools="\n".join(json.dumps(tool) for tool in tools.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{preamble}"}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


def _plain(message: dict) -> dict:
    """A message of the history as text: a call as its block, a tool result as a user turn
    (tool results in a row share one, as Qwen2.5's template writes them)."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    if "tool_calls" not in message:
        return message
    text = [message["content"]] if message["content"] else []
    text += [block(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]]
    return {"role": "assistant", "content": "\n".join(text)}


def block(name: str, arguments: dict) -> str:
    """A call as the model writes it."""
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


class ToolCallReader:
    """Reads a reply's text as it arrives: `push(text)` → (content to send, calls completed);
    `flush()` at the end → the content held back. `calls` holds every call read."""

    def __init__(self):
        self.held = ""  # text not yet sent: a possible opening tag, a block, or whitespace
        self.inside = False  # `held` is a block's body (its opening tag read)
        self.gap = ""  # the whitespace dropped before that block, if it is one
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content, first = "", len(self.calls)
        while True:
            if self.inside:
                end = self.held.find(CLOSE)
                if end < 0:
                    break
                call, written = self._call(self.held[:end]), self.gap + OPEN + self.held[:end + len(CLOSE)]
                if call is None:  # not a call after all: its text is content
                    content += written
                else:
                    self.calls.append(call)
                self.held, self.inside = self.held[end + len(CLOSE):], False
                continue
            start = self.held.find(OPEN)
            if start >= 0:  # the text before a block, less the whitespace right before it
                before = self.held[:start].rstrip()
                content += self._text(before)
                self.gap = self.held[len(before):start]
                self.held, self.inside = self.held[start + len(OPEN):], True
                continue
            # held back: what may begin the opening tag, and the whitespace before it
            sure = len(self.held[:len(self.held) - _tag_start(self.held)].rstrip())
            content += self._text(self.held[:sure])
            self.held = self.held[sure:]
            break
        return content, self.calls[first:]

    def flush(self) -> str:
        """The text held back at the end: a block cut short as written; trailing whitespace
        unless calls were read."""
        rest, self.held = (self.gap + OPEN if self.inside else "") + self.held, ""
        self.inside = False
        return rest.lstrip() if self.calls else rest

    def _text(self, text: str) -> str:
        """Text outside blocks: content, except whitespace between and after calls."""
        return "" if self.calls and not text.strip() else text

    def _call(self, body: str) -> dict | None:
        """OpenAI's call for a block's body, or None when it is not {"name", "arguments"}."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)
                and isinstance(value.get("arguments"), dict)):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": value["name"],
                             "arguments": json.dumps(value["arguments"], ensure_ascii=False)}}


def _tag_start(text: str) -> int:
    """Length of the longest end of `text` that begins the opening tag."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:k])), 0)


def delta_calls(calls: list[dict], first: int) -> list[dict]:
    """Calls as a stream's `delta.tool_calls`, numbered from `first`."""
    return [{"index": first + i, **call} for i, call in enumerate(calls)]
