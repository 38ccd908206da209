"""Token ids to text, one token at a time, never splitting a character.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a
prefix gives a trailing U+FFFD. The detokenizer holds that text back until the character
completes (or ``flush`` gives up on it), so every piece it returns is final.

The prefix/read offset technique (TGI, vLLM) keeps each step O(1) in sequence length::

    ids:  ... | prefix_offset ......... read_offset ......... | end
                <- already emitted ->   <- not yet emitted ->

Each push decodes only the window from ``prefix_offset``: the text the window adds past
the decoding of ``[prefix_offset, read_offset)`` is new. The emitted tokens still in the
window give the tokenizer the context it needs for spacing (SentencePiece drops a leading
space when a token is decoded alone).

A byte-level BPE (GPT-2's ``ByteLevel`` decoder, no clean-up: SmolLM2, Llama 3, Qwen)
decodes ids to the concatenation of their tokens' bytes read as UTF-8, with no context
at all; for such a tokenizer each push instead looks up the token's bytes
(``token_bytes``) and feeds them to an incremental UTF-8 decoder, which holds back only
the bytes of a character not yet complete (0.2 us a token against ~2.5 for the two
decodes of the window). Where no character is begun and the token's bytes are whole
UTF-8 (most tokens), the push is the token's text, looked up (``token_texts``): the
decoder would give the same, through a Python-level call that cost a 64-sequence step
~0.1 ms with its code out of the caches after the forward.

Invariant: for text the tokenizer round-trips, the concatenation of all ``push`` and
``flush`` results equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import tokenizers.decoders  # transformers' own dependency

#: What decoding an incomplete UTF-8 sequence yields.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens (vLLM uses 5).
_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def raw_decoder(tokenizer: Decoder) -> Callable[..., str]:
    """``tokenizer.decode``, or the Rust tokenizer's own ``decode`` where transformers'
    adds nothing to it (a fast tokenizer that does not clean up spaces): the same text
    in a third of the time (~0.9 against ~3 us a call; two calls a token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def _byte_of_char() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted: the byte each character of a
    byte-level vocabulary stands for. Printable Latin-1 bytes spell themselves; the
    others, in order, take the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    code = {byte: byte for byte in printable}
    for byte in range(256):
        if byte not in code:
            code[byte] = 0x100 + len(code) - len(printable)
    return {chr(c): byte for byte, c in code.items()}


# Per tokenizer: (bytes of each id, the same with special tokens as b"", and the texts of
# both: ``token_texts``), or None where decoding is not byte concatenation. Weak keys: a
# table lives as long as its tokenizer.
_Tables = tuple[list[bytes], list[bytes], list[str | None], list[str | None]]
_TOKEN_BYTES: weakref.WeakKeyDictionary[Any, _Tables | None] = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Decoder, skip_special_tokens: bool) -> list[bytes] | None:
    """Each token id's bytes (``b""`` for one ``skip_special_tokens`` drops) where the
    tokenizer decodes any ids to their bytes' concatenation read as UTF-8 (lossy), else
    None. Built once per tokenizer (~70 ms) and checked id by id against its own decode:
    any id whose single decode differs leaves the tokenizer on the window path, and so
    does a tokenizer that cannot be weakly referenced (where it could not be kept)."""
    tables = _tables(tokenizer)
    if tables is None:
        return None
    return tables[1] if skip_special_tokens else tables[0]


def token_texts(tokenizer: Decoder, skip_special_tokens: bool) -> list[str | None] | None:
    """Beside ``token_bytes`` (None where it is): each id's bytes read as UTF-8, where
    they are whole UTF-8 on their own (what an incremental decoder with no character
    begun gives for them), else None."""
    tables = _tables(tokenizer)
    if tables is None:
        return None
    return tables[3] if skip_special_tokens else tables[2]


def _tables(tokenizer: Decoder) -> _Tables | None:
    try:
        tables = _TOKEN_BYTES[tokenizer]
    except KeyError:
        tables = _TOKEN_BYTES[tokenizer] = _build_token_bytes(tokenizer)
    except TypeError:  # not weakly referenceable: no table rather than one per request
        return None
    return tables


def _whole_text(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _build_token_bytes(tokenizer: Decoder) -> _Tables | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or getattr(tokenizer, "clean_up_tokenization_spaces", True) is not False
        or not isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
    ):
        return None
    byte_of = _byte_of_char()
    vocab = backend.get_vocab(with_added_tokens=True)
    kept = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, token_id in vocab.items():
        # the decoder passes a character outside the byte alphabet through as UTF-8
        kept[token_id] = b"".join(
            bytes((byte_of[c],)) if c in byte_of else c.encode() for c in token
        )
    skipped = list(kept)
    for token_id, data in enumerate(kept):
        text = data.decode("utf-8", "replace")
        if backend.decode([token_id], skip_special_tokens=False) != text:
            return None
        skipped_text = backend.decode([token_id], skip_special_tokens=True)
        if skipped_text != text:
            if skipped_text:
                return None
            skipped[token_id] = b""
    texts = [_whole_text(data) for data in kept]
    skipped_texts = [text if data else "" for text, data in zip(texts, skipped, strict=True)]
    return kept, skipped, texts, skipped_texts


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    ``push`` returns only complete characters: the bytes of a character not yet complete
    (the byte path), or text ending in U+FFFD (the window path), are held until a later
    token completes it or ``flush`` ends the sequence. Bytes that can begin no character
    come out as U+FFFD at once on the byte path, one token later on the window path; the
    text in all is the same.
    """

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
        self._bytes = token_bytes(tokenizer, skip_special_tokens)
        if self._bytes is not None:
            self._texts = token_texts(tokenizer, skip_special_tokens)
            self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            return
        self._decoder = raw_decoder(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # The window holds ids from prefix_offset on; older ids are dropped, as no
        # decode looks at them again.
        self._window: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)  # window index of the first unemitted id

    def _decode(self, token_ids: list[int]) -> str:
        return self._decoder(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, *, hold_incomplete: bool) -> str:
        prefix_text = self._decode(self._window[: self._read_offset])
        new_text = self._decode(self._window)
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token: nothing to show yet
        if hold_incomplete and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # the last character's bytes are not all here yet
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        return new_text[len(prefix_text) :]

    def push(self, token_id: int) -> str:
        """Add one output token; return the text it completes (often "", never half a char)."""
        if self._bytes is not None:
            # an id past the vocabulary decodes to nothing, as the tokenizer's decode
            if token_id >= len(self._bytes):
                return self._utf8.decode(b"")
            if not self._utf8.buffer:  # no character begun: a whole token's text as it is
                text = self._texts[token_id]
                if text is not None:
                    return text
            return self._utf8.decode(self._bytes[token_id])
        self._window.append(token_id)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Text still held at the end of the sequence, incomplete characters as U+FFFD."""
        if self._bytes is not None:
            return self._utf8.decode(b"", final=True)
        if self._read_offset == len(self._window):
            return ""
        return self._advance(hold_incomplete=False)
