"""LoRA adapters in the engine against ``transformers`` + ``peft`` on the same weights:
several adapters and the base model batched in one step, a request waiting for a slot,
the adapter in the prefix-cache key, and the errors of adapters that cannot run."""

from __future__ import annotations

import json

import pytest

from tessera.workers.api import InvalidRequestError, LoraRef, SamplingParams
from tessera.workers.model.lora import adapter_digest
from tests.helpers import (
    DEFAULT_SHARE_ROWS,
    TransformersReference,
    assert_greedy_matches,
    random_adapters,
    run_engine,
    save_random_lora,
)

pytestmark = pytest.mark.slow

PROMPTS = ((5, 17, 99, 3, 42, 7, 11), (8, 8, 300, 21, 4), (77, 12, 9, 250, 31, 60, 2, 14, 90))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    """name -> (LoraRef, its PEFT model): ``random_adapters`` of the tiny Llama."""
    made = random_adapters(tiny_llama[1], tmp_path_factory.mktemp("loras"))
    return {
        name: (LoraRef(name, path, adapter_digest(path)), model)
        for name, (path, model) in made.items()
    }


def make_engine(tiny_llama, **config):
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    path, _ = tiny_llama
    fields = dict(model=str(path), num_kv_blocks=96, block_size=4, enable_lora=True, max_loras=2)
    return Engine(EngineConfig(**{**fields, **config}))


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def tokens(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def check_against_peft(tiny_llama, adapters, engine, which: list[str | None]) -> None:
    for k, name in enumerate(which):
        lora = None if name is None else adapters[name][0]
        engine.add_request(f"r{k}", list(PROMPTS[k % len(PROMPTS)]), greedy(), lora=lora)
    outputs = run_engine(engine)
    for k, name in enumerate(which):
        model = tiny_llama[1] if name is None else adapters[name][1]
        ref = TransformersReference(model).greedy(PROMPTS[k % len(PROMPTS)], MAX_TOKENS)
        assert_greedy_matches(tokens(outputs[f"r{k}"]), ref)


def test_the_adapters_change_the_greedy_tokens(tiny_llama, adapters):
    """(Else the tests below could not tell an adapter from the base model.)"""
    base = TransformersReference(tiny_llama[1]).greedy(PROMPTS[0], MAX_TOKENS).token_ids
    for _, model in adapters.values():
        assert TransformersReference(model).greedy(PROMPTS[0], MAX_TOKENS).token_ids != base


@pytest.mark.parametrize("native", [True, False], ids=["native", "op-by-op"])
@pytest.mark.parametrize("max_loras", [2, 8], ids=["masked", "by-slot"])
def test_adapters_and_the_base_model_batched_match_peft(tiny_llama, adapters, native, max_loras):
    """Two adapters in two slots: every row through both, masked; in two of eight slots:
    each adapter's rows (a run, or rows apart) through its own slot (``ROWS_BY_SLOT``)."""
    engine = make_engine(tiny_llama, native_decode=native, max_loras=max_loras)
    check_against_peft(tiny_llama, adapters, engine, ["first", None, "second", "first", "second"])
    assert not engine.loras.request_slots  # every slot unpinned at the end
    assert not engine.kv.tables  # no sequence holds a block


def test_a_request_waits_for_a_slot_and_still_matches(tiny_llama, adapters):
    engine = make_engine(tiny_llama, max_loras=1)
    check_against_peft(tiny_llama, adapters, engine, ["first", "second", "first", None])
    assert sorted(engine.loras.resident) == [adapters["first"][0].digest] or sorted(
        engine.loras.resident
    ) == [adapters["second"][0].digest]


def test_abort_of_a_request_waiting_for_a_slot(tiny_llama, adapters):
    engine = make_engine(tiny_llama, max_loras=1)
    engine.add_request("a", list(PROMPTS[0]), greedy(), lora=adapters["first"][0])
    engine.add_request("b", list(PROMPTS[1]), greedy(), lora=adapters["second"][0])
    engine.step()  # admits both: b waits for a's slot
    assert [len(engine.batcher.running), len(engine._lora_waiting)] == [1, 1]
    engine.abort("b")
    outputs = run_engine(engine)
    assert [o.finish_reason.value for o in outputs["b"]] == ["abort"]
    assert outputs["b"][0].token_ids == ()
    engine.add_request("b", list(PROMPTS[1]), greedy())  # its id is free again
    run_engine(engine)


def test_an_adapter_keys_its_own_prefix_cache_blocks(tiny_llama, adapters):
    engine = make_engine(tiny_llama)
    prompt = list(PROMPTS[2])
    engine.add_request("base", prompt, greedy())
    run_engine(engine)
    hits = engine.stats().prefix_cache.hits
    engine.add_request("adapted", prompt, greedy(), lora=adapters["first"][0])
    outputs = run_engine(engine)
    assert engine.stats().prefix_cache.hits == hits  # the base model's blocks are not its
    ref = TransformersReference(adapters["first"][1]).greedy(tuple(prompt), MAX_TOKENS)
    assert_greedy_matches(tokens(outputs["adapted"]), ref)
    engine.add_request("again", prompt, greedy(), lora=adapters["first"][0])
    outputs = run_engine(engine)
    assert engine.stats().prefix_cache.hits > hits  # but its own are
    assert_greedy_matches(tokens(outputs["again"]), ref)


def refused(engine, lora: LoraRef) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request("x", list(PROMPTS[0]), greedy(), lora=lora)
    assert caught.value.field == "model"
    return str(caught.value)


def test_adapters_that_cannot_run_are_refused_saying_why(tiny_llama, adapters, tmp_path):
    engine = make_engine(tiny_llama, max_lora_rank=4)
    ref = adapters["second"][0]
    assert refused(engine, ref).endswith(
        "LoRA adapter 'second': r: the adapter's rank 8 is over max_lora_rank 4"
    )
    missing = LoraRef("gone", str(tmp_path), "0" * 64)
    assert refused(engine, missing).endswith(
        f"LoRA adapter 'gone': no adapter_config.json in {str(tmp_path)!r}"
    )
    # an adapter of another base model (hidden 32, not 64)
    from tests.helpers import save_random_llama

    other = save_random_llama(tmp_path / "other", tiny_llama_tokenizer(tiny_llama), hidden_size=32)
    save_random_lora(tmp_path / "foreign", other, 3)
    path = str(tmp_path / "foreign")
    foreign = LoraRef("foreign", path, adapter_digest(path))
    assert refused(engine, foreign).endswith(
        "LoRA adapter 'foreign': layer 0's down_proj: lora_A is [4, 96] and lora_B [32, 4], "
        "the model needs [4, 96] and [64, 4] (rank 4; an adapter of another base model?)"
    )
    # files changed after the adapter was registered
    changed = LoraRef("first", adapters["first"][0].path, "f" * 64)
    assert refused(engine, changed).endswith(
        f"LoRA adapter 'first': its files in {changed.path!r} changed since it was loaded; "
        "load it again"
    )
    settings = json.loads((tmp_path / "foreign" / "adapter_config.json").read_text())
    settings["use_dora"] = True
    (tmp_path / "foreign" / "adapter_config.json").write_text(json.dumps(settings))
    assert refused(engine, LoraRef("d", path, adapter_digest(path))).endswith(
        "LoRA adapter 'd': use_dora: not supported"
    )


def test_an_engine_without_lora_refuses_an_adapter(tiny_llama, adapters):
    engine = make_engine(tiny_llama, enable_lora=False)
    assert refused(engine, adapters["first"][0]) == (
        "model: 'first' is a LoRA adapter and this worker serves none (start it with "
        "--enable-lora or --lora-modules)"
    )


def tiny_llama_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama[0])


