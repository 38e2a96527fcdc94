from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.tiny import tiny_tokenizer

TOK = tiny_tokenizer()


def _run(text: str, chunk: int, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    ids = list(text.encode("utf-8"))
    detok = IncrementalDetokenizer(TOK, stop)
    pieces = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    pieces.append(detok.finish())
    return pieces, detok


def test_multibyte_characters_split_across_tokens_are_held_back():
    detok = IncrementalDetokenizer(TOK)
    euro = "€".encode()  # 3 bytes
    assert detok.add([ord("a"), euro[0]]) == ""  # "a" waits with the incomplete character
    assert detok.add([euro[1]]) == ""
    assert detok.add([euro[2], ord("b")]) == "a€b"
    assert detok.finish() == ""


def test_incomplete_tail_is_flushed_on_finish():
    detok = IncrementalDetokenizer(TOK)
    assert detok.add([ord("x"), 0xF0, 0x9F]) == ""
    assert detok.finish() == "x\ufffd"  # as a full decode shows it


def test_special_tokens_are_invisible():
    detok = IncrementalDetokenizer(TOK, prompt_token_ids=[256, 104, 105])
    assert detok.add([ord("o"), ord("k"), 257]) == "ok"
    assert detok.finish() == ""


def test_stop_string_prefix_is_held_back_then_released():
    detok = IncrementalDetokenizer(TOK, stop=["STOP"])
    assert detok.add(list(b"abc ST")) == "abc "
    assert detok.add(list(b"O")) == ""
    assert detok.add(list(b"x")) == "STOx"  # not a stop after all
    assert not detok.stopped


def test_stop_string_across_deltas_truncates():
    detok = IncrementalDetokenizer(TOK, stop=["STOP", "zz"])
    assert detok.add(list(b"abc ST")) == "abc "
    assert detok.add(list(b"OP and more")) == ""
    assert detok.stopped
    assert detok.add(list(b"ignored")) == ""
    assert detok.finish() == ""
    assert detok.output_text() == "abc "


def test_earliest_stop_wins_and_finish_flushes_a_partial_stop():
    pieces, detok = _run("one two three", 2, stop=["three", "two"])
    assert "".join(pieces) == "one " and detok.stopped
    pieces, detok = _run("end with S", 3, stop=["STOP"])
    assert "".join(pieces) == "end with S" and not detok.stopped


def test_multibyte_stop_string():
    pieces, _ = _run("prix: 5€ ou 6€", 1, stop=["€ ou"])
    assert "".join(pieces) == "prix: 5"


def _streamed_cut(text: str, chunk: int, stop) -> str:
    """What a stream must show: generation stops at the first delta after which the complete
    characters received so far contain a stop string, and the text is cut at the earliest
    stop in them (a later stop that would have started earlier never arrives)."""
    data = text.encode("utf-8")
    for end in range(chunk, len(data) + chunk, chunk):
        seen = data[:end].decode("utf-8", errors="ignore")  # an incomplete tail is not text yet
        hits = [seen.find(s) for s in stop if s in seen]
        if hits:
            return seen[: min(hits)]
    return text


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from("ab €😀\né"), max_size=40),
    chunk=st.integers(1, 5),
    stop=st.lists(st.text(alphabet=st.sampled_from("ab€😀"), min_size=1, max_size=3), max_size=2),
)
def test_concatenation_equals_full_decode_cut_at_stop(text, chunk, stop):
    pieces, _ = _run(text, chunk, stop)
    assert "".join(pieces) == _streamed_cut(text, chunk, stop)
    assert all("\ufffd" not in p for p in pieces)
    # nothing that might become a stop string was shown before it was settled
    expected = _streamed_cut(text, chunk, stop)
    shown = ""
    for p in pieces[:-1]:
        shown += p
        assert expected.startswith(shown)
