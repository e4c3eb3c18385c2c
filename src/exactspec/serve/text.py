"""Token ids → text, incrementally: what a stream may send now, and where a stop string ends it.

Decoding each new token alone would split multi-byte characters (byte-level BPE) and tokens
whose text depends on their neighbours; decoding everything each time costs O(n²). As vLLM and
TGI do, a window from `prefix` decodes the last committed tokens with and without the new ones,
and the difference is the new text — held back while it ends in U+FFFD (an unfinished character).

Stop strings: text that could be the start of a stop string is held back until it is known not
to be one, so a stop string split across rounds (or chunks) is still found and never sent.
"""
from __future__ import annotations


class TextStream:
    """Feed token ids with `push`; it returns the text that may be sent, and sets `stopped`."""

    def __init__(self, tokenizer, stops: list[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0  # the decoding window: ids[prefix:read] is already text
        self.text = ""  # all text decoded so far
        self.sent = 0  # characters of `text` already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send ('' if none, or after a stop)."""
        if self.stopped:
            return ""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix: self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The generation ended: whatever is held back is sent."""
        return "" if self.stopped else self._release(final=True)

    def _release(self, final: bool) -> str:
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held()
        out = self.text[self.sent: max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def _held(self) -> int:
        """Length of the longest end of the text that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
