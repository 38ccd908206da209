"""Check a request against the model, the engine's limits and its KV pool."""

from __future__ import annotations

from collections.abc import Callable

from tessera.workers.api import InvalidRequestError, Resume, SamplingParams
from tessera.workers.config import EngineConfig
from tessera.workers.kv.manager import blocks_needed
from tessera.workers.model.config import ModelConfig


def validate_request(
    prompt: str | list[int] | tuple[int, ...],
    sampling: SamplingParams,
    *,
    tokenize: Callable[[str], list[int]],
    model: ModelConfig,
    config: EngineConfig,
    max_model_len: int,
    num_blocks: int,
    resume: Resume | None = None,
) -> tuple[int, ...]:
    """Return the prompt's token ids, or raise ``InvalidRequestError`` naming the field."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        token_ids = tuple(tokenize(prompt))
    else:
        token_ids = tuple(prompt)
        for token_id in token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidRequestError("prompt", f"token ids must be integers, got {token_id!r}")
            if not 0 <= token_id < model.vocab_size:
                raise InvalidRequestError(
                    "prompt",
                    f"token id {token_id} is out of the vocabulary [0, {model.vocab_size})",
                )
    if not token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    for token_id, _ in sampling.logit_bias:
        if token_id >= model.vocab_size:
            raise InvalidRequestError(
                "logit_bias",
                f"token id {token_id} is out of the vocabulary [0, {model.vocab_size})",
            )
    for token_id in sampling.stop_token_ids:
        if token_id >= model.vocab_size:
            raise InvalidRequestError(
                "stop_token_ids",
                f"token id {token_id} is out of the vocabulary [0, {model.vocab_size})",
            )
    total = len(token_ids) + sampling.max_tokens
    if total > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = "
            f"{total} exceeds the model's context length of {max_model_len} tokens",
        )
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
