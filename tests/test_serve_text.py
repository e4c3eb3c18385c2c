"""Incremental detokenization and stop strings of the server's streams."""
from exactspec.serve.text import TextStream


class ByteTokenizer:
    """Each id is one byte: a multi-byte character spans several tokens (as in byte-level BPE)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def pieces(stream, ids, step=1):
    out = [stream.push(ids[i: i + step]) for i in range(0, len(ids), step)]
    return out + [stream.flush()]


def test_multibyte_characters_are_never_split():
    text = "añ€😀b"
    ids = list(text.encode())
    out = pieces(TextStream(ByteTokenizer()), ids)
    assert "".join(out) == text
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_across_chunks_is_found_and_not_sent():
    ids = list("hello STOP world".encode())
    for step in (1, 2, 3, 7):
        stream = TextStream(ByteTokenizer(), ["STOP", "zzz"])
        assert "".join(pieces(stream, ids, step)) == "hello "
        assert stream.stopped


def test_text_that_only_looks_like_a_stop_is_released():
    stream = TextStream(ByteTokenizer(), ["STOP"])
    assert "".join(pieces(stream, list("a STO b ST".encode()), 1)) == "a STO b ST"
    assert not stream.stopped