def prompt_logprobs(engine, lora: LoraRef | None) -> list[float]:
    """Each prompt token's logprob (after the first) under ``lora``."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    engine.add_request("p", list(PROMPTS[2]), params, lora=lora)
    (first, *_) = run_engine(engine)["p"]
    return [entry.logprob for entry in first.prompt_logprobs[1:]]


@pytest.mark.parametrize("native", [True, False], ids=["native", "op-by-op"])
def test_bf16_slots_stay_within_bf16_rounding_of_float32_ones(tiny_llama, adapters, native):
    """The fast mode keeps the slots in bf16 (``Engine``: ``LoraSlots(dtype=bfloat16)``):
    the prompt's logprobs stay within bf16's rounding of the float32 slots', while the
    adapter moves them far more than that."""
    import torch

    from tessera.workers.model.lora import LoraSlots

    exact = make_engine(tiny_llama, native_decode=native)
    fast = make_engine(tiny_llama, native_decode=native)
    fast.loras.slots = LoraSlots(fast.loaded.model, 2, 16, torch.bfloat16)
    lora = adapters["first"][0]
    reference = torch.tensor(prompt_logprobs(exact, lora))
    rounded = torch.tensor(prompt_logprobs(fast, lora))
    base = torch.tensor(prompt_logprobs(exact, None))
    assert fast.loaded.model.layers[0].qkv_proj.lora_a.dtype == torch.bfloat16
    assert (rounded - reference).abs().max() < 0.02
    assert (base - reference).abs().max() > 0.2


def test_an_adapter_gone_before_its_request_starts_aborts_only_that_request(
    tiny_llama, adapters, tmp_path
):
    """Read at submit, dropped from memory, its folder deleted before a slot took it: the
    step aborts that request (finish_reason abort, no tokens) and the others run on."""
    import shutil

    path = tmp_path / "copy"
    shutil.copytree(adapters["first"][0].path, path)
    lora = LoraRef("copy", str(path), adapter_digest(str(path)))
    engine = make_engine(tiny_llama)
    engine.add_request("gone", list(PROMPTS[0]), greedy(), lora=lora)
    engine.add_request("base", list(PROMPTS[1]), greedy())
    engine.loras._read.clear()  # as past MAX_READ_ADAPTERS others
    shutil.rmtree(path)
    outputs = run_engine(engine)
    assert [(o.finish_reason.value, o.token_ids) for o in outputs["gone"]] == [("abort", ())]
    ref = TransformersReference(tiny_llama[1]).greedy(PROMPTS[1], MAX_TOKENS)
    assert_greedy_matches(tokens(outputs["base"]), ref)
    assert not engine.loras.request_slots and not engine.kv.tables


@pytest.fixture(scope="module")
def smollm2_adapters(hf_reference, tmp_path_factory):
    """``random_adapters`` of the built-in model (its GGUF as transformers dequantises it),
    "first" with B scaled by 4, not 20: through SmolLM2's 30 layers an adapter that strong
    turns float32 rounding (the order of a sum) into logprobs 0.01-0.05 apart, enough to
    flip a greedy token where transformers' top two are far from a tie."""
    made = random_adapters(
        hf_reference.model, tmp_path_factory.mktemp("smollm2-loras"), b_scale=4.0
    )
    return {
        name: (LoraRef(name, path, adapter_digest(path)), model)
        for name, (path, model) in made.items()
    }


