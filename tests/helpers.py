"""Helpers shared by the tests: the transformers reference and engine drivers."""

from __future__ import annotations

import asyncio
import functools
import inspect
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tessera.workers.api import (
    ParallelTokensParams,
    Request,
    RequestOutput,
    SamplingParams,
    SpeculativeParams,
)
from tessera.workers.engine.model_runner import ModelRunner
from tessera.workers.engine.sequence import Sequence
from tessera.workers.kv.kv_cache import allocate_kv_cache
from tessera.workers.kv.manager import KVCacheManager

#: The exactness contract (docs/architecture.md): a greedy divergence from transformers
#: is acceptable only at a step where the reference's top-2 logit gap is below this.
NEAR_TIE_GAP = 1e-4
#: Channel sockets are Linux's abstract Unix sockets (elsewhere channels are Ray streams).
ABSTRACT_SOCKETS = sys.platform == "linux"  # a worker's channel socket is one of Linux's
LINUX_ONLY = pytest.mark.skipif(not ABSTRACT_SOCKETS, reason="Linux's abstract sockets")
#: The Ray namespace of the tests' named actors (``ray_session`` in conftest.py).
RAY_NAMESPACE = "tessera-tests"

torch.manual_seed(0)


@dataclass(frozen=True)
class Reference:
    token_ids: tuple[int, ...]
    top2_gaps: tuple[float, ...]  # reference's logit gap between its top two, per step


