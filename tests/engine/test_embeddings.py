"""Embeddings (``Engine.embed``) against transformers' final hidden states pooled the
same way: several inputs of different lengths in one call, whole and chunked, last and
mean pooling, normalised or not; no KV block held afterwards; the 400s' fields."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tessera.workers.api import InvalidRequestError
from tessera.workers.validation import MAX_EMBEDDING_INPUTS

pytestmark = pytest.mark.slow

LENGTHS = (1, 5, 13, 30)


def reference(hf_model, inputs: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last hidden state (after the final norm: checked below against the
    norm applied to the last layer's output), one input at a time, pooled."""
    pooled = []
    with torch.no_grad():
        for tokens in inputs:
            out = hf_model(torch.tensor([tokens]), output_hidden_states=True)
            states = out.hidden_states[-1][0]  # [T, hidden]
            pooled.append(states.mean(0) if pooling == "mean" else states[-1])
    result = torch.stack(pooled).float()
    return torch.nn.functional.normalize(result, dim=-1) if normalize else result


def random_inputs(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in LENGTHS]


def test_hf_last_hidden_state_is_after_the_final_norm(tiny_llama):
    _, hf_model = tiny_llama
    tokens = torch.tensor([random_inputs(0)[2]])
    with torch.no_grad():
        out = hf_model(tokens, output_hidden_states=True)
        logits = hf_model.lm_head(out.hidden_states[-1])
    torch.testing.assert_close(logits, out.logits, atol=0, rtol=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked"])
def test_embeddings_match_transformers(tiny_llama, pooling, normalize, budget):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, hf_model = tiny_llama
    config = EngineConfig(
        model=str(path),
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=budget,
        embedding_pooling=pooling,
        embedding_normalize=normalize,
    )
    engine = Engine(config)
    inputs = random_inputs(1)
    ours = engine.embed(inputs)
    expected = reference(hf_model, inputs, pooling, normalize)
    assert ours.shape == (len(inputs), hf_model.config.hidden_size)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    # no block held afterwards, and the pool's invariants hold
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.pool.num_blocks
    assert not engine.kv.tables


def test_embeddings_of_smollm2_match_transformers(make_engine, hf_reference):
    """The built-in model, exact mode, last pooling normalised (the defaults)."""
    engine = make_engine()
    inputs = [engine.tokenize(text) for text in ("Hello there.", "A longer sentence " * 5)]
    expected = reference(hf_reference.model, inputs, "last", True)
    torch.testing.assert_close(engine.embed(inputs), expected, atol=1e-5, rtol=1e-5)
    engine.check_integrity()
    assert not engine.kv.tables


def test_embedding_input_errors_name_the_field(tiny_llama):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, _ = tiny_llama
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=4))
    cases = [
        ([], "input", "must not be empty"),
        ([[5], []], "input[1]", "must not be empty"),
        ([[5]] * (MAX_EMBEDDING_INPUTS + 1), "input", f"got {MAX_EMBEDDING_INPUTS + 1}"),
        ([[5] * 257], "input[0]", "more than the model's context of 256 tokens"),
        ([[5, 512]], "input[0]", "token id 512 is out of the vocabulary [0, 512)"),
    ]
    for inputs, field, message in cases:
        with pytest.raises(InvalidRequestError) as caught:
            engine.embed(inputs)
        assert caught.value.field == field
        assert message in caught.value.message
    assert not engine.kv.tables


