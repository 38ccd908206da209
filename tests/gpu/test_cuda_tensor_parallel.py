"""Tensor parallelism over NCCL: two shards of a tiny random Qwen2, one per GPU in two
processes (no Ray: the model layer and ``join_group`` alone), each giving transformers'
logits for the same weights. Skipped without at least 2 GPUs."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.helpers import save_random_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def _rank(rank: int, port: int, path: str, prompt: list[int], out: dict) -> None:
    from tessera.workers.engine.tensor_parallel import join_group
    from tessera.workers.model.loader import load_model
    from tessera.workers.model.tensor_parallel import Shard
    from tests.helpers import prefill_logits

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = join_group("127.0.0.1", port, rank, 2, device, 120.0, _store(port, rank))
    loaded = load_model(path, "float32", device, shard=Shard(rank, 2, group))
    out[rank] = prefill_logits(loaded, prompt).cpu()


def _store(port: int, rank: int):
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=120)
    return dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)


def test_two_gpus_give_transformers_logits(tmp_path, smollm2):
    model = save_random_model(tmp_path, smollm2.tokenizer, "Qwen2Config")
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, str(tmp_path), prompt, out), nprocs=2, join=True)
        ours = [out[0], out[1]]
    assert torch.equal(ours[0], ours[1])
    torch.testing.assert_close(ours[0], expected, rtol=0, atol=1e-4)
