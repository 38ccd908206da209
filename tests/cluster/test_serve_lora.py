"""Multi-LoRA through HTTP: a real `tessera serve` of a tiny Llama with an adapter from
`--lora-modules` and one loaded at runtime (`POST /v1/load_lora_adapter`), called with
the `openai` client. Greedy texts equal the in-process engine's with the same adapter
(held to `transformers` + `peft` in tests/engine/test_lora.py)."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tessera.workers.api import LoraRef, SamplingParams
from tessera.workers.model.lora import adapter_digest
from tests.cluster.serve_process import Server, serve_process
from tests.helpers import (
    random_adapters,
    run_engine,
    save_random_llama,
    save_random_lora,
    text_of,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

API_KEY = "lora-key-5d1c"
MODEL = "tiny-base"
NAMESPACE = "lora-test"
#: Token ids (the tiny model's vocabulary is the tokenizer's first 512 ids).
PROMPTS = ((5, 17, 99, 3, 42, 7, 11), (8, 8, 300, 21, 4), (77, 12, 9, 250, 31, 60, 2, 14, 90))
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    return random_adapters(tiny_llama[1], tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def server(ray_session, tiny_llama, adapters, tmp_path_factory) -> Server:
    settings = (
        f"model: {tiny_llama[0]}\n"
        f"served_model_name: {MODEL}\n"
        "workers: 1\n"
        "num_kv_blocks: 128\n"
        "block_size: 4\n"
        "device: cpu\n"
        "report_interval_s: 0.1\n"
        "max_loras: 2\n"
        "allow_runtime_lora_updating: true\n"
        f"lora_modules: ['first={adapters['first'][0]}']\n"
    )
    with serve_process(tmp_path_factory.mktemp("serve"), settings, API_KEY, NAMESPACE) as server:
        yield server


def engine_text(tiny_llama, prompt: tuple[int, ...], lora: LoraRef | None) -> str:
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    config = EngineConfig(
        model=str(tiny_llama[0]), num_kv_blocks=64, block_size=4, enable_lora=True
    )
    engine = Engine(config)
    engine.add_request(
        "ref", list(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora=lora
    )
    return text_of(run_engine(engine)["ref"])


def ref(adapters, name: str) -> LoraRef:
    path = adapters[name][0]
    return LoraRef(name, path, adapter_digest(path))


def complete(server: Server, model: str, prompt: tuple[int, ...]) -> openai.types.Completion:
    return server.client().completions.create(
        model=model, prompt=list(prompt), max_tokens=MAX_TOKENS, temperature=0
    )


def test_models_lists_the_base_model_and_its_adapters(server, adapters):
    cards = server.client().models.list().data
    assert [(c.id, c.model_extra["parent"]) for c in cards] == [(MODEL, None), ("first", MODEL)]
    assert cards[1].model_extra["root"] == adapters["first"][0]
    assert server.client().models.retrieve("first").id == "first"


def test_requests_choose_their_adapter_by_model_and_batch_together(server, tiny_llama, adapters):
    expected = {
        (name, prompt): engine_text(tiny_llama, prompt, ref(adapters, name) if name else None)
        for name in (None, "first")
        for prompt in PROMPTS
    }
    assert expected[None, PROMPTS[0]] != expected["first", PROMPTS[0]]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {key: pool.submit(complete, server, key[0] or MODEL, key[1]) for key in expected}
        done = {key: future.result() for key, future in futures.items()}
    for (name, prompt), answer in done.items():
        assert answer.choices[0].text == expected[name, prompt], (name, prompt)
        assert answer.model == (name or MODEL)


def test_an_adapter_loaded_and_unloaded_at_runtime(server, tiny_llama, adapters):
    with pytest.raises(openai.NotFoundError, match="model: 'second' is not served here"):
        complete(server, "second", PROMPTS[0])
    loaded = server.post(
        "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": adapters["second"][0]}
    )
    assert loaded.status_code == 200, loaded.text
    expected = engine_text(tiny_llama, PROMPTS[1], ref(adapters, "second"))
    assert complete(server, "second", PROMPTS[1]).choices[0].text == expected
    assert [c.id for c in server.client().models.list().data] == [MODEL, "first", "second"]

    gone = server.post("/v1/unload_lora_adapter", {"lora_name": "second"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError, match="model: 'second' is not served here"):
        complete(server, "second", PROMPTS[1])
    again = server.post("/v1/unload_lora_adapter", {"lora_name": "second"})
    assert again.status_code == 404
    assert again.json()["error"]["message"] == "lora_name: no LoRA adapter 'second' is loaded"


def test_bad_adapters_are_refused_naming_what_is_wrong(server, tiny_llama, tmp_path):
    def load(name: str, path: str) -> tuple[int, str]:
        answer = server.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        return answer.status_code, answer.json()["error"]["message"]

    assert load("empty", str(tmp_path)) == (
        400,
        f"lora_path: no adapter_config.json in {str(tmp_path)!r}",
    )
    save_random_lora(tmp_path / "wide", tiny_llama[1], 4, rank=32)
    assert load("wide", str(tmp_path / "wide")) == (
        400,
        "lora_path: LoRA adapter 'wide': r: the adapter's rank 32 is over max_lora_rank 16",
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama[0])
    other = save_random_llama(tmp_path / "other", tokenizer, num_hidden_layers=3)
    save_random_lora(tmp_path / "deep", other, 5)
    assert load("deep", str(tmp_path / "deep")) == (
        400,
        "lora_path: LoRA adapter 'deep': layer 2's down_proj: the model has 2 layers (an "
        "adapter of another base model?)",
    )
    assert load(MODEL, str(tmp_path / "wide")) == (
        400,
        f"lora_name: {MODEL!r} is the base model's name",
    )
    assert load("bad name", str(tmp_path)) == (
        400,
        "lora_name: must be 1-128 letters, digits or ._:/@+- (starting with a letter or "
        "digit), got 'bad name'",
    )
    assert [c.id for c in server.client().models.list().data] == [MODEL, "first"]
