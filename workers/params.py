"""What a request asks of the sampler: ``SamplingParams`` and the settings it holds
(structured outputs, speculative decoding, parallel tokens), each validated at
construction, with the limits they are checked against.

``tessera.workers.api`` re-exports these: callers import them from there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The most top-N logprobs a request may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20
#: The most sequences one request may fork into (n, best_of, beam_width).
MAX_WIDTH = 64
#: The most stop strings one request may give (OpenAI allows 4; vLLM has no limit).
MAX_STOP = 16
#: The longest stop string (vLLM has no limit): the matcher's work at a mismatch grows
#: with the square of it (1.4 ms for 16 stops of this length, on the engine thread).
MAX_STOP_CHARS = 1024
#: The most stop token ids one request may give (vLLM has no limit).
MAX_STOP_TOKEN_IDS = 1024
#: ``logit_bias``: at most this many tokens, each biased within +-LOGIT_BIAS_LIMIT (OpenAI's).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0
EARLY_STOPPING_VALUES = (True, False, "never")
#: Proposers of draft tokens: prompt lookup (n-gram) and a draft model.
SPECULATIVE_METHODS = ("ngram", "draft")
#: The most draft tokens one verification step may check.
MAX_SPECULATIVE_TOKENS = 16
#: How the tokens of one parallel set see each other.
PARALLEL_MODES = ("isolated", "visible")
#: The most tokens one parallel set may hold.
MAX_PARALLEL_WIDTH = 16
#: Seeds are in [0, SEED_MODULUS); a fork's seed wraps around it.
SEED_MODULUS = 2**63


#: What a structured output may follow: a JSON schema (JSON text), a regular
#: expression, one of a list of strings (a JSON list) or a Lark / GBNF grammar.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar")


class InvalidRequestError(ValueError):
    """A request parameter is out of range. ``field`` names the parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self):  # pickles whole across Ray (the default passes only args)
        return type(self), (self.field, self.message)


