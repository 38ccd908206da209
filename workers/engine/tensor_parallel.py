"""One engine over a tensor-parallel group: rank 0 here, ranks 1..N-1 as Ray actors.

Rank 0 is the engine: it schedules, keeps the block tables, samples and answers. Every
rank holds its part of the weights (``model/tensor_parallel.py``) and the K/V of its
heads, under the same block ids (each rank's pool has the same number of blocks). A
step's forward runs on every rank at once, joined by the all-reduces inside the layers;
the other ranks learn the step's inputs from rank 0 as broadcasts of persistent buffers
(no pickling, no Ray call per step), or where every rank is on one node through the
mailbox of the group's shared memory (``SharedCollectives.post``/``take``: gloo's
broadcasts cost ~0.7 ms each here)::

    rank 0:  schedule ──> header [16 int64] ──> ints [n int64] (──> masks [bytes])
                          │ broadcast           │ broadcast        │ broadcast
    rank k:  wait ───────>┘ ────────────────────┘ ─────────────────┘──> the same forward

``run_step`` builds the forward's tensors from the two buffers on every rank alike, so
no rank can read a step differently. A copy-on-write block copy is a message of its own.

The group is made by Tessera itself: a ``TCPStore`` on rank 0's node and a process
group for this group alone (gloo on the CPU, NCCL on CUDA; never the default group, so
a process may hold several). A collective that fails (a rank died: its connections
close at once) or outlasts ``COLLECTIVE_TIMEOUT_S`` (a rank hangs) raises
``GroupFailedError`` on rank 0; a worker then exits, so that Ray restarts it and its
group and its streams fail over. The other ranks are actors owned by rank 0's process:
Ray stops them with it.

The ranks go in a placement group, one bundle each: the one rank 0 runs in where it has
one (a worker's, made by the scheduler: rank ``k`` in bundle ``k``), else one made here
(ranks 1..N-1, ``STRICT_PACK``) and removed at ``close``.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tessera.workers.attention.metadata import AttentionMetadata
from tessera.workers.attention.paged import plan_decode
from tessera.workers.config import EngineConfig
from tessera.workers.model.config import ModelConfig
from tessera.workers.model.llama import LlamaModel
from tessera.workers.model.shared_collectives import HEADER_WORDS, SharedCollectives
from tessera.workers.model.tensor_parallel import SETTING, Shard, kv_head_range

logger = logging.getLogger(__name__)

#: A collective inside a step waits at most this long for the other ranks.
COLLECTIVE_TIMEOUT_S = 120.0
#: Ranks starting (a process, torch, their part of the weights) join within this.
STARTUP_TIMEOUT_S = 600.0
#: How long a rank waits for rank 0's next step: as long as the engine idles.
IDLE_WAIT = datetime.timedelta(days=365)

# The header's fields (int64 [HEADER]).
HEADER = HEADER_WORDS  # a step message's header: the shared mailbox's
(
    OP,
    ROWS,
    SEQS,
    LOGITS,
    WIDTH,
    DECODES,
    FLAGS,
    CONTEXTS,
    LOGITS_FOR,
    MASKS,
    MASK_BYTES,
    INTS,
    VIA_GLOO,  # with shared memory: the ints did not fit its mailbox and follow over gloo
) = range(13)
STOP, STEP, COPY, GATHER, WRITE = 0, 1, 2, 3, 4
ARGMAX_ONLY, HIDDEN_ONLY = 1, 2


def place_of(device: torch.device) -> str:
    """This process's device and node IP, as a rank reports them ("cuda:0@10.0.0.5":
    the GPU Ray gave it)."""
    import ray

    where = device.type
    if device.type == "cuda":
        ids = ray.get_gpu_ids()
        where = f"cuda:{ids[0]}" if ids else str(device)
    return f"{where}@{ray.util.get_node_ip_address()}"


class GroupFailedError(RuntimeError):
    """A rank of the group died or hung: the group cannot step again."""


def join_group(
    host: str,
    port: int,
    rank: int,
    size: int,
    device: torch.device,
    timeout_s: float,
    store: Any = None,
) -> Any:
    """This rank's process group of the ``size`` ranks meeting at ``host:port``, where
    rank 0 runs the store (``store``, its own): gloo, or NCCL on CUDA."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, size, False, timeout=timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, options)


