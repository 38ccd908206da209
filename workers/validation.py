"""Check a request against the model, the engine's limits and its KV pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tessera.workers.api import InvalidRequestError, Resume, SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.kv.manager import blocks_needed
from tessera.workers.model.config import ModelConfig

#: Most inputs in one embeddings request (OpenAI's own limit).
MAX_EMBEDDING_INPUTS = 2048


def check_prompt_ids(
    token_ids: Sequence[object], vocab_size: int, field: str = "prompt", max_len: int | None = None
) -> None:
    """A prompt given as token ids: at most ``max_len`` of them (checked first), integers
    in the vocabulary. The per-id checks are C loops (``map``, ``min``, ``max``), so a
    long list costs microseconds, not a Python loop on the caller's event loop."""
    if max_len is not None and len(token_ids) > max_len:
        raise InvalidRequestError(
            field,
            f"{len(token_ids)} token ids, more than the model's context of {max_len} tokens",
        )
    if not set(map(type, token_ids)) <= {int}:  # bool (an int subclass) is no token id
        wrong = next(t for t in token_ids if type(t) is not int)
        raise InvalidRequestError(field, f"token ids must be integers, got {wrong!r}")
    check_id_range(token_ids, vocab_size, field)


def check_id_range(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    """Integer ``token_ids`` are in ``[0, vocab_size)``: ``InvalidRequestError`` naming
    the smallest or largest one that is not."""
    if not token_ids:
        return
    for extreme in (min(token_ids), max(token_ids)):
        if not 0 <= extreme < vocab_size:
            raise InvalidRequestError(
                field, f"token id {extreme} is out of the vocabulary [0, {vocab_size})"
            )


def check_sampling_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """The request's logit-bias and stop token ids are in the vocabulary (their counts
    are bounded by ``SamplingParams``)."""
    check_id_range([token_id for token_id, _ in sampling.logit_bias], vocab_size, "logit_bias")
    check_id_range(sampling.stop_token_ids, vocab_size, "stop_token_ids")


def check_context(
    num_prompt: int, max_tokens: int, max_model_len: int, field: str = "max_tokens"
) -> None:
    """The prompt and the tokens it may generate fit the model's context."""
    total = num_prompt + max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            field,
            f"prompt ({num_prompt} tokens) + {field} ({max_tokens}) = {total} exceeds the "
            f"model's context length of {max_model_len} tokens",
        )


def validate_request(
    prompt: str | Sequence[int],
    sampling: SamplingParams,
    *,
    tokenize: Callable[[str], list[int]],
    model: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    num_blocks: int,
    resume: Resume | None = None,
) -> tuple[int, ...]:
    """Return the prompt's token ids, or raise ``InvalidRequestError`` naming the field.

    The front end checks the vocabulary and the context with the same functions before
    it places a request (``check_prompt_ids``, ``check_sampling_ids``, ``check_context``),
    under its own field names; the worker checks them again only because its engine is
    also driven directly (the Python API, the CLI)."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        token_ids = tuple(tokenize(prompt))
        if token_ids and max(token_ids) >= model.vocab_size:  # another tokenizer's ids
            raise InvalidRequestError(
                "prompt",
                f"the tokenizer gave token id {max(token_ids)}, out of the model's "
                f"vocabulary [0, {model.vocab_size}) (is --tokenizer the model's?)",
            )
    else:
        token_ids = tuple(prompt)
        check_prompt_ids(token_ids, model.vocab_size)
    if not token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    check_sampling_ids(sampling, model.vocab_size)
    check_context(len(token_ids), sampling.max_tokens, max_model_len)
    total = len(token_ids) + sampling.max_tokens
    _check_width(len(token_ids), total, sampling, config, num_blocks)
    parallel = sampling.parallel_tokens
    if parallel is not None and parallel.max_width > config.max_num_batched_tokens:
        raise InvalidRequestError(
            "parallel_tokens.max_width",
            f"{parallel.max_width} exceeds the engine's max_num_batched_tokens "
            f"({config.max_num_batched_tokens}): a set is computed in one step",
        )
    if resume is not None:
        _check_resume(resume, sampling, model)
    return token_ids


def _check_resume(resume: Resume, sampling: SamplingParams, model: ModelConfig) -> None:
    if sampling.num_samples > 1:
        raise InvalidRequestError(
            "resume", "only a request with one output (n=1, no best_of, no beams) resumes"
        )
    if sampling.parallel_tokens is not None:
        raise InvalidRequestError(
            "resume", "a parallel_tokens request cannot resume: its sets' positions are lost"
        )
    if len(resume.token_ids) >= sampling.max_tokens:
        raise InvalidRequestError(
            "resume",
            f"{len(resume.token_ids)} generated tokens leave nothing to generate "
            f"(max_tokens={sampling.max_tokens})",
        )
    for token_id in resume.token_ids:
        if token_id >= model.vocab_size:
            raise InvalidRequestError(
                "resume", f"token id {token_id} is out of the vocabulary [0, {model.vocab_size})"
            )


def _check_width(
    num_prompt: int, total: int, sampling: SamplingParams, config: EngineConfig, num_blocks: int
) -> None:
    width = sampling.num_samples
    field = "beam_width" if sampling.beam_width > 1 else "best_of" if sampling.best_of else "n"
    for limit in ("max_num_seqs", "max_num_batched_tokens"):
        if width > getattr(config, limit):
            raise InvalidRequestError(
                field, f"{width} sequences exceed the engine's {limit} ({getattr(config, limit)})"
            )
    bs = config.block_size
    # The worst case: every sequence at full length. Forks share the prompt's full
    # blocks, also after a preemption, through the prefix cache (so it must be on).
    sharing = config.enable_block_sharing and config.enable_prefix_caching
    shared = num_prompt // bs if sharing else 0
    need = shared + width * (blocks_needed(total, bs) - shared)
    if need <= num_blocks:
        return
    if width == 1:
        what = f"prompt + max_tokens = {total} tokens needs"
    else:
        what = f"{width} sequences of prompt + max_tokens = {total} tokens need"
    raise InvalidRequestError(
        "max_tokens", f"{what} {need} KV blocks, but the KV pool has only {num_blocks}"
    )


def check_embedding_inputs(
    inputs: Sequence[Sequence[int]], vocab_size: int, max_model_len: int
) -> None:
    """``InvalidRequestError`` naming ``input`` (or ``input[i]``): no inputs, more than
    ``MAX_EMBEDDING_INPUTS``, an empty one, one over the context or out of the vocabulary."""
    if not inputs:
        raise InvalidRequestError("input", "must not be empty")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise InvalidRequestError(
            "input", f"at most {MAX_EMBEDDING_INPUTS} inputs, got {len(inputs)}"
        )
    for i, tokens in enumerate(inputs):
        if not tokens:
            raise InvalidRequestError(f"input[{i}]", "must not be empty")
        check_prompt_ids(tokens, vocab_size, f"input[{i}]", max_model_len)