@dataclass(frozen=True, slots=True)
class StructuredParams:
    """Constrain the output to ``spec``, a ``kind`` of ``STRUCTURED_KINDS``: every token
    is sampled from those the grammar allows next (llguidance computes the mask), and
    EOS only once the grammar is complete."""

    kind: str
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError(
                "structured.kind",
                f"must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}",
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidRequestError(
                "structured.spec", f"must be a non-empty string, got {self.spec!r}"
            )


def fork_seed(seed: int, index: int) -> int:
    """The seed of output ``index`` of a request that samples with ``seed`` (n > 1,
    best_of): the engine's forks and the cluster client's failover both use it, so a
    resumed output samples exactly what its fork did."""
    return (seed + index) % SEED_MODULUS


def _check_number(name: str, value: object, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        kind = "an integer" if integer else "a number"
        raise InvalidRequestError(name, f"must be {kind}, got {value!r}")
    if not integer and math.isnan(value):
        raise InvalidRequestError(name, "must not be NaN")


@dataclass(frozen=True, slots=True)
class SpeculativeParams:
    """Speculative decoding for one request: ``method`` proposes up to ``num_tokens``
    draft tokens per step and the target verifies them all in one forward pass.

    ``ngram`` (prompt lookup) proposes what followed the latest earlier occurrence of
    the last few tokens; ``draft`` runs the worker's draft model. With ``adaptive`` the
    number proposed follows the request's recent acceptance rate, between the worker's
    ``speculative_min_tokens`` and ``num_tokens``. ``num_tokens=0`` turns speculation off
    for the request (also when the worker speculates by default). Greedy output equals
    non-speculative output; sampled output has the target's distribution.
    """

    method: str = "ngram"
    num_tokens: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(
                "speculative.method",
                f"must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}",
            )
        _check_number("speculative.num_tokens", self.num_tokens, integer=True)
        if not 0 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                "speculative.num_tokens",
                f"must be in [0, {MAX_SPECULATIVE_TOKENS}], got {self.num_tokens}",
            )
        if not isinstance(self.adaptive, bool):
            raise InvalidRequestError(
                "speculative.adaptive", f"must be true or false, got {self.adaptive!r}"
            )


@dataclass(frozen=True, slots=True)
class ParallelTokensParams:
    """Parallel tokens (TEMPO): at each step, the sampled token and every other token
    whose probability reaches ``threshold`` (up to ``max_width`` in all) are appended
    together at one shared position. ``isolated``: each sees the context and itself;
    ``visible``: each also sees the rest of its set. The next step samples from the
    mean of the members' next-token distributions.
    """

    threshold: float = 0.1
    max_width: int = 4
    mode: str = "isolated"

    def __post_init__(self) -> None:
        _check_number("parallel_tokens.threshold", self.threshold)
        if not 0.0 < self.threshold <= 1.0:
            raise InvalidRequestError(
                "parallel_tokens.threshold", f"must be in (0, 1], got {self.threshold}"
            )
        _check_number("parallel_tokens.max_width", self.max_width, integer=True)
        if not 1 <= self.max_width <= MAX_PARALLEL_WIDTH:
            raise InvalidRequestError(
                "parallel_tokens.max_width",
                f"must be in [1, {MAX_PARALLEL_WIDTH}], got {self.max_width}",
            )
        if self.mode not in PARALLEL_MODES:
            raise InvalidRequestError(
                "parallel_tokens.mode",
                f"must be one of {', '.join(PARALLEL_MODES)}, got {self.mode!r}",
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` of -1 or 0 disables top-k. With no
    ``seed`` the engine draws one, so every request's randomness is keyed by
    (seed, token index) and reproducible across batch mixes, preemption and failover.

    ``n > 1`` returns n samples of one prompt, computed once and forked (the children
    share its KV blocks). Child ``i`` samples with seed ``seed + i`` (mod 2**63), so it
    gives exactly what a lone request with that seed gives. ``best_of`` samples that
    many and returns the ``n`` with the highest cumulative logprob (at the end, not
    streamed).

    ``beam_width > 1`` runs beam search in the engine, as ``transformers``'
    ``generate(num_beams=beam_width, num_return_sequences=n, length_penalty=...,
    early_stopping=...)`` does; it returns the ``n`` best beams with their scores at
    the end. It is deterministic: temperature, top-p/k, min-p and seed do not apply,
    and stop strings, penalties and logprobs are refused with it.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's logprob and this many top ones
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to its logit
    skip_special_tokens: bool = True
    n: int = 1
    best_of: int | None = None
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    speculative: SpeculativeParams | None = None  # None: the worker's default
    parallel_tokens: ParallelTokensParams | None = None
    structured: StructuredParams | None = None  # structured outputs (a grammar)

    def __post_init__(self) -> None:
        _check_number("max_tokens", self.max_tokens, integer=True)
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check_number("min_tokens", self.min_tokens, integer=True)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        _check_number("temperature", self.temperature)
        if not 0.0 <= self.temperature <= 100.0 or math.isinf(self.temperature):
            raise InvalidRequestError(
                "temperature", f"must be between 0 and 100, got {self.temperature}"
            )
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_number("top_k", self.top_k, integer=True)
        if self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}"
            )
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_number("seed", self.seed, integer=True)
            if not 0 <= self.seed < 2**63:
                raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if not isinstance(self.stop, tuple | list):
            raise InvalidRequestError("stop", f"must be a tuple of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP:  # first: the checks below look at every string
            raise InvalidRequestError(
                "stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}"
            )
        if not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", f"must be a tuple of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        longest = max(map(len, self.stop), default=0)
        if longest > MAX_STOP_CHARS:
            raise InvalidRequestError(
                "stop", f"stop strings are at most {MAX_STOP_CHARS} characters, got {longest}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(self.stop_token_ids)}",
            )
        for token_id in self.stop_token_ids:
            _check_number("stop_token_ids", token_id, integer=True)
            if token_id < 0:
                raise InvalidRequestError(
                    "stop_token_ids", f"token ids must be >= 0, got {token_id}"
                )
        self._check_logit_bias()
        if self.prompt_logprobs is not None:
            _check_number("prompt_logprobs", self.prompt_logprobs, integer=True)
            if not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    "prompt_logprobs",
                    f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}",
                )
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, integer=True)
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    "logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
                )
        self._check_forks()
        self._check_multi_token()
        self._check_structured()

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}"
            )
        for pair in self.logit_bias:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise InvalidRequestError(
                    "logit_bias", f"must be (token id, bias) pairs, got {pair!r}"
                )
            token_id, bias = pair
            _check_number("logit_bias", token_id, integer=True)
            _check_number("logit_bias", bias)
            if token_id < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidRequestError(
                    "logit_bias",
                    f"token ids must be >= 0 and biases in [-{LOGIT_BIAS_LIMIT:g}, "
                    f"{LOGIT_BIAS_LIMIT:g}], got {token_id}: {bias}",
                )

    def _check_structured(self) -> None:
        if self.structured is None:
            return
        if not isinstance(self.structured, StructuredParams):
            raise InvalidRequestError(
                "structured", f"must be StructuredParams or None, got {self.structured!r}"
            )
        # speculative is accepted and does nothing here: drafts are not checked against
        # the grammar, so a structured request decodes one token a step
        for name, given in (
            ("beam_width", self.beam_width > 1),
            ("parallel_tokens", self.parallel_tokens is not None),
            ("ignore_eos", self.ignore_eos),
            ("min_tokens", self.min_tokens > 0),
        ):
            if given:
                raise InvalidRequestError(name, "is not supported with structured outputs")

    def _check_multi_token(self) -> None:
        for name, kind in (
            ("speculative", SpeculativeParams),
            ("parallel_tokens", ParallelTokensParams),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise InvalidRequestError(name, f"must be {kind.__name__} or None, got {value!r}")
        features = {"speculative": self.speculative, "parallel_tokens": self.parallel_tokens}
        for name, value in features.items():
            if value is None or (name == "speculative" and value.num_tokens == 0):
                continue
            for other, given in (
                ("beam_width", self.beam_width > 1),
                ("n", self.n > 1),
                ("best_of", (self.best_of or 1) > 1),
            ):
                if given:
                    raise InvalidRequestError(name, f"is not supported with {other} > 1")
        speculates = self.speculative is not None and self.speculative.num_tokens > 0
        if self.parallel_tokens is not None and speculates:
            raise InvalidRequestError(
                "parallel_tokens", "is not supported together with speculative"
            )

    def _check_forks(self) -> None:
        for name in ("n", "beam_width"):
            value = getattr(self, name)
            _check_number(name, value, integer=True)
            if not 1 <= value <= MAX_WIDTH:
                raise InvalidRequestError(name, f"must be in [1, {MAX_WIDTH}], got {value}")
        if self.best_of is not None:
            _check_number("best_of", self.best_of, integer=True)
            if not self.n <= self.best_of <= MAX_WIDTH:
                raise InvalidRequestError(
                    "best_of", f"must be in [n ({self.n}), {MAX_WIDTH}], got {self.best_of}"
                )
        _check_number("length_penalty", self.length_penalty)
        if math.isinf(self.length_penalty):
            raise InvalidRequestError("length_penalty", "must be finite")
        if self.early_stopping not in EARLY_STOPPING_VALUES or not isinstance(
            self.early_stopping, (bool, str)
        ):
            raise InvalidRequestError(
                "early_stopping", f"must be true, false or 'never', got {self.early_stopping!r}"
            )
        if self.beam_width == 1:
            return
        if self.n > self.beam_width:
            raise InvalidRequestError(
                "n", f"must be <= beam_width ({self.beam_width}) with beam search, got {self.n}"
            )
        refused = {
            "best_of": self.best_of is not None,
            "stop": bool(self.stop),
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
        }
        for name, given in refused.items():
            if given:
                raise InvalidRequestError(
                    name, "is not supported with beam search (beam_width > 1)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """How many sequences the request forks into: best_of, n, or the beam width."""
        if self.beam_width > 1:
            return self.beam_width
        return self.best_of or self.n
