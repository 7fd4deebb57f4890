"""TextStream: incremental text equals the whole decoding, stop strings cut it, tails are held back."""

from __future__ import annotations

import pytest

from kvlayer.engine.tokenizer import Tokenizer, byte_tokenizer
from kvlayer.serving.text import TextStream

TOK = Tokenizer(byte_tokenizer(), eos_token_id=257, bos_token_id=256)


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def stream(text: str, stop: tuple[str, ...] = (), step: int = 1) -> tuple[list[str], TextStream]:
    s = TextStream(TOK, stop)
    tokens = ids(text)
    pieces = [s.add(tokens[i:i + step]) for i in range(0, len(tokens), step)]
    pieces.append(s.finish())
    return pieces, s


@pytest.mark.parametrize("step", [1, 2, 3])
def test_pieces_add_up_to_the_decoding_and_never_split_a_character(step):
    text = "héllo wörld — ✓ 日本語 🙂!"
    pieces, s = stream(text, step=step)
    assert "".join(pieces) == text == s.text
    assert all("\ufffd" not in p for p in pieces)
    assert not s.stopped


def test_a_multi_byte_character_is_sent_once_whole():
    s = TextStream(TOK)
    smile = ids("🙂")  # four byte tokens
    assert [s.add([b]) for b in smile] == ["", "", "", "🙂"]


def test_a_stop_string_cuts_the_text_before_it_even_across_tokens():
    pieces, s = stream("one two STOP three", stop=("STOP",))
    assert s.stopped and s.text == "one two "
    assert "".join(pieces) == "one two "


def test_the_earliest_of_several_stop_strings_wins():
    _, s = stream("abc xyz def", stop=("def", "xyz"))
    assert s.text == "abc "


def test_a_tail_that_may_become_a_stop_string_is_held_back_then_released():
    s = TextStream(TOK, ("END",))
    assert s.add(ids("abcE")) == "abc"  # "E" may start "END"
    assert s.add(ids("N")) == ""
    assert s.add(ids("x")) == "ENx"  # it did not
    assert s.add(ids("EN")) == ""
    assert s.finish() == "EN"  # the request ended without the stop string
    assert s.text == "abcENxEN" and not s.stopped


def test_nothing_more_after_a_stop():
    s = TextStream(TOK, ("!",))
    assert s.add(ids("hi!")) == "hi"
    assert s.add(ids("more")) == "" and s.finish() == ""


def test_an_unfinished_character_at_the_end_is_released_as_the_replacement_character():
    s = TextStream(TOK)
    assert s.add(ids("a")) == "a"
    assert s.add(ids("é")[:1]) == ""
    assert s.finish() == "\ufffd"


def test_without_a_tokenizer_there_is_no_text_and_no_stop_strings():
    s = TextStream(None)
    assert s.add([1, 2, 3]) == "" and s.finish() == ""
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        TextStream(None, ("x",))
    with pytest.raises(ValueError, match="must not be empty"):
        TextStream(TOK, ("",))
