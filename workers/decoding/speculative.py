"""Speculative decoding: propose draft tokens cheaply, verify them in one target pass.

Per step, for every decoding sequence that speculates:

1. **Propose** ``k`` draft tokens and append them to ``token_ids`` (``num_draft``).
   ``ngram`` (prompt lookup) copies what followed the latest earlier occurrence of the
   last 3, 2 or 1 tokens of prompt + output: a point-mass proposal. ``draft`` runs the
   worker's draft model ``k`` times (its own paged KV pool, batched over sequences),
   sampling each draft token from the draft's distribution ``q`` under the request's
   own sampling settings.
2. **Verify**: the batcher schedules the last real token and the drafts as one chunk
   (``Sequence.chunk``) next to ordinary decodes and prefills; the target's logits of
   those ``k + 1`` rows give ``p_0 .. p_k``.
3. **Accept** draft ``j`` with probability ``min(1, p_j(d) / q_j(d))``; at the first
   rejection sample from ``max(0, p_j - q_j)`` renormalised and stop; if every draft
   is accepted take a bonus token from ``p_k``. The output then has exactly the
   target's distribution (Leviathan et al., 2023; Chen et al., 2023). Greedy requests
   accept a draft when it equals the target's argmax, so their output equals
   non-speculative decoding. Randomness is keyed by (seed, token index) per purpose
   (draft, accept, residual), so a seeded request is reproducible.
4. **Roll back**: ``num_computed_tokens`` goes back to the accepted tokens, blocks that
   only held rejected drafts return to the pool at once, and the draft model's KV is cut
   back the same way.

With ``adaptive`` the next ``k`` follows the request's recent per-token acceptance rate
``r`` (a moving average): ``k = round(r / (1 - r)) + 1``, the expected run of accepted
drafts plus one, within [``speculative_min_tokens``, ``num_tokens``].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from tessera.workers.api import (
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    SpeculativeParams,
)
from tessera.workers.decoding.hooks import StepContext
from tessera.workers.decoding.sampling import Sampler, SampleResult, SamplingRow, keyed_uniform
from tessera.workers.engine.model_runner import Chunk, ModelRunner
from tessera.workers.engine.sequence import Sequence, SequenceGroup, SpecState
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.kv.manager import KVCacheManager
from tessera.workers.model.loader import LoadedModel, load_model

if TYPE_CHECKING:
    from tessera.workers.engine.batcher import ScheduledBatch

#: Prompt lookup tries the last this many tokens first, then fewer, down to one.
NGRAM_MAX = 3
#: Salts that give the draft's sampling and the acceptance test their own random streams.
DRAFT_SALT = 0x5EED_D4AF
ACCEPT_SALT = 0x5EED_ACC7
#: Weight of the latest step in the acceptance-rate moving average.
RATE_WEIGHT = 0.3
_MAX_RATE = 0.95  # keeps r / (1 - r) finite


def ngram_proposal(token_ids: Seq[int], k: int, max_n: int = NGRAM_MAX) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the last
    ``n`` tokens (``n = max_n .. 1``, longest match first); [] when none occurred."""
    length = len(token_ids)
    for n in range(min(max_n, length - 1), 0, -1):
        suffix = list(token_ids[length - n :])
        # latest earlier occurrence first: it reflects the most recent context
        for i in range(length - n - 1, -1, -1):
            if token_ids[i] == suffix[0] and list(token_ids[i : i + n]) == suffix:
                return list(token_ids[i + n : i + n + k])
    return []


def load_draft(spec: str, target: LoadedModel, dtype: str, device: str) -> LoadedModel:
    """The draft model ``spec`` names (see ``EngineConfig.draft_model``); it must share
    the target's vocabulary."""
    if spec == "target":
        return target
    if spec.startswith("target:"):
        layers = int(spec.removeprefix("target:"))
        if layers > target.config.num_layers:
            raise ValueError(
                f"draft_model: {spec!r} asks for {layers} layers, the target has "
                f"{target.config.num_layers}"
            )
        model = target.model.first_layers(layers)
        return dataclasses.replace(target, model=model, config=model.config)
    draft = load_model(spec, dtype, device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft_model: its vocabulary has {draft.config.vocab_size} tokens, the "
            f"target's {target.config.vocab_size}; a draft must share the target's"
        )
    return draft


