"""``--model`` as a Hugging Face repo id (``--revision``), ``--tokenizer`` and
``--chat-template``, through ``tessera generate`` and the engine: a repo id in a local hub
cache generates what its snapshot's path generates, each revision its own weights and its
own prefix-cache key, with no network."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.cluster.cli import main as cli_main
from tessera.workers.config import EngineConfig
from tessera.workers.engine.engine import Engine
from tessera.workers.model.loader import load_tokenizer
from tests.helpers import save_random_llama
from tests.hub_cache import cache_snapshot, commit_hash
from tests.scripted_model import save_scripted_model, scripted_tokenizer

PROMPT = "The capital of France is"
#: A chat template whose prompts look nothing like SmolLM2's.
TEMPLATE = "{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A hub cache holding ``Org/Tiny`` at revisions main and v2 (two tiny random
    Llamas over the built-in tokenizer), and the scripted model with a second tokenizer
    whose added tokens read ``<reason>`` and ``</reason>``."""
    root = tmp_path_factory.mktemp("sources")
    tokenizer = load_tokenizer(None)
    shape = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1)
    for revision, config in (("main", {}), ("v2", {"intermediate_size": 64})):
        files = root / f"tiny-{revision}"
        save_random_llama(files, tokenizer, **shape, **config)
        cache_snapshot(root / "hub", "Org/Tiny", commit_hash(revision), files, (revision,))
    reason = root / "reason-tokenizer"
    scripted_tokenizer(("<reason>", "</reason>")).save_pretrained(reason)
    (root / "template.jinja").write_text(TEMPLATE)
    return {
        "hub": root / "hub",
        "scripted": save_scripted_model(root / "scripted"),
        "reason": reason,
        "template": root / "template.jinja",
    }


@pytest.fixture
def hub(models, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(models["hub"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return models["hub"]


def snapshot(hub: Path, revision: str) -> Path:
    return hub / "models--Org--Tiny" / "snapshots" / commit_hash(revision)


def generate(capsys, *flags: str, prompt: str = PROMPT) -> str:
    """What ``tessera generate`` prints (greedy, exact mode, 8 tokens)."""
    argv = ["generate", "--prompt", prompt, "--max-tokens", "8", "--dtype", "float32"]
    assert cli_main([*argv, "--num-kv-blocks", "32", *flags]) == 0
    return capsys.readouterr().out


def test_generate_from_a_repo_id_equals_its_snapshot_path(hub, capsys):
    main = generate(capsys, "--model", "Org/Tiny")
    assert main == generate(capsys, "--model", str(snapshot(hub, "main")))
    v2 = generate(capsys, "--model", "Org/Tiny", "--revision", "v2")
    assert v2 == generate(capsys, "--model", str(snapshot(hub, "v2")))
    assert v2 == generate(capsys, "--model", "Org/Tiny", "--revision", commit_hash("v2"))
    assert main.strip() and v2 != main  # two revisions, two models


def test_a_missing_revision_is_a_usage_error_naming_it(hub, capsys):
    argv = ["generate", "--prompt", PROMPT, "--model", "Org/Tiny", "--revision", "v3"]
    assert cli_main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: model: 'Org/Tiny' is not a local path, and the Hugging Face cache "
        f"'{hub}' has no revision 'v3' of it (cached: main, v2); downloads are off "
        "(HF_HUB_OFFLINE is set)"
    )


def test_each_revision_has_its_own_prefix_cache_key(hub):
    keys = {
        revision: Engine(
            EngineConfig(model="Org/Tiny", revision=revision, num_kv_blocks=4)
        ).hash_keys
        for revision in ("main", "v2")
    }
    assert keys["main"][0] == str(snapshot(hub, "main"))
    assert keys["v2"][0] == str(snapshot(hub, "v2"))
    assert keys["main"][1:] == keys["v2"][1:]


def test_tokenizer_replaces_the_models_own(models, capsys):
    scripted = str(models["scripted"])
    assert generate(capsys, "--model", scripted) == "<think>abc</think>answer\n"
    override = generate(capsys, "--model", scripted, "--tokenizer", str(models["reason"]))
    assert override == "<reason>abc</reason>answer\n"  # the same tokens, read by the other


def test_chat_template_replaces_the_tokenizers_own(hub, models, capsys):
    question = "Name a colour"
    template = str(models["template"])
    chat = generate(capsys, "--model", "Org/Tiny", "--chat", "--chat-template", template,
                    prompt=question)  # fmt: skip
    rendered = f"<<user>> {question}\n<<assistant>>"
    assert chat == generate(capsys, "--model", "Org/Tiny", prompt=rendered)
    assert chat != generate(capsys, "--model", "Org/Tiny", "--chat", prompt=question)
    inline = generate(capsys, "--model", "Org/Tiny", "--chat", "--chat-template", TEMPLATE,
                      prompt=question)  # fmt: skip
    assert inline == chat
    engine = Engine(EngineConfig(model="Org/Tiny", chat_template=template, num_kv_blocks=4))
    assert engine.tokenizer.chat_template == TEMPLATE


def test_a_missing_chat_template_file_is_a_usage_error(hub, tmp_path, capsys):
    missing = tmp_path / "t.jinja"
    argv = ["generate", "--prompt", PROMPT, "--model", "Org/Tiny"]
    assert cli_main([*argv, "--chat-template", str(missing)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: chat_template: file '{missing}' does not exist (expected a Jinja chat "
        "template file, or the template itself, holding {% or {{)"
    )
