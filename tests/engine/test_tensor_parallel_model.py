"""The model layer of tensor parallelism, without Ray: two shards of a tiny random model
in two threads, joined by gloo or by the shared-memory collectives, each giving
transformers' logits for the same weights; and the shared-memory collectives alone."""

from __future__ import annotations

import datetime
import os
import socket
import threading

import pytest
import torch
import torch.distributed as dist

from tessera.workers.model.loader import load_model
from tessera.workers.model.shared_collectives import MAILBOX_BYTES, SharedCollectives, supported
from tessera.workers.model.tensor_parallel import Shard
from tests.helpers import prefill_logits, save_random_model

needs_shared = pytest.mark.skipif(not supported(), reason="shared-memory collectives: x86-64")


def gloo_groups(size: int) -> list:
    """``size`` gloo process groups of one group, made in threads of this process."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    groups: list = [None] * size

    def join(rank: int) -> None:
        timeout = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, size, options)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return groups


def in_threads(size: int, work) -> list:
    """``work(rank)`` in one thread per rank; their answers (a failure re-raised)."""
    answers: list = [None] * size
    errors: list = []

    def run(rank: int) -> None:
        try:
            answers[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    if errors:
        raise errors[0]
    return answers


@pytest.mark.parametrize("transport", ["gloo", pytest.param("shared", marks=needs_shared)])
def test_two_shards_give_transformers_logits(transport, tmp_path, smollm2):
    # a vocabulary of 500 over 2 ranks: the last rank's rows padded
    model = save_random_model(
        tmp_path, smollm2.tokenizer, "Qwen2Config", vocab_size=500, tie_word_embeddings=True
    )
    prompt = list(range(3, 40))
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    groups = gloo_groups(2)
    shared = [None, None]
    if transport == "shared":
        first = SharedCollectives.create(2, 1 << 20)
        shared = [first, SharedCollectives.attach(first.path, 1, 2, 1 << 20)]
        first.unlink()

    def work(rank: int) -> torch.Tensor:
        shard = Shard(rank, 2, groups[rank], shared=shared[rank])
        loaded = load_model(tmp_path, "float32", tokenizer=smollm2.tokenizer, shard=shard)
        assert loaded.model.config.vocab_size == 250
        logits = prefill_logits(loaded, prompt)
        assert shard.collectives == 2 * 2 + 2  # per layer 2, the embedding, the head
        return logits

    ours = in_threads(2, work)
    assert torch.equal(ours[0], ours[1])  # every rank reads the same logits
    torch.testing.assert_close(ours[0], expected, rtol=0, atol=1e-5)
    assert int(ours[0].argmax()) == int(expected.argmax())


@needs_shared
def test_shared_collectives_sum_in_rank_order_carry_messages_and_notice_a_dead_rank():
    size = 3
    first = SharedCollectives.create(size, 4096)
    views = [first] + [SharedCollectives.attach(first.path, r, size, 4096) for r in (1, 2)]
    first.unlink()
    assert not os.path.exists(first.path)
    values = [torch.randn(2, 100, dtype=torch.float64) for _ in range(size)]

    def work(rank: int):
        reduced = values[rank].clone()
        for _ in range(5):  # both sets of slots, reused
            reduced = values[rank].clone()
            views[rank].all_reduce(reduced, 10.0)
        gathered = views[rank].all_gather(values[rank], 10.0)
        return reduced, gathered

    answers = in_threads(size, work)
    expected = values[0] + values[1] + values[2]
    for reduced, gathered in answers:
        assert torch.equal(reduced, expected)
        assert torch.equal(gathered, torch.cat(values, dim=-1))
    assert not views[0].fits(torch.zeros(4097, dtype=torch.uint8))
    # a rank whose process is gone: the others' call fails instead of waiting forever
    # rank 0's messages: each rank takes each, in order; more ints than the mailbox holds
    # are refused (they go another way)
    messages = [([1, 2, 3], torch.arange(5)), ([4, 5, 6], torch.arange(100, 103))]

    def take(rank: int) -> list:
        if rank == 0:
            for header, ints in messages:
                assert views[0].post(header, ints, 10.0)
            too_many = torch.zeros(MAILBOX_BYTES // 8 + 1, dtype=torch.int64)
            return [views[0].post([7], too_many, 10.0)]
        header = torch.zeros(3, dtype=torch.int64)
        got = []
        for _ in messages:
            ints = views[rank].take(header, lambda n: torch.empty(n, dtype=torch.int64))
            got.append((header.tolist(), ints.tolist()))
        return got

    expected = [(h, ints.tolist()) for h, ints in messages]
    assert in_threads(size, take) == [[False], expected, expected]
    layout = views[2]._layout
    views[2]._words[layout.pid(2)] = 2**22 + 12345  # above Linux's highest pid: none such

    def survivor(rank: int) -> str:
        with pytest.raises(RuntimeError) as error:
            views[rank].all_reduce(torch.zeros(4), 30.0)
        return str(error.value)

    for message in in_threads(2, survivor):
        assert message == "shared-memory collective: rank 2 (pid 4206649) is gone"