class DraftModel:
    """A draft model with its own paged KV pool, in the target's worker."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        dtype,
        device,
        native_decode: bool = False,
    ):
        self.loaded = loaded
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        cache = allocate_kv_cache(loaded.config, num_blocks, block_size, dtype, device)
        self.runner = ModelRunner(loaded.model, self.kv, cache, native_decode=native_decode)


class Speculator:
    """Proposes, verifies and rolls back the drafts of an engine's sequences."""

    def __init__(
        self,
        sampler: Sampler,
        sampling_row: Callable[[Sequence, int], SamplingRow],
        default: SpeculativeParams | None,
        min_tokens: int,
        draft: DraftModel | None,
    ) -> None:
        self.sampler = sampler
        self.sampling_row = sampling_row  # (seq, prefix length) -> the row sampling after it
        self.default = default
        self.min_tokens = min_tokens
        self.draft = draft
        self.proposed = self.accepted = self.steps = self.tokens = 0

    # ------------------------------------------------------------ per request
    def params_for(self, sampling: SamplingParams) -> SpeculativeParams | None:
        """What a request speculates with: its own settings, else the worker's default
        (not for beams, forks or parallel tokens); None when it does not speculate."""
        params = sampling.speculative
        if params is None:
            forked = sampling.num_samples > 1 or sampling.parallel_tokens is not None
            params = None if forked else self.default
        if params is None or params.num_tokens == 0:
            return None
        return params

    def check(self, sampling: SamplingParams) -> None:
        params = self.params_for(sampling)
        if params is not None and params.method == "draft" and self.draft is None:
            raise InvalidRequestError(
                "speculative.method",
                "'draft' needs a worker started with a draft model (draft_model); "
                "this worker has none",
            )

    def start(self, seq: Sequence) -> None:
        params = self.params_for(seq.request.sampling)
        if params is not None:
            seq.spec = SpecState(params, params.num_tokens)

    def free(self, seq: Sequence) -> None:
        """Forget the sequence's draft-model K/V (finished, aborted or preempted)."""
        if seq.spec is not None and self.draft is not None:
            self.draft.kv.free(seq.seq_id)
            seq.spec.draft_computed = 0

    # ------------------------------------------------------- per-step hooks
    def before_schedule(self, running: list[SequenceGroup], max_model_len: int) -> None:
        """Propose drafts for the running sequences that speculate and are decoding
        (their last token is the only one to compute)."""
        seqs = [
            seq
            for group in running
            for seq in group.seqs
            if seq.spec is not None
            and seq.num_output_tokens > 0
            and seq.num_computed_tokens == seq.num_tokens - 1
        ]
        self.propose(seqs, max_model_len)

    def after_schedule(
        self, batch: ScheduledBatch, running: list[SequenceGroup], speculating: bool
    ) -> None:
        """Forget what preempted sequences drafted with; drop the drafts of sequences
        the step does not run (not verified this step: proposed afresh next time)."""
        for group in batch.preempted:
            for seq in group.seqs:
                self.free(seq)
        if speculating:
            scheduled = {id(seq) for seq, _ in batch.items}
            for group in running:
                for seq in group.seqs:
                    if seq.num_draft and id(seq) not in scheduled:
                        seq.drop_drafts()

    def verify_step(
        self, post: StepContext, group: SequenceGroup, seq: Sequence, logits: torch.Tensor
    ) -> list[RequestOutput]:
        """Accept what the target agrees with, roll the rest back, append the tokens."""
        results = self.verify(seq, logits)
        real = seq.num_real_tokens
        seq.drop_drafts()
        computed = real + len(results) - 1  # the last real token and the accepted drafts
        seq.num_computed_tokens = computed
        post.kv.truncate(seq.seq_id, computed)
        self.rollback(seq, computed)
        for result in results:
            post.append_token(group, seq, result.token_id, result.logprob)
            if seq.finished:
                break
        else:
            post.hasher.update(seq)  # the accepted drafts' blocks (no drafts left)
            post.hasher.cache_computed(seq, real // post.kv.block_size)
        return post.emit(group, seq)

    # ---------------------------------------------------------------- propose
    def propose(self, seqs: list[Sequence], max_model_len: int) -> None:
        """Append up to ``k`` drafts to each decoding sequence that speculates."""
        by_draft: list[tuple[Sequence, int]] = []
        for seq in seqs:
            spec = seq.spec
            params = seq.request.sampling
            room = min(
                params.max_tokens - seq.num_output_tokens - 1,
                max_model_len - seq.num_tokens - 1,
            )
            k = min(spec.num_tokens, room)
            if k <= 0:
                continue
            if spec.params.method == "ngram":
                drafts = ngram_proposal(seq.token_ids, k)
                seq.token_ids += drafts
                seq.num_draft = len(drafts)
                spec.draft_probs = None
            else:
                by_draft.append((seq, k))
        if by_draft:
            self._propose_with_model(by_draft)

    def _propose_with_model(self, todo: list[tuple[Sequence, int]]) -> None:
        """``k`` passes of the draft model over every sequence at once: the first also
        catches up on the tokens it has not seen (the prompt, the last accepted)."""
        draft = self.draft
        assert draft is not None
        active = []
        for seq, k in todo:
            # it writes the real tokens and all drafts but the last
            if draft.kv.allocate(seq.seq_id, seq.num_tokens + k - 1):
                active.append((seq, k))
        probs: dict[int, list[torch.Tensor]] = {id(seq): [] for seq, _ in active}
        for j in range(max((k for _, k in active), default=0)):
            step = [(seq, k) for seq, k in active if k > j]
            chunks = []
            for seq, _ in step:
                start = seq.spec.draft_computed
                chunks.append(
                    Chunk(
                        seq.seq_id,
                        seq.token_ids[start:],
                        start,
                        logits_rows=(seq.num_tokens - start - 1,),
                        prompt_len=len(seq.request.prompt_token_ids),
                    )
                )
            logits = draft.runner.execute(chunks)
            rows = [self.sampling_row(seq, seq.num_tokens) for seq, _ in step]
            rows = [dataclasses.replace(r, seed=r.seed ^ DRAFT_SALT) for r in rows]
            q = self.sampler.probs(logits, rows)
            for (seq, _), row_q, row in zip(step, q, rows, strict=True):
                seq.spec.draft_computed = seq.num_tokens
                seq.token_ids.append(self.sampler.sample_from(row_q, row))
                seq.num_draft += 1
                probs[id(seq)].append(row_q)
        for seq, _ in active:
            seq.spec.draft_probs = torch.stack(probs[id(seq)])

    # ----------------------------------------------------------------- verify
    def verify(self, seq: Sequence, logits: torch.Tensor) -> list[SampleResult]:
        """The tokens this verification step produces for ``seq`` (accepted drafts,
        then a corrected or bonus token), from the target's ``[k + 1, V]`` logits.
        Counts them; the caller rolls back and appends."""
        spec = seq.spec
        k = seq.num_draft
        real = seq.num_tokens - k
        drafts = seq.token_ids[real:]
        rows = [self.sampling_row(seq, real + j) for j in range(k + 1)]
        if rows[0].params.greedy:
            results = self.sampler.sample(logits, rows)
            accepted = 0
            while accepted < k and results[accepted].token_id == drafts[accepted]:
                accepted += 1
            out = results[: accepted + 1]
        else:
            out = self._rejection_sample(logits, rows, drafts, spec.draft_probs)
            accepted = len(out) - 1
        spec.steps += 1
        spec.proposed += k
        spec.accepted += accepted
        spec.tokens += len(out)
        self.steps += 1
        self.proposed += k
        self.accepted += accepted
        self.tokens += len(out)
        if spec.params.adaptive and k:
            step_rate = accepted / (accepted + (accepted < k))
            spec.rate = (1 - RATE_WEIGHT) * spec.rate + RATE_WEIGHT * step_rate
            r = min(spec.rate, _MAX_RATE)
            spec.num_tokens = max(
                self.min_tokens, min(spec.params.num_tokens, round(r / (1 - r)) + 1)
            )
        return out

    def _rejection_sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        drafts: list[int],
        draft_probs: torch.Tensor | None,
    ) -> list[SampleResult]:
        p = self.sampler.probs(logits, rows)  # [k + 1, V]
        tokens: list[int] = []
        for j, d in enumerate(drafts):
            q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
            u = keyed_uniform(rows[j].seed ^ ACCEPT_SALT, rows[j].token_index)
            if u * q_d < float(p[j, d]):  # u < p / q, without dividing by q
                tokens.append(d)
                continue
            residual = p[j].clone()
            if draft_probs is None:
                residual[d] = 0.0
            else:
                residual = (residual - draft_probs[j].to(residual.device)).clamp_min_(0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere: p == q, never rejected
                residual = p[j]
            tokens.append(self.sampler.sample_from(residual, rows[j]))
            return self.sampler.with_logprobs(logits[: j + 1], rows[: j + 1], tokens)
        bonus = self.sampler.sample(logits[-1:], rows[-1:])[0].token_id
        return self.sampler.with_logprobs(logits, rows, [*tokens, bonus])

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """The draft model keeps only K/V of tokens that were accepted."""
        if seq.spec is not None and self.draft is not None:
            kept = min(seq.spec.draft_computed, num_computed)
            seq.spec.draft_computed = kept
            self.draft.kv.truncate(seq.seq_id, kept)

    def check_integrity(self, running: set[str]) -> None:
        if self.draft is not None:
            self.draft.kv.check_integrity()
            held = set(self.draft.kv.tables)
            assert held <= running, f"draft blocks held by sequences not running: {held - running}"
