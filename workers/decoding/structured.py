"""Structured outputs: grammars from llguidance, and the token masks they give.

Why llguidance (not xgrammar): both build a grammar from a JSON schema, a regex or an
EBNF/Lark grammar and compute a next-token mask; llguidance has no dependencies (its
wheel is one native library, where xgrammar pulls in triton and a TVM runtime), rolls a
matcher back by any number of tokens, and computes SmolLM2's 49,152-token mask in about
20 us per step on this project's 2-core CPU (measured: median over a JSON object's 24
tokens; the first mask of a grammar, which builds its lexer, ~2 ms).

A ``Grammars`` object per engine wraps the tokenizer once (~0.3 s, most of it holding
the GIL: a serving worker does it at start, ``prepare``; an engine in a script on its
first structured request) and compiles each (kind, spec) once (cached, and so is a refusal:
the same bad grammar sent again is refused from the cache, not compiled again; a large
one can take seconds). The front ends bound a grammar's size before they compile it,
and compile it off their event loop. Each sequence owns
an ``LLMatcher`` (``AsyncEngine`` builds it beside the step loop: a large grammar's
takes tens of milliseconds): forks (n > 1) take a copy, a resumed request (failover) replays the
tokens it had sent, and preemption by recompute keeps it (no token is sampled again).
"""

from __future__ import annotations

# Light at import (no torch, no llguidance): the front ends check grammars with it.
import collections
import json
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tessera.workers.api import InvalidRequestError, StructuredParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: llguidance's name of each kind's grammar format.
_FORMATS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def grammar_text(params: StructuredParams) -> str:
    """The llguidance grammar of ``params``; ``InvalidRequestError`` naming
    ``structured.spec`` when it does not parse."""
    import llguidance

    try:
        if params.kind == "choice":
            choices = json.loads(params.spec)
            if not (
                isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)
            ):
                raise ValueError("a choice must be a non-empty JSON list of strings")
        spec = params.spec
        if params.kind == "json":
            spec = _compact(spec)
        grammar = llguidance.grammar_from(_FORMATS[params.kind], spec)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(
            "structured.spec", f"is not a valid {params.kind}: {error}"
        ) from None
    except RecursionError:  # JSON nested past the parser's depth
        raise InvalidRequestError(
            "structured.spec", f"is not a valid {params.kind}: nested too deeply"
        ) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise InvalidRequestError(
            "structured.spec", f"is not a valid {params.kind}: {'; '.join(messages)}"
        )
    return grammar


#: JSON is written with single spaces after ":" and ",": the grammar's whitespace is not
#: free (a model sampling at temperature 1 may otherwise emit newlines to the end). A
#: schema's own ``x-guidance`` options win.
COMPACT_JSON = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def _compact(spec: str) -> str:
    schema = json.loads(spec)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {**schema, "x-guidance": COMPACT_JSON}
    return json.dumps(schema)


def check(params: StructuredParams) -> None:
    """Raise ``InvalidRequestError`` if the grammar does not compile (front ends check
    it before placing a request, to name their own field)."""
    _cached_grammar(params.kind, params.spec)


def embedded(params: StructuredParams) -> str:
    """``params``' grammar as a Lark expression another Lark grammar can hold
    (``%json {...}`` or a nested ``%lark {...}``): a grammar for the answer that follows
    a reasoning model's free reasoning."""
    grammar = _cached_grammar(params.kind, params.spec)
    if not grammar.lstrip().startswith("{"):  # Lark text
        return "%lark {\n" + grammar + "\n}"
    (part,) = json.loads(grammar)["grammars"]
    if part.get("json_schema") is not None:
        return "%json " + json.dumps(part["json_schema"])
    return "%lark {\n" + part["lark_grammar"] + "\n}"


def _cached_grammar(kind: str, spec: str) -> str:
    compiled = _compiled(kind, spec)
    if isinstance(compiled, InvalidRequestError):
        raise InvalidRequestError(compiled.field, compiled.message)
    return compiled


#: The most characters of specs and grammars the compiled-grammar cache holds (the
#: least recently used go first): at the front end's 128 KiB a grammar, ~64 of the largest.
GRAMMAR_CACHE_CHARS = 16 * 2**20
_grammars: collections.OrderedDict[tuple[str, str], str | InvalidRequestError] = (
    collections.OrderedDict()
)
_grammars_lock = threading.Lock()
_held = [0]  # the characters _grammars holds


