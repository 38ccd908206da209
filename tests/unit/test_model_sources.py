"""Model sources: a repo id resolves in a Hugging Face hub cache laid out as
``huggingface_hub`` writes it, at the revision asked for, with no network; a local path
wins; what is missing is an error naming the repo id, the revision and the cache;
downloads happen only where allowed; tokenizers and chat templates come from where
their settings say."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from tessera.cluster.cluster_config import ConfigError
from tessera.cluster.serve_config import ServeConfig
from tessera.workers.model import sources
from tessera.workers.model.loader import resolve_model_path
from tessera.workers.model.sources import (
    chat_template_text,
    hub_cache_dir,
    repo_id_of,
    resolve_tokenizer_path,
)
from tests.hub_cache import cache_snapshot, commit_hash

MAIN, V2 = commit_hash("main"), commit_hash("v2")


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A cache with ``Org/Name`` at two commits (refs main and v2) and ``Org/Tok`` (a
    tokenizer alone); HF_HUB_CACHE points at it, downloads are off."""
    cache = tmp_path / "hub"
    for commit, refs in ((MAIN, ("main",)), (V2, ("v2",))):
        files = tmp_path / f"files-{commit}"
        files.mkdir()
        (files / "config.json").write_text(f'{{"revision": "{refs[0]}"}}')
        (files / "model.safetensors").write_bytes(b"weights of " + refs[0].encode())
        cache_snapshot(cache, "Org/Name", commit, files, refs)
    files = tmp_path / "files-tok"
    files.mkdir()
    (files / "tokenizer.json").write_text("{}")
    cache_snapshot(cache, "Org/Tok", commit_hash("tok"), files, ("main",))
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local "Org/Name" here
    return cache


def snapshot(cache: Path, commit: str, repo: str = "models--Org--Name") -> Path:
    return cache / repo / "snapshots" / commit


def test_a_repo_id_resolves_to_the_snapshot_of_its_revision(hub):
    assert resolve_model_path("Org/Name") == snapshot(hub, MAIN)
    assert resolve_model_path("Org/Name", revision="main") == snapshot(hub, MAIN)
    assert resolve_model_path("Org/Name", revision="v2") == snapshot(hub, V2)
    assert resolve_model_path("Org/Name", revision=V2) == snapshot(hub, V2)  # a commit
    weights = resolve_model_path("Org/Name", revision="v2") / "model.safetensors"
    assert weights.is_symlink() and weights.read_bytes() == b"weights of v2"


def test_the_cache_is_where_huggingface_hub_keeps_it(tmp_path, monkeypatch):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old"))
    assert hub_cache_dir() == tmp_path / "old"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "new"))
    assert hub_cache_dir() == tmp_path / "new"


def test_hf_home_finds_the_same_snapshots(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub.parent))  # the fixture's cache is HF_HOME/hub
    assert resolve_model_path("Org/Name", revision="v2") == snapshot(hub, V2)


def test_a_local_path_that_exists_wins_over_a_repo_id(hub, tmp_path):
    local = tmp_path / "Org" / "Name"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    assert resolve_model_path("Org/Name") == Path("Org/Name")
    assert resolve_model_path("Org/Name", revision="v2") == Path("Org/Name")


def test_a_missing_revision_or_repo_is_an_error_naming_it_and_the_cache(hub):
    with pytest.raises(FileNotFoundError) as missing_revision:
        resolve_model_path("Org/Name", revision="v3")
    assert str(missing_revision.value) == (
        f"model: 'Org/Name' is not a local path, and the Hugging Face cache '{hub}' has "
        "no revision 'v3' of it (cached: main, v2); downloads are off (HF_HUB_OFFLINE is set)"
    )
    with pytest.raises(FileNotFoundError) as missing_repo:
        resolve_model_path("Org/Other")
    assert str(missing_repo.value) == (
        f"model: 'Org/Other' is not a local path, and the Hugging Face cache '{hub}' has "
        "no revision 'main' of it; downloads are off (HF_HUB_OFFLINE is set)"
    )


@pytest.mark.parametrize("name", ["./Org/Name", "/no/such/model", "a/b/c", "x.gguf", "a--b"])
def test_a_name_that_is_no_repo_id_is_a_missing_path(hub, name):
    assert repo_id_of(name) is None
    with pytest.raises(FileNotFoundError, match=r"^model: path '.*' does not exist$"):
        resolve_model_path(name)


@pytest.mark.parametrize("revision", ["../refs", "/etc", ""])
def test_a_revision_that_is_no_ref_is_refused(hub, revision):
    with pytest.raises(ValueError, match="^revision: must be a branch, tag or commit hash"):
        resolve_model_path("Org/Name", revision=revision)