@dataclass(slots=True)
class StepBuffers:
    """The persistent buffers a step's inputs cross in (grown, never shrunk)."""

    device: torch.device
    header: torch.Tensor
    ints: torch.Tensor
    masks: torch.Tensor

    @classmethod
    def on(cls, device: torch.device) -> StepBuffers:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            device,
            torch.zeros(HEADER, dtype=torch.int64, device=device),
            empty,
            torch.zeros(0, dtype=torch.bool, device=device),
        )

    def ints_of(self, count: int) -> torch.Tensor:
        if self.ints.numel() < count:
            self.ints = torch.zeros(
                max(count, 2 * self.ints.numel(), 1024), dtype=torch.int64, device=self.device
            )
        return self.ints[:count]

    def masks_of(self, count: int) -> torch.Tensor:
        if self.masks.numel() < count:
            self.masks = torch.zeros(
                max(count, 2 * self.masks.numel()), dtype=torch.bool, device=self.device
            )
        return self.masks[:count]


def _broadcast(group: Any, tensor: torch.Tensor, timeout: datetime.timedelta) -> None:
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = timeout
    group.broadcast([tensor], options).wait()


def run_step(
    model: LlamaModel,
    kv_cache: torch.Tensor,
    block_size: int,
    header: list[int],
    ints: torch.Tensor,
    masks: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One step's forward from its buffers, on any rank (``ModelRunner._forward``'s
    layout: ids, positions, slots, query starts, sequence lengths, logits rows, block
    tables; then RoPE contexts, ``logits_for`` and each masked chunk's mask shape)."""
    rows, seqs, logits, width = header[ROWS], header[SEQS], header[LOGITS], header[WIDTH]
    decodes, flags = header[DECODES], header[FLAGS]
    sizes = (
        rows,
        rows,
        rows,
        seqs + 1,
        seqs,
        logits,
        seqs * width,
        header[CONTEXTS],
        header[LOGITS_FOR],
        2 * header[MASKS],
    )
    ids, positions, slots, query_start, seq_lens, logits_rows, tables, contexts, full, shapes = (
        ints.split(sizes)
    )
    tables = tables.view(seqs, width)
    seq_lens_list = seq_lens.tolist()
    decode_plan = None
    if decodes:
        decode_plan = plan_decode(
            tables[:decodes],
            seq_lens[:decodes],
            seq_lens_list[:decodes],
            block_size,
            model.norm.weight.dtype,
        )
    attn_masks = None
    if header[MASKS]:
        found: list[torch.Tensor | None] = []
        offset = 0
        dims = shapes.tolist()
        for q_len, seq_len in zip(dims[::2], dims[1::2], strict=True):
            if q_len < 0:
                found.append(None)
                continue
            assert masks is not None
            found.append(masks[offset : offset + q_len * seq_len].view(q_len, seq_len))
            offset += q_len * seq_len
        attn_masks = tuple(found)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        block_tables=tables,
        num_decodes=decodes,
        query_start_loc_list=query_start.tolist(),
        seq_lens_list=seq_lens_list,
        attn_masks=attn_masks,
        decode_plan=decode_plan,
    )
    return model(
        ids,
        positions,
        kv_cache,
        meta,
        logits_rows,
        native=False,
        argmax_only=bool(flags & ARGMAX_ONLY),
        rope_contexts=contexts if header[CONTEXTS] else None,
        logits_for=full if header[LOGITS_FOR] else None,
        hidden_only=bool(flags & HIDDEN_ONLY),
    )


def _gather(group: Any, local: torch.Tensor, size: int, timeout: datetime.timedelta) -> list:
    from torch._C._distributed_c10d import AllgatherOptions  # (not re-exported)

    options = AllgatherOptions()
    options.timeout = timeout
    parts = [torch.empty_like(local) for _ in range(size)]
    group.allgather([parts], [local], options).wait()
    return parts