class TransformersReference:
    """transformers' greedy decoding of the same weights, float32, one prompt at a time."""

    def __init__(self, model) -> None:
        self.model = model

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one instance per session
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
        # A plain greedy loop over transformers' forward with its KV cache: generate()
        # would stop at EOS or mask it (min_new_tokens), while ignore_eos keeps going.
        tokens, gaps = [], []
        # dynamic NTK RoPE keeps the longest length it has seen (transformers' rotary
        # state outlives a sequence): each prompt starts from the model's fresh state
        rotary = getattr(getattr(self.model, "model", None), "rotary_emb", None)
        if hasattr(rotary, "original_inv_freq"):
            rotary.inv_freq.copy_(rotary.original_inv_freq)
            rotary.max_seq_len_cached = rotary.original_max_seq_len
        with torch.no_grad():
            out = self.model(torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(max_new_tokens):
                logits = out.logits[0, -1].float()
                top2 = logits.topk(2).values
                gaps.append(float(top2[0] - top2[1]))
                tokens.append(int(logits.argmax()))
                out = self.model(
                    torch.tensor([[tokens[-1]]]),
                    cache=out.cache,
                    use_cache=True,
                )
        return Reference(tuple(tokens), tuple(gaps))


#: Rows a share of a decode step takes at least by default (``use_row_shares``;
#: csrc/decode_shares.h's ``share_rows``), restored after each test that changes it.
DEFAULT_SHARE_ROWS = 4


def assert_greedy_matches(ours: list[int] | tuple[int, ...], ref: Reference) -> None:
    """Token-identical, or diverging only where the reference had a near-tie (the
    exactness contract, docs/architecture.md)."""
    ours = list(ours)
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if a != b:
            assert ref.top2_gaps[i] < NEAR_TIE_GAP, (
                f"diverged at token {i}: ours {a}, transformers {b}, reference top-2 gap "
                f"{ref.top2_gaps[i]:.3g} >= {NEAR_TIE_GAP}"
            )
            return  # after a legitimate near-tie split the continuations may differ
    assert len(ours) == len(ref.token_ids), f"lengths differ: {len(ours)} vs {len(ref.token_ids)}"


def run_engine(
    engine, check: bool = True, max_steps: int = 10_000
) -> dict[str, list[RequestOutput]]:
    """Step until idle, checking the pool's integrity after every step."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        if check:
            engine.check_integrity()
    raise AssertionError(f"engine still busy after {max_steps} steps")


def engine_outputs(engine, requests) -> dict[str, list[RequestOutput]]:
    """The reference for a cluster's streams: ``requests`` ((id, prompt, params)) added
    together to one in-process engine, stepped until idle."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    return run_engine(engine)


async def read_through_a_fault(
    streams: list[AsyncIterator[RequestOutput]],
    fault: Callable[[], object],
    start_timeout_s: float,
    end_timeout_s: float,
    tokens_before: int = 3,
) -> list[list[RequestOutput]]:
    """Read every stream to its end; call ``fault()`` (a worker killed, a node removed:
    not a coroutine function) as soon as each stream has given ``tokens_before`` tokens,
    and fail if one had ended or failed by then (the fault must come mid-stream) or if
    that took over ``start_timeout_s``. Each stream's deltas, in order; the readers are
    cancelled if anything fails."""
    received: list[list[RequestOutput]] = [[] for _ in streams]
    all_started = asyncio.Event()

    async def drain(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        async for delta in stream:
            received[i].append(delta)
            if all(len(tokens_of(r)) >= tokens_before for r in received):
                all_started.set()

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    started = asyncio.ensure_future(all_started.wait())
    try:
        done, _ = await asyncio.wait(
            [started, *tasks], timeout=start_timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for task in done - {started}:
            task.result()  # a stream's own error, if it failed
        assert started in done, f"not every stream gave {tokens_before} tokens in time"
        assert not any(r[-1].finished for r in received), "the fault must come mid-stream"
        acted = fault()  # not inside the assert: python -O would drop the call
        assert not inspect.isawaitable(acted), "fault must act when called"
        await asyncio.wait_for(asyncio.gather(*tasks), end_timeout_s)
    finally:
        for task in (started, *tasks):
            task.cancel()
    return received


def tokens_of(deltas: list[RequestOutput]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def text_of(deltas: list[RequestOutput]) -> str:
    return "".join(d.text for d in deltas)


def prefill_logits(loaded, prompt: list[int], block_size: int = 16) -> torch.Tensor:
    """Our float32 next-token logits after prefilling ``prompt`` in one step through the
    paged KV cache (no engine, no sampling): the model layer alone."""
    num_blocks = -(-len(prompt) // block_size)
    kv = KVCacheManager(num_blocks, block_size)
    cache = allocate_kv_cache(
        loaded.model.config, num_blocks, block_size, torch.float32, torch.device("cpu")
    )
    runner = ModelRunner(loaded.model, kv, cache)
    seq = Sequence(
        Request("s", tuple(prompt)),
        seed=0,
        token_ids=list(prompt),
        detokenizer=None,
        stop_matcher=None,
    )
    assert kv.allocate("s", len(prompt))
    logits = runner.execute([seq.chunk(len(prompt))])
    kv.check_integrity()
    return logits[0]


#: A prompt that repeats itself, so that prompt-lookup drafts get accepted.
REPEATING_PROMPT = "Repeat after me: the lighthouse keeper climbed the stairs. Again: the"


def multi_row_requests(forks: bool = True) -> dict[str, SamplingParams]:
    """One request per way a sequence puts several rows into a step: ngram and draft
    speculation (the engine needs a ``draft_model``), parallel tokens and n > 1 forks."""
    greedy = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    requests = {
        "ngram": SamplingParams(speculative=SpeculativeParams("ngram", 4), **greedy),
        "draft": SamplingParams(speculative=SpeculativeParams("draft", 3), **greedy),
        "parallel": SamplingParams(parallel_tokens=ParallelTokensParams(0.05, 3), **greedy),
    }
    if forks:
        requests["forks"] = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=16)
    return requests


def run_multi_row(engine, requests: dict[str, SamplingParams]) -> tuple:
    """Run ``requests`` on ``REPEATING_PROMPT``: each one's tokens, the parallel sets and
    the forks' outputs, for comparing two engines."""
    for rid, params in requests.items():
        engine.add_request(rid, REPEATING_PROMPT, params)
    out = run_engine(engine)
    sets = [s.token_ids for d in out["parallel"] for s in d.parallel_sets]
    forks = sorted((d.index, tuple(d.token_ids)) for d in out.get("forks", ()) if d.token_ids)
    return {rid: tokens_of(out[rid]) for rid in requests}, sets, forks


#: The tests' tiny random models: vocab 512, 2 layers, 4 heads over 2 KV heads.
TINY_FIELDS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def save_random_model(path: Path, tokenizer, config_class: str = "LlamaConfig", **config):
    """A random model of transformers' ``config_class`` (``TINY_FIELDS``, overridden by
    ``config``), seeded, saved with ``tokenizer`` as a Hugging Face directory at ``path``;
    returns the transformers model that wrote it, in eval mode."""
    import transformers

    torch.manual_seed(0)
    made = getattr(transformers, config_class)(**{**TINY_FIELDS, **config})
    model = transformers.AutoModelForCausalLM.from_config(made, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval()


def save_random_llama(path: Path, tokenizer, **config):
    """A random Llama (GQA, vocab 512, 2 layers; ``config`` overrides LlamaConfig fields)
    saved with ``tokenizer`` as a Hugging Face directory at ``path``; returns the
    transformers model that wrote it."""
    return save_random_model(path, tokenizer, "LlamaConfig", **config)


def weights_digest(model: torch.nn.Module) -> int:
    """A CRC-32 over the bytes of every storage reachable from ``model`` (its weights,
    packed weights and tables), each storage once, in the order they are reached (not by
    address: a storage may move, as ``move_to_huge_pages`` moves them): what a test that
    shares a loaded model must leave as it found it."""
    from tessera.workers.hugepages import reachable_tensors

    storages = {}
    for tensor in reachable_tensors(model):
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[(storage.data_ptr(), storage.nbytes())] = storage
    crc = 0
    for storage in storages.values():
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        crc = zlib.crc32(whole.numpy().data, crc)
    return crc


#: Every projection a LoRA adapter may target (PEFT's module names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_random_lora(
    path: Path,
    hf_model,
    seed: int,
    rank: int = 4,
    alpha: int = 8,
    b_scale: float = 20.0,
    **config,
):
    """A PEFT LoRA adapter of ``hf_model`` with random A and B (``init_lora_weights=False``,
    B scaled up by ``b_scale`` so the adapter changes the greedy tokens), saved at
    ``path`` by ``save_pretrained``; returns the PEFT model (over a copy of
    ``hf_model``): the reference for that adapter."""
    import copy

    import peft

    torch.manual_seed(seed)
    fields = dict(
        r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), init_lora_weights=False
    )
    lora = peft.LoraConfig(**{**fields, **config})
    model = peft.get_peft_model(copy.deepcopy(hf_model), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(path)
    return model.eval()


def random_adapters(hf_model, root: Path, b_scale: float = 20.0) -> dict[str, tuple[str, object]]:
    """Two PEFT adapters of ``hf_model`` under ``root``: "first" (rank 4, every
    projection, B scaled by ``b_scale``) and "second" (rank 8, rsLoRA, q/v/o only): name
    -> (folder, the PEFT model that is its reference)."""
    made = {}
    for name, seed, extra in (
        ("first", 1, dict(rank=4, alpha=8, b_scale=b_scale)),
        (
            "second",
            2,
            dict(rank=8, alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "o_proj"]),
        ),
    ):
        path = root / f"lora-{name}"
        made[name] = (str(path), save_random_lora(path, hf_model, seed, **extra))
    return made
