"""A request's reply: its choices' token events turned into one JSON response or a stream of
server-sent events (OpenAI's chunk shapes, `index` per choice, usage and metrics at the end)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from exactspec.serve.logprobs import Spelling, chat_logprobs, completion_logprobs
from exactspec.serve.protocol import ApiError, Params, speculative_metrics
from exactspec.serve.scheduler import Job
from exactspec.serve.text import TextStream
from exactspec.serve.tool_calls import ToolCallReader, delta_calls


class Choice:
    """One choice of a reply (one row, one `Job`): its text as it arrives, its tokens, finish
    reason and logprobs."""

    def __init__(self, state, params: Params, job: Job):
        self.state, self.job = state, job
        self.index = job.index
        self.text = TextStream(state.target.tokenizer, params.stop)
        self.spell = None if params.logprobs is None else Spelling(state.target.tokenizer)
        self.tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.offset = 0  # completions' text_offset of the next token
        self.parts: list[str] = []  # the whole (non-streamed) answer's text and logprobs
        self.chosen: list = []
        self.calls = ToolCallReader() if params.tools is not None and params.tools.calls else None

    def take(self, kind: str, event: list) -> tuple[str, list | None]:
        """(text delta, the round's TokenLogprobs or None) of one "tokens" or "done" event; a
        stop string cancels the row and ends the choice."""
        if kind == "done":
            self.finish_reason = event[0]
            return self.text.flush(), None
        ids, chosen = event
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            self.state.metrics.ttft.observe(self.first_token_at - self.job.created)
        self.tokens += len(ids)
        delta = self.text.push(ids)
        if self.text.stopped:
            self.state.scheduler.cancel(self.job)
            self.finish_reason = "stop"
        return delta, chosen

    def observe(self, params: Params) -> None:
        """The finished row in /metrics (each choice counts as a request there: its own prefill,
        tokens and finish reason)."""
        metrics = self.state.metrics
        metrics.observe_request(len(self.job.prompt), speculative_metrics(self.job.stats),
                                self.tokens, self.finish_reason, time.perf_counter() - self.job.created)
        if params.constraint is not None or params.tools is not None:
            kind = "tools" if params.constraint is None else params.constraint.kind
            metrics.constrained.labels(kind=kind).inc()


class Reply:
    """One request's answer: its n choices' texts as they arrive, usage and speculative metrics
    (summed over the choices) at the end."""

    def __init__(self, state, params: Params, jobs: list[Job], events: asyncio.Queue):
        self.state, self.params, self.events = state, params, events
        self.choices = [Choice(state, params, job) for job in jobs]
        self.id = ("chatcmpl-" if params.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _open(self) -> list[Job]:
        return [choice.job for choice in self.choices if choice.finish_reason is None]

    async def deltas(self):
        """(choice, text delta, its round's TokenLogprobs or None) as rounds finish, and (choice,
        None, None) once when a choice ends (its finish_reason then set), until all have ended.
        Raises ApiError(500) on an engine error. A round's logprobs come whole, with the text
        it released (held-back text comes later, its tokens' logprobs do not wait). Events of
        a choice that has ended (a stop string's cancellation, say) are dropped."""
        while self._open():
            index, kind, *event = await self.events.get()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if kind == "error":
                raise ApiError(500, event[0], type="server_error")
            delta, chosen = choice.take(kind, event)
            if delta or chosen:
                yield choice, delta, chosen
            if choice.finish_reason is not None:
                choice.observe(self.params)
                yield choice, None, None

    def usage(self) -> dict:
        """OpenAI's: the prompt counted once, the completion tokens of all choices."""
        prompt = len(self.choices[0].job.prompt)
        tokens = sum(choice.tokens for choice in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}

    def metrics(self) -> dict:
        return {"speculative_decoding": speculative_metrics(*(c.job.stats for c in self.choices))}

    def _head(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.params.kind == "chat" else "text_completion"
        return {"id": self.id, "object": kind + (".chunk" if chunk and self.params.kind == "chat" else ""),
                "created": self.created, "model": self.state.model_name}

    def _logprobs(self, choice: Choice, chosen) -> dict | None:
        if choice.spell is None or chosen is None:
            return None
        if self.params.kind == "chat":
            return chat_logprobs(choice.spell, chosen)
        out = completion_logprobs(choice.spell, chosen, choice.offset)
        choice.offset += sum(len(token) for token in out["tokens"])
        return out

    def _choice(self, choice: Choice, text: str | None, finish, chunk: bool, first: bool = False,
                chosen=None) -> dict:
        logprobs, index = self._logprobs(choice, chosen), choice.index
        if self.params.kind == "completions":
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        fields = {"role": "assistant", "content": text or ""} if first else _fields(choice, text, chunk)
        if choice.calls is not None and choice.calls.calls and finish == "stop":
            finish = "tool_calls"  # the reply ended after its calls
        if not chunk:
            return {"index": index, "message": {"role": "assistant", **fields},
                    "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "delta": fields, "logprobs": logprobs, "finish_reason": finish}

    async def whole(self, request: Request) -> JSONResponse:
        """The non-streamed answer; a client that goes away cancels all its rows."""
        collector = asyncio.ensure_future(self._collect())
        while not collector.done():
            await asyncio.wait([collector], timeout=0.5)
            if not collector.done() and await request.is_disconnected():
                collector.cancel()
                self.state.scheduler.cancel(*self._open())
                return JSONResponse({}, status_code=499)
        collector.result()
        choices = [self._choice(c, "".join(c.parts), c.finish_reason, False,
                                chosen=c.chosen if c.spell is not None else None)
                   for c in self.choices]
        body = {**self._head(False), "choices": choices, "usage": self.usage(),
                "metrics": self.metrics()}
        return JSONResponse(body)

    async def _collect(self) -> None:
        async for choice, delta, logprobs in self.deltas():
            if delta is not None:
                choice.parts.append(delta)
                choice.chosen.extend(logprobs or ())

    async def stream(self):
        """Server-sent events in OpenAI's chunk format, each chunk one choice's (its `index`);
        a choice's finish chunk when it ends; `data: [DONE]` once all have ended."""
        try:
            if self.params.kind == "chat":  # each choice's first delta carries the role
                for choice in self.choices:
                    yield _sse({**self._head(True), "choices": [self._choice(choice, "", None, True,
                                                                            first=True)]})
            try:
                async for choice, delta, chosen in self.deltas():
                    if delta is None:  # the choice ended
                        piece = self._choice(choice, None, choice.finish_reason, True)
                    else:
                        piece = self._choice(choice, delta, None, True, chosen=chosen)
                        if piece.get("delta") == {} and not piece["logprobs"]:
                            continue  # held back: the start of a tool call
                    yield _sse({**self._head(True), "choices": [piece]})
            except ApiError as err:
                yield _sse(err.body())
                yield "data: [DONE]\n\n"
                return
            if self.params.include_usage:
                yield _sse({**self._head(True), "choices": [], "usage": self.usage(),
                            "metrics": self.metrics()})
            yield "data: [DONE]\n\n"
        finally:
            if self._open():  # the client went away mid-stream: free its rows
                self.state.scheduler.cancel(*self._open())


def _fields(choice: Choice, text: str | None, chunk: bool) -> dict:
    """A chat chunk's delta (chunk) or the whole reply's message fields: the text, read for tool
    calls when the request may call them (`serve.tool_calls`; text None: the end)."""
    if choice.calls is None:
        return {"content": text} if text or not chunk else {}
    content, calls = choice.calls.push(text or "")
    if text is None or not chunk:
        content += choice.calls.flush()
    if not chunk:
        return {"content": content or None, "tool_calls": calls} if calls else {"content": content}
    first = len(choice.calls.calls) - len(calls)
    return {**({"content": content} if content else {}),
            **({"tool_calls": delta_calls(calls, first)} if calls else {})}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