def whole_blocks(config: ModelConfig, parts: list[torch.Tensor]) -> torch.Tensor:
    """Each rank's ``[layers, 2, n, block_size, its KV heads, head_dim]`` as the whole
    model's (replicated heads taken once)."""
    size = len(parts)
    shape = list(parts[0].shape)
    shape[4] = config.num_kv_heads
    whole = torch.empty(shape, dtype=parts[0].dtype)
    for rank, part in enumerate(parts):
        first, count = kv_head_range(config, rank, size)
        whole[:, :, :, :, first : first + count] = part.cpu()
    return whole


def write_heads(
    kv_cache: torch.Tensor,
    config: ModelConfig,
    rank: int,
    size: int,
    ids: torch.Tensor,
    blocks: torch.Tensor,
) -> None:
    """This rank's heads of the whole-model ``blocks`` into its pool's blocks ``ids``."""
    first, count = kv_head_range(config, rank, size)
    mine = blocks[:, :, :, :, first : first + count].to(kv_cache.device, kv_cache.dtype)
    kv_cache.index_copy_(2, ids.to(kv_cache.device), mine)


def copy_blocks(kv_cache: torch.Tensor, pairs: Sequence[int]) -> None:
    """Copy-on-write copies ``(src, dst)`` flattened, in order."""
    for src, dst in zip(pairs[::2], pairs[1::2], strict=True):
        kv_cache[:, :, dst].copy_(kv_cache[:, :, src])


