"""StopText: incremental detokenization and stop strings, against whole-sequence decoding."""

import pytest

from spd.serve.text import StopText


class ByteTokenizer:
    """Token id = one UTF-8 byte, so a multi-byte character spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def run(text: str, stop=()) -> tuple[list[str], StopText]:
    out = StopText(ByteTokenizer(), list(stop))
    pieces = []
    for token in text.encode():
        pieces.append(out.add(token))
        if out.stopped:
            break
    pieces.append(out.finish())
    return pieces, out


def test_pieces_join_to_the_whole_decode_and_never_split_a_character():
    text = "naïve café — 日本語 ok"
    pieces, _ = run(text)
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("stop, want", [
    (["café"], "naïve "),
    (["zzz", "日本"], "naïve café — "),
    (["nothing"], "naïve café — 日本語 ok"),
])
def test_stop_strings_cut_the_text_before_the_first_match(stop, want):
    pieces, out = run("naïve café — 日本語 ok", stop)
    assert "".join(pieces) == want
    assert out.stopped == (want != "naïve café — 日本語 ok")


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    out = StopText(ByteTokenizer(), ["abc"])
    released = [out.add(t) for t in b"xab"]
    assert "".join(released) == "x"       # "ab" could still become "abc"
    assert out.add(ord("d")) == "abd"     # "abd": it did not
    assert out.add(ord("a")) == ""        # "a" might
    assert out.finish() == "a"


def test_generation_stops_at_the_token_that_completes_the_stop_string():
    pieces, out = run("one two three four", ["three"])
    assert "".join(pieces) == "one two "
    assert bytes(out.tokens).decode() == "one two three"