def test_decodes_with_adapters_in_shares_of_rows_give_the_numbers_of_one_run(
    smollm2_path, hf_reference, smollm2_adapters
):
    """The built-in Q4 model on two threads: a step of decodes with adapters runs in
    shares of rows, each thread its rows and their adapters through every layer alone,
    fetching their LoRA weights ahead (``run_in_shares``, ``LoraSlots::queue_lines``),
    also with rows handed to the other thread (``hold_second_share``). The tokens and
    logprobs equal the run with the threads sharing each product bit for bit, and match
    peft in float32."""
    import torch

    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine
    from tessera.workers.quant.kernels import native_kernels

    native = native_kernels()
    if native is None or not native.tiled_f32_available():
        pytest.skip("no AVX-512 or AVX2 kernel on this CPU: no exact step runs in shares of rows")
    engine = Engine(
        EngineConfig(
            model=str(smollm2_path), dtype="float32", enable_lora=True, max_loras=2,
            num_kv_blocks=128,
        )
    )  # fmt: skip
    which = ["first", None, "second", "first", "second", None, "first", "second", "first", None]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)

    def generate() -> list[tuple[list[int], list[float]]]:
        for k, name in enumerate(which):
            lora = None if name is None else smollm2_adapters[name][0]
            engine.add_request(f"r{k}", list(PROMPTS[k % len(PROMPTS)]), params, lora=lora)
        outputs = run_engine(engine)
        return [
            (tokens(outputs[f"r{k}"]), [e.logprob for o in outputs[f"r{k}"] for e in o.logprobs])
            for k in range(len(which))
        ]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert native.use_row_shares(0) == 0
        expected = generate()
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        before = native.kv_prefetched_lines()
        assert generate() == expected
        assert native.kv_prefetched_lines() > before
        assert native.hold_second_share(True) is True
        for _ in range(5):
            handed = native.share_handovers()
            assert generate() == expected
            if native.share_handovers() > handed:
                break
        else:
            pytest.fail("no share was handed over in 5 runs")
    finally:
        native.hold_second_share(False)
        native.use_row_shares(DEFAULT_SHARE_ROWS)
        torch.set_num_threads(threads)
    assert expected[0][0] != expected[9][0]  # prompt 0: "first", the base model
    assert expected[2][0] != expected[5][0]  # prompt 2: "second", the base model
    for k, name in enumerate(which):
        reference = TransformersReference(smollm2_adapters[name][1]) if name else hf_reference
        assert_greedy_matches(expected[k][0], reference.greedy(PROMPTS[k % len(PROMPTS)], 6))