def fake_hub_module(monkeypatch, snapshot_download) -> list[dict]:
    """A ``huggingface_hub`` whose ``snapshot_download`` is ``snapshot_download``;
    the calls it gets."""
    calls: list[dict] = []

    def download(repo_id, **kwargs):
        calls.append({"repo_id": repo_id, **kwargs})
        return snapshot_download(repo_id, **kwargs)

    monkeypatch.setitem(
        sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=download)
    )
    monkeypatch.setattr(sources, "downloads_allowed", lambda: True)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    return calls


def test_where_allowed_a_missing_revision_is_downloaded_into_the_cache(hub, tmp_path, monkeypatch):
    def snapshot_download(repo_id, revision, cache_dir, allow_patterns):
        files = tmp_path / "downloaded"
        files.mkdir()
        (files / "config.json").write_text("{}")
        return str(cache_snapshot(cache_dir, repo_id, commit_hash("v3"), files, (revision,)))

    calls = fake_hub_module(monkeypatch, snapshot_download)
    assert resolve_model_path("Org/Name") == snapshot(hub, MAIN)  # cached: no download
    assert calls == []
    assert resolve_model_path("Org/Name", revision="v3") == snapshot(hub, commit_hash("v3"))
    assert calls == [
        {
            "repo_id": "Org/Name",
            "revision": "v3",
            "cache_dir": hub,
            "allow_patterns": list(sources.DOWNLOAD_PATTERNS),
        }
    ]
    assert resolve_model_path("Org/Name", revision="v3") == snapshot(hub, commit_hash("v3"))
    assert len(calls) == 1  # now cached


def test_a_failed_download_is_an_error_naming_why(hub, monkeypatch):
    def snapshot_download(repo_id, **kwargs):
        raise OSError("network is unreachable")

    fake_hub_module(monkeypatch, snapshot_download)
    with pytest.raises(FileNotFoundError) as failed:
        resolve_model_path("Org/Name", revision="v3")
    assert str(failed.value) == (
        f"model: 'Org/Name' is not a local path, and the Hugging Face cache '{hub}' has "
        "no revision 'v3' of it (cached: main, v2); downloading it failed: OSError: "
        "network is unreachable"
    )


def test_without_huggingface_hub_the_error_says_so(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(sources, "downloads_allowed", lambda: False)
    with pytest.raises(FileNotFoundError, match="; downloads need the huggingface_hub package$"):
        resolve_model_path("Org/Other")


def test_a_tokenizer_comes_from_a_directory_a_repo_id_or_a_gguf(hub, tmp_path):
    assert resolve_tokenizer_path("Org/Tok") == snapshot(
        hub, commit_hash("tok"), "models--Org--Tok"
    )
    with pytest.raises(FileNotFoundError) as missing:
        resolve_tokenizer_path("Org/None")
    assert str(missing.value).startswith("tokenizer: 'Org/None' is not a local path")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as no_files:
        resolve_tokenizer_path(str(empty))
    assert str(no_files.value) == (
        f"tokenizer: directory '{empty}' has no tokenizer files (tokenizer.json, "
        "tokenizer_config.json, tokenizer.model) and 0 .gguf files (need one)"
    )
    (empty / "model.gguf").write_bytes(b"")
    assert resolve_tokenizer_path(str(empty)) == empty / "model.gguf"


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    assert chat_template_text(template) == template
    assert chat_template_text("{{ messages[0].content }}") == "{{ messages[0].content }}"
    file = tmp_path / "t.jinja"
    file.write_text(template)
    assert chat_template_text(str(file)) == template
    with pytest.raises(FileNotFoundError) as missing:
        chat_template_text(str(tmp_path / "none.jinja"))
    assert str(missing.value) == (
        f"chat_template: file '{tmp_path / 'none.jinja'}' does not exist (expected a Jinja "
        "chat template file, or the template itself, holding {% or {{)"
    )


def test_a_served_repo_id_is_its_model_name(hub):
    assert ServeConfig.create(model="Org/Name").model_name == "Org/Name"
    assert ServeConfig.create(model="Org/Name", served_model_name="m").model_name == "m"


def test_the_cluster_checks_sources_before_it_starts(hub, tmp_path):
    from tessera.cluster.environment import check_environment

    check_environment(ServeConfig.create(model="Org/Name", revision="v2", tokenizer="Org/Tok"))
    with pytest.raises(ConfigError, match="^model: 'Org/Name' is not a local path.*'v3'"):
        check_environment(ServeConfig.create(model="Org/Name", revision="v3"))
    with pytest.raises(ConfigError, match="^tokenizer: 'Org/Gone' is not a local path"):
        check_environment(ServeConfig.create(model="Org/Name", tokenizer="Org/Gone"))
    missing = tmp_path / "none.jinja"
    with pytest.raises(ConfigError, match=f"^chat_template: file '{missing}' does not exist"):
        check_environment(ServeConfig.create(model="Org/Name", chat_template=str(missing)))
