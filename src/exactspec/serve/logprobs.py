"""OpenAI's logprobs shapes, from the engine's `TokenLogprob`s (`exactspec.logprobs`).

Chat: `choices[i].logprobs = {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}]}`. Completions: `choices[i].logprobs = {tokens, token_logprobs, top_logprobs: [{token:
logprob}], text_offset}`. A token's text is what it adds to the reply's text (`Spelling`);
`bytes` its UTF-8 bytes. JSON has no −inf: a log-probability of −inf (a token the settings exclude, in the
"processed" mode only) is sent as −9999.0, as vLLM does.
"""
from __future__ import annotations

import math

FLOOR = -9999.0  # what −inf is sent as


def _value(logprob: float) -> float:
    return FLOOR if math.isinf(logprob) and logprob < 0 else max(logprob, FLOOR)


class Spelling:
    """Token texts of one reply. A token's text is what it adds to the reply's text after the
    tokens before it (the decoding of a window of them with and without it, as `TextStream`
    does), so the chosen tokens' texts join into the reply's text; an alternative's is what it
    would have added in the chosen token's place."""

    WINDOW = 4  # tokens of context before each

    def __init__(self, tokenizer):
        self.tokenizer, self.ids = tokenizer, []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _added(self, window: list[int], base: str, token: int) -> str:
        text = self._decode(window + [token])
        return text[len(base):] if text.startswith(base) else self._decode([token])

    def _entry(self, window: list[int], base: str, token: int, logprob: float) -> dict:
        text = self._added(window, base, token)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}

    def spell(self, logprobs) -> list[tuple[dict, list[dict]]]:
        """(chosen entry, alternatives' entries) of each TokenLogprob, in order; the reply's
        tokens grow by them."""
        out = []
        for t in logprobs:
            window = self.ids[-self.WINDOW:]
            base = self._decode(window)
            out.append((self._entry(window, base, t.token, t.logprob),
                        [self._entry(window, base, i, v) for i, v in t.top]))
            self.ids.append(t.token)
        return out


def chat_logprobs(spelling: Spelling, logprobs) -> dict:
    """Chat's `logprobs` object of these tokens."""
    return {"content": [{**entry, "top_logprobs": top} for entry, top in spelling.spell(logprobs)],
            "refusal": None}


def completion_logprobs(spelling: Spelling, logprobs, offset: int) -> dict:
    """Completions' `logprobs` object of these tokens, the first at character `offset` of the
    completion's text."""
    spelled = spelling.spell(logprobs)
    tokens = [entry["token"] for entry, _ in spelled]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [entry["logprob"] for entry, _ in spelled],
            "top_logprobs": [{e["token"]: e["logprob"] for e in top} for _, top in spelled],
            "text_offset": offsets}