class TensorParallelGroup:
    """Rank 0's end of a group (see the module docstring): ``start`` it, then ``forward``
    and ``copy`` as ``ModelRunner`` would run them alone; ``close`` stops the ranks."""

    def __init__(
        self,
        group: Any,
        size: int,
        ranks: list[Any],
        placement: Any,
        own: bool,
        device: torch.device,
    ) -> None:
        self.group, self.size, self.ranks = group, size, ranks
        self.placement, self._own_placement = placement, own
        self.buffers = StepBuffers.on(device)
        self.timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.exit_on_failure = False  # a worker's: its process exits (Ray restarts it)
        self.failed: str | None = None
        self.closed = False
        self.store: Any = None
        self.places: tuple[str, ...] = ()  # each rank's device and node, rank 0 first
        self.sent_bytes = 0  # of the step broadcasts, so far (benchmarks read it)
        self.shared: SharedCollectives | None = None  # the step messages' mailbox too

    # ------------------------------------------------------------------ start

    @staticmethod
    def spec(config: EngineConfig) -> Shard:
        """Rank 0's shard, its group not yet made (``start`` makes it)."""
        return Shard(0, config.tensor_parallel_size, None)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        shard: Shard,
        num_blocks: int,
        precision: str,
        rank_resources: dict[str, float] | None = None,
    ) -> TensorParallelGroup:
        """Start ranks 1..N-1 (each loads its part of ``config.model``), make the group,
        and give rank 0's ``shard`` its process group. ``rank_resources``: each rank's
        bundle where rank 0 runs in no placement group (default one CPU)."""
        import ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        size = config.tensor_parallel_size
        device = torch.device(config.device)
        if not ray.is_initialized():
            ray.init()
        host = ray.util.get_node_ip_address()
        placement = get_current_placement_group()
        own = placement is None
        first = 1  # the bundle of rank 1
        resources = dict(rank_resources or {"CPU": 1.0})
        if own:
            need = {name: value * (size - 1) for name, value in resources.items()}
            free = ray.available_resources()
            short = {k: v for k, v in need.items() if free.get(k, 0.0) < v}
            if short:
                raise ValueError(
                    f"{SETTING}: {size} ranks need {size - 1} more bundles of {resources}; "
                    f"the Ray cluster has { ({k: free.get(k, 0.0) for k in short}) } free"
                )
            placement = placement_group([resources] * (size - 1), strategy="STRICT_PACK")
            first = 0
            ray.get(placement.ready(), timeout=STARTUP_TIMEOUT_S)
        else:
            if placement.bundle_count < size:
                raise ValueError(
                    f"{SETTING}: {size} ranks, but the worker's placement group has "
                    f"{placement.bundle_count} bundles"
                )
            resources = dict(placement.bundle_specs[1])
        import torch.distributed as dist

        # the store listens on a free port of rank 0's node, found by the OS
        store = dist.TCPStore(
            host,
            0,
            size,
            True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        port = store.port
        threads = max(1, int(resources.get("CPU", 1.0)))
        shared = None
        if device.type == "cpu":  # ranks on this node share their collectives' memory
            slot = 4 * max(
                config.max_num_batched_tokens * shard.hidden_size,
                config.max_num_seqs * shard.vocab_rows,
            )
            shared = SharedCollectives.create(size, slot)
        remote = ray.remote(RankActor)
        ranks = [
            remote.options(
                num_cpus=resources.get("CPU", 0.0),
                num_gpus=resources.get("GPU", 0.0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement, placement_group_bundle_index=first + rank - 1
                ),
                max_restarts=0,
                max_task_retries=0,
            ).remote(
                config,
                rank,
                size,
                host,
                port,
                num_blocks,
                threads,
                None if shared is None else (shared.path, shared.slot_bytes),
            )
            for rank in range(1, size)
        ]
        try:
            group = join_group(host, port, 0, size, device, STARTUP_TIMEOUT_S, store)
            shard.group = group
            answers = ray.get([r.ready.remote() for r in ranks], timeout=STARTUP_TIMEOUT_S)
            for rank, (found, _, _) in enumerate(answers, start=1):
                if found != precision:  # (a node without rank 0's kernels)
                    raise GroupFailedError(
                        f"{SETTING}: rank {rank} computes in {found}, rank 0 in {precision}"
                    )
            # shared memory only where every rank opened the file: all on this node
            if shared is not None and not all(attached for _, _, attached in answers):
                shared = None
            shard.shared = shared
            ray.get([r.begin.remote(shared is not None) for r in ranks], timeout=60)
        except Exception:
            for actor in ranks:
                ray.kill(actor)
            if own:
                ray.util.remove_placement_group(placement)
            raise
        finally:
            if shared is not None:
                shared.unlink()  # every rank has it mapped (or is gone)
        made = cls(group, size, ranks, placement, own, device)
        made.store = store  # the group's meeting point lives as long as the group
        made.shared = shared
        made.places = (place_of(device), *(place for _, place, _ in answers))
        logger.info(
            "tensor-parallel group of %d ranks up: %s; collectives over %s",
            size,
            ", ".join(made.places),
            "shared memory" if shared is not None else "gloo" if device.type == "cpu" else "NCCL",
        )
        return made

    # ------------------------------------------------------------------ steps

    def forward(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        header: list[int],
        values: list[int],
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Send a step (``header`` without its op and sizes of ints and masks; ``values``
        the ints) to every rank, then run it here."""
        mask_values = [m.reshape(-1) for m in masks if m is not None]
        mask_bytes = sum(m.numel() for m in mask_values)
        header[OP], header[INTS], header[MASK_BYTES] = STEP, len(values), mask_bytes
        buffers = self.buffers
        ints = buffers.ints_of(len(values))
        ints.copy_(torch.tensor(values, dtype=torch.int64))
        mask_data = None
        if mask_bytes:
            mask_data = buffers.masks_of(mask_bytes)
            torch.cat(mask_values, out=mask_data)
        self._send(header, ints, mask_data)
        try:
            return run_step(model, kv_cache, block_size, header, ints, mask_data)
        except RuntimeError as error:  # the other ranks are out of step with this one now
            self._failed(error)
            raise GroupFailedError(self.failed) from error

    def copy(self, kv_cache: torch.Tensor, pairs: list[int]) -> None:
        """Copy-on-write block copies on every rank (``pairs``: src, dst, ...)."""
        header = [0] * HEADER
        header[OP], header[INTS] = COPY, len(pairs)
        ints = self.buffers.ints_of(len(pairs))
        ints.copy_(torch.tensor(pairs, dtype=torch.int64))
        self._send(header, ints, None)
        copy_blocks(kv_cache, pairs)

    def gather_blocks(
        self, kv_cache: torch.Tensor, config: ModelConfig, ids: list[int]
    ) -> torch.Tensor:
        """Blocks ``ids`` of every rank's pool, as the whole model's KV
        (``[layers, 2, n, block_size, kv_heads, head_dim]`` on the CPU): what a
        disaggregated prefill sends."""
        header = [0] * HEADER
        header[OP], header[INTS] = GATHER, len(ids)
        ints = self.buffers.ints_of(len(ids))
        ints.copy_(torch.tensor(ids, dtype=torch.int64))
        self._send(header, ints, None)
        local = kv_cache.index_select(2, ints.to(kv_cache.device)).contiguous()
        try:
            return whole_blocks(config, _gather(self.group, local, self.size, self.timeout))
        except RuntimeError as error:
            self._failed(error)
            raise GroupFailedError(self.failed) from error

    def write_blocks(
        self, kv_cache: torch.Tensor, config: ModelConfig, ids: list[int], blocks: torch.Tensor
    ) -> None:
        """Whole-model KV ``blocks`` (``gather_blocks``' layout) into blocks ``ids`` of
        every rank's pool, each rank its heads: what a disaggregated decode receives."""
        header = [0] * HEADER
        header[OP], header[INTS] = WRITE, len(ids)
        ints = self.buffers.ints_of(len(ids))
        ints.copy_(torch.tensor(ids, dtype=torch.int64))
        self._send(header, ints, None)
        blocks = blocks.to(kv_cache.device, kv_cache.dtype).contiguous()
        try:
            _broadcast(self.group, blocks, self.timeout)
        except RuntimeError as error:
            self._failed(error)
            raise GroupFailedError(self.failed) from error
        write_heads(kv_cache, config, 0, self.size, ints, blocks)

    def _send(self, header: list[int], ints: torch.Tensor, masks: torch.Tensor | None) -> None:
        if self.failed is not None:
            raise GroupFailedError(self.failed)
        buffers = self.buffers
        self.sent_bytes += 8 * (HEADER + ints.numel()) + (0 if masks is None else masks.numel())
        try:
            shared = self.shared
            posted = shared is not None and shared.post(header, ints, COLLECTIVE_TIMEOUT_S)
            if shared is not None and not posted:  # too many ints: they follow over gloo
                header[VIA_GLOO] = 1
                shared.post(header, ints[:0], COLLECTIVE_TIMEOUT_S)
            if shared is None:
                buffers.header.copy_(torch.tensor(header, dtype=torch.int64))
                _broadcast(self.group, buffers.header, self.timeout)
            if not posted and ints.numel():
                _broadcast(self.group, ints, self.timeout)
            if masks is not None:
                _broadcast(self.group, masks, self.timeout)
        except RuntimeError as error:
            self._failed(error)
            raise GroupFailedError(self.failed) from error

    def _failed(self, error: BaseException) -> None:
        self.failed = f"the tensor-parallel group failed: {error}"
        logger.error("%s", self.failed)
        if self.exit_on_failure:  # a worker: Ray restarts it, and its streams fail over
            logging.shutdown()
            os._exit(1)

    # ------------------------------------------------------------------ stop

    def close(self) -> None:
        """Stop the other ranks (a stop message, then their actors) and free the
        placement group made here."""
        if self.closed:
            return
        self.closed = True
        import ray

        if self.failed is None:
            try:
                header = [0] * HEADER
                header[OP] = STOP
                self._send(header, self.buffers.ints_of(0), None)
            except Exception:  # a rank gone already
                logger.debug("tensor-parallel stop message not delivered", exc_info=True)
        for actor in self.ranks:
            ray.kill(actor)
        if self._own_placement and self.placement is not None:
            ray.util.remove_placement_group(self.placement)


class RankActor:
    """Rank ``rank`` (1..N-1) of a group: its part of the weights and of the KV pool,
    and a thread that runs each step rank 0 broadcasts. Made by ``start`` as a Ray actor."""

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        size: int,
        host: str,
        port: int,
        num_blocks: int,
        threads: int,
        shared: tuple[str, int] | None = None,
    ) -> None:
        """``shared``: rank 0's shared-memory file and slot size, opened here if this
        rank is on its node (``SharedCollectives``)."""
        from tessera.workers.kv.kv_cache import allocate_kv_cache
        from tessera.workers.model.loader import load_model, load_tokenizer

        torch.set_num_threads(threads)
        device = torch.device(config.device)
        self.shared = None
        if shared is not None:
            self.shared = SharedCollectives.attach(shared[0], rank, size, shared[1])
        self.group = join_group(host, port, rank, size, device, STARTUP_TIMEOUT_S)
        tokenizer = load_tokenizer(config.model, config.revision, tokenizer=config.tokenizer)
        self.loaded = load_model(
            config.model,
            config.dtype,
            config.device,
            config.packed_weights,
            revision=config.revision,
            tokenizer=tokenizer,
            shard=Shard(rank, size, self.group),
        )
        self.shard = self.loaded.model.tp
        self.kv_cache = allocate_kv_cache(
            self.loaded.model.config, num_blocks, config.block_size, self.loaded.kv_dtype, device
        )
        self.block_size = config.block_size
        self.rank, self.size = rank, size
        self.buffers = StepBuffers.on(device)
        self._thread = threading.Thread(target=self._loop, name=f"rank-{rank}", daemon=True)

    def ready(self) -> tuple[str, str, bool]:
        """Its precision, once loaded (rank 0 checks that every rank computes alike),
        its place (``place_of``) and whether it opened the shared-memory file."""
        place = place_of(torch.device(self.kv_cache.device))
        return self.loaded.precision, place, self.shared is not None

    def begin(self, shared: bool) -> None:
        """Start taking steps, with the collectives over shared memory or not (as every
        rank: rank 0 decides)."""
        self.shard.shared = self.shared if shared else None
        self._thread.start()

    def _loop(self) -> None:
        buffers = self.buffers
        step_timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        try:
            shared = self.shard.shared
            while True:
                if shared is not None:  # rank 0's message in the shared file
                    ints = shared.take(buffers.header, buffers.ints_of)
                else:
                    _broadcast(self.group, buffers.header, IDLE_WAIT)
                header = buffers.header.tolist()
                if header[OP] == STOP:
                    return
                if shared is None or header[VIA_GLOO]:
                    ints = buffers.ints_of(header[INTS])
                    if header[INTS]:
                        _broadcast(self.group, ints, step_timeout)
                if header[OP] == COPY:
                    copy_blocks(self.kv_cache, ints.tolist())
                    continue
                if header[OP] == GATHER:
                    local = self.kv_cache.index_select(2, ints).contiguous()
                    _gather(self.group, local, self.size, step_timeout)
                    continue
                if header[OP] == WRITE:
                    self._receive_blocks(ints, step_timeout)
                    continue
                masks = None
                if header[MASK_BYTES]:
                    masks = buffers.masks_of(header[MASK_BYTES])
                    _broadcast(self.group, masks, step_timeout)
                with torch.inference_mode():
                    run_step(self.loaded.model, self.kv_cache, self.block_size, header, ints, masks)
        except Exception as error:  # rank 0 gone, a collective failed, or a step raised
            # the group is over: exit, so that rank 0 waiting in a collective sees this
            # rank's connections close (or its pid go) at once, not after the timeout
            logger.error("tensor-parallel rank stopped: %s: %s", type(error).__name__, error)
            logging.shutdown()
            os._exit(1)

    def _receive_blocks(self, ids: torch.Tensor, timeout: datetime.timedelta) -> None:
        config = self.loaded.config
        layers, _, _, block_size, _, dim = self.kv_cache.shape
        shape = (layers, 2, ids.numel(), block_size, config.num_kv_heads, dim)
        blocks = torch.empty(shape, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        _broadcast(self.group, blocks, timeout)
        write_heads(self.kv_cache, config, self.rank, self.size, ids, blocks)
