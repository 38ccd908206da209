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

Invariant: for text the tokenizer round-trips, the concatenation of all ``push`` and
``flush`` results equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

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


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas.

    ``push`` returns only complete characters; text ending in U+FFFD is held until a
    later token completes it or ``flush`` is called at the end of the sequence.
    """

    def __init__(
        self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool
    ) -> None:
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
        self._window.append(token_id)
        return self._advance(hold_incomplete=True)

    def flush(self) -> str:
        """Text still held at the end of the sequence, incomplete characters as U+FFFD."""
        if self._read_offset == len(self._window):
            return ""
        return self._advance(hold_incomplete=False)