@pytest.mark.parametrize("static_decode", ["off", "eager"])
def test_embeddings_op_by_op_match_transformers(tiny_llama, static_decode):
    """Without the native stack (every layer op by op), and with the static decode path
    on (an input of one token must not take it: it has no hidden states to give)."""
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, hf_model = tiny_llama
    config = EngineConfig(
        model=str(path),
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=16,
        native_decode=False,
        embedding_pooling="mean",
    )
    engine = Engine(config)
    runner = engine.runner
    engine.runner = type(runner)(
        engine.loaded.model, engine.kv, runner.kv_cache, static_decode=static_decode
    )
    inputs = random_inputs(2)
    expected = reference(hf_model, inputs, "mean", True)
    torch.testing.assert_close(engine.embed(inputs), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(engine.embed([[7]]), reference(hf_model, [[7]], "mean", True))
    engine.check_integrity()
    assert not engine.kv.tables


def test_an_input_over_the_kv_pool_is_refused_and_the_others_freed(tiny_llama):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, hf_model = tiny_llama
    engine = Engine(EngineConfig(model=str(path), num_kv_blocks=4, block_size=4))
    with pytest.raises(InvalidRequestError) as caught:
        engine.embed([[5] * 9, [6] * 17])  # the pool holds 16 tokens
    assert caught.value.field == "input[1]"
    assert caught.value.message == "17 tokens, more than the KV pool's 16"
    engine.check_integrity()
    assert not engine.kv.tables and engine.kv.num_free_blocks == 4
    inputs = [[5] * 9, [6] * 16, [7] * 3]  # one after another: each fits alone
    expected = reference(hf_model, inputs, "last", True)
    torch.testing.assert_close(engine.embed(inputs), expected, atol=1e-5, rtol=1e-5)
    assert not engine.kv.tables


def interleaving_engine(tiny_llama):
    """The tiny Llama with a budget of 8 tokens a forward: ``random_inputs`` take 7
    forwards, and their 30-token input holds blocks across 4 of them."""
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, _ = tiny_llama
    fields = dict(model=str(path), num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    return Engine(EngineConfig(**fields, embedding_pooling="mean"))


GENERATION = (11, 40, 7, 300, 5)


def test_embedding_forwards_go_between_generation_steps(tiny_llama):
    """A job's forwards alternate with a request's steps: between them its inputs hold
    their blocks and the engine's invariants hold (the job's sequences counted); the
    embeddings are transformers' and the request's tokens are those it gets alone."""
    from tessera.workers.api import SamplingParams
    from tessera.workers.engine.embedding import SEQ_PREFIX
    from tests.helpers import run_engine

    _, hf_model = tiny_llama
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = interleaving_engine(tiny_llama)
    alone.add_request("gen", list(GENERATION), greedy)
    expected_tokens = [t for out in run_engine(alone)["gen"] for t in out.token_ids]

    engine = interleaving_engine(tiny_llama)
    engine.add_request("gen", list(GENERATION), greedy)
    inputs = random_inputs(2)
    job = engine.start_embedding(inputs)
    outputs, held_between = [], 0
    while not job.finished:
        engine.embedding_forward(job)
        held = [seq for seq in engine.kv.tables if seq.startswith(SEQ_PREFIX)]
        held_between += bool(held)
        engine.check_integrity()
        outputs.extend(engine.step())
    engine.end_embedding(job)
    while engine.has_work():
        outputs.extend(engine.step())
    assert held_between >= 3
    torch.testing.assert_close(job.result(), reference(hf_model, inputs, "mean", True))
    assert [t for out in outputs for t in out.token_ids] == expected_tokens
    engine.check_integrity()
    assert not engine.kv.tables


async def test_an_embedding_cancelled_between_forwards_frees_its_blocks(tiny_llama):
    """``AsyncEngine.embed`` runs a forward per ``run`` call while a request steps; its
    caller cancelled while the inputs hold blocks, every block is freed, the request
    goes on to its own tokens, and the next embedding is transformers'."""
    from tessera.workers.api import SamplingParams
    from tessera.workers.engine.async_engine import AsyncEngine
    from tessera.workers.engine.embedding import SEQ_PREFIX

    _, hf_model = tiny_llama
    inner = interleaving_engine(tiny_llama)
    engine = AsyncEngine(inner)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    stream = await engine.add_request("gen", list(GENERATION), greedy)
    first = await anext(stream)
    steps = inner.num_steps
    task = asyncio.create_task(engine.embed(random_inputs(3)))
    while not any(seq.startswith(SEQ_PREFIX) for seq in inner.kv.tables):
        assert not task.done()
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not [seq for seq in inner.kv.tables if seq.startswith(SEQ_PREFIX)]
    await engine.run(inner.check_integrity)
    inputs = random_inputs(4)
    vectors = await engine.embed(inputs)
    torch.testing.assert_close(vectors, reference(hf_model, inputs, "mean", True))
    rest = [delta async for delta in stream]
    assert len([t for out in (first, *rest) for t in out.token_ids]) == 30
    assert inner.num_steps > steps
    await engine.run(inner.check_integrity)
    assert not inner.kv.tables
    await engine.close()
