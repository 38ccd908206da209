"""What a decoding feature's per-step hook may use of the step that calls it.

``engine.postprocess.Postprocessor`` provides it; the features (speculative
verification, forks and beams, parallel sets) name this protocol rather than the
engine, which sits above them and calls them.
"""

from __future__ import annotations

from typing import Any, Protocol

from tessera.workers.api import RequestOutput, TokenLogprob
from tessera.workers.decoding.rows import Rows
from tessera.workers.decoding.sampling import Sampler
from tessera.workers.engine.sequence import Sequence, SequenceGroup
from tessera.workers.kv.manager import KVCacheManager


class Hasher(Protocol):
    def update(self, seq: Sequence) -> None: ...

    def cache_computed(self, seq: Sequence, first_full: int) -> None: ...


class Counters(Protocol):
    generated_tokens: int


class StepContext(Protocol):
    kv: KVCacheManager
    hasher: Hasher
    counters: Counters
    sampler: Sampler
    rows: Rows
    tokenizer: Any
    max_model_len: int

    def append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> None: ...

    def emit(self, group: SequenceGroup, seq: Sequence) -> list[RequestOutput]: ...

    def end_search(self, group: SequenceGroup) -> None: ...