def _compiled(kind: str, spec: str) -> str | InvalidRequestError:
    """The grammar, or why it was refused: both cached, bounded by their characters
    (``GRAMMAR_CACHE_CHARS``), not by their count. Compiled outside the lock: two
    threads may compile one spec at once, and both answers are the same."""
    key = (kind, spec)
    with _grammars_lock:
        if (found := _grammars.get(key)) is not None:
            _grammars.move_to_end(key)
            return found
    try:
        compiled: str | InvalidRequestError = grammar_text(StructuredParams(kind, spec))
    except InvalidRequestError as error:
        compiled = error
    with _grammars_lock:
        if key not in _grammars:
            _grammars[key] = compiled
            _held[0] += _chars((key, compiled))
        while _held[0] > GRAMMAR_CACHE_CHARS and len(_grammars) > 1:
            _held[0] -= _chars(_grammars.popitem(last=False))
    return compiled


def _chars(item: tuple[tuple[str, str], str | InvalidRequestError]) -> int:
    (kind, spec), compiled = item
    size = len(compiled) if isinstance(compiled, str) else len(compiled.message)
    return len(kind) + len(spec) + size


class Grammars:
    """One engine's grammar compiler and mask builder (over its tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer = None
        self._refusal: str | None = None  # why llguidance cannot take the tokenizer
        self._wrapping = threading.Lock()  # matchers are built on several threads

    @property
    def tokenizer(self):
        """llguidance's wrapped tokenizer; ``InvalidRequestError`` naming ``structured``
        where llguidance cannot take it (decided once, and the refusal kept)."""
        with self._wrapping:
            if self._tokenizer is None and self._refusal is None:
                self._tokenizer, self._refusal = self._wrap()
            if self._refusal is not None:
                raise InvalidRequestError("structured", self._refusal)
            return self._tokenizer

    def prepare(self) -> None:
        """Wrap the tokenizer now: ~0.3 s, most of it holding the GIL, which a serving
        worker pays at start rather than in the steps beside its first structured
        request. A tokenizer llguidance cannot take is logged here, and refused per
        request with the same message."""
        try:
            self.tokenizer  # noqa: B018 - built and kept
        except InvalidRequestError as error:
            logger.warning("%s", error.message)

    def _wrap(self):
        """(the wrapped tokenizer, None), or (None, why llguidance cannot take it)."""
        import llguidance.hf

        unavailable = "structured outputs are unavailable on this server: llguidance "
        try:
            wrapped = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )
        except ValueError as error:  # e.g. a model's vocabulary smaller than its tokenizer's
            return None, f"{unavailable}cannot wrap its tokenizer: {error}"
        probe = 'A "quoted" word, 42: ok.'
        ids = self._hf_tokenizer(probe, add_special_tokens=False).input_ids
        if wrapped.decode_bytes(ids) != probe.encode():
            # Seen with transformers 5.17's GGUF tokenizers: no byte-level decoding,
            # so llguidance would match grammars against the wrong bytes.
            return None, (
                f"{unavailable}cannot read its tokenizer's bytes "
                "(transformers >= 5.24 converts it right)"
            )
        return wrapped, None

    def matcher(self, params: StructuredParams, replay: Sequence[int] = ()):
        """A matcher at the grammar's start, advanced over ``replay`` (the tokens a
        resumed request already has); ``InvalidRequestError`` if they break it."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, _cached_grammar(params.kind, params.spec))
        if matcher.is_error():
            raise InvalidRequestError("structured.spec", matcher.get_error())
        if replay and not matcher.consume_tokens(list(replay)):
            raise InvalidRequestError(
                "structured", f"the resumed tokens do not follow the grammar: {matcher.get_error()}"
            )
        return matcher

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence) -> None:
        """Set to -inf, in ``logits`` [B, V] rows ``rows``, every token each row's
        matcher does not allow next."""
        import torch

        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        for i, matcher in enumerate(matchers):
            row = bitmask[i]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if matcher.is_error():  # e.g. a parser limit: end the output (EOS only)
                logger.warning("grammar failed, ending the output: %s", matcher.get_error())
                row.zero_()
                for eos in self.eos_token_ids:
                    row[eos // 32] |= 1 << (eos % 32) if eos % 32 < 31 else -(1 << 31)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, : logits.shape[1]]
        refused = allowed.to(device=logits.device, dtype=torch.bool).logical_not_()
        if list(rows) == list(range(logits.shape[0])):
            logits.masked_fill_(refused, -torch.inf)  # every row: in place
            return
        index = torch.tensor(list(rows), device=logits.device)
        logits[index] = logits[index].masked_fill(refused, -torch.inf)
