"""Where a model, a tokenizer or a chat template comes from.

``--model`` and ``--tokenizer`` take a local path or a Hugging Face repo id
(``Qwen/Qwen3-0.6B``). A local path that exists always wins. A repo id is read from the
local Hugging Face cache at a revision (a branch, a tag or a commit hash), laid out as
``huggingface_hub`` writes it::

    <cache>/models--Org--Name/
        refs/<revision>          the commit hash the branch or tag points at
        snapshots/<commit>/...   that commit's files

so a cached model needs no network. Where downloads are allowed (``huggingface_hub``
installed, ``HF_HUB_OFFLINE`` unset), a revision the cache lacks is fetched with
``snapshot_download`` (with its progress bars); otherwise the error names the repo id,
the revision and the cache searched.

The cache is where ``huggingface_hub`` keeps it: ``HF_HUB_CACHE``, else
``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub`` (``~/.cache/huggingface/hub``). The environment is
read at each call, not at import, so every process resolves as its own environment says.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

#: The revision a repo id means without ``--revision``.
DEFAULT_REVISION = "main"
#: A Hugging Face repo id: ``name`` or ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
#: A branch, a tag (``v1.0``, ``refs/pr/1``) or a commit hash.
_REVISION = re.compile(r"[A-Za-z0-9._-][A-Za-z0-9._/-]*")
#: A full commit hash, which names a snapshot directly.
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: The files a download fetches: weights as safetensors or GGUF, configs, tokenizers,
#: chat templates (not a repository's other weight formats or its ``original/`` copies).
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.gguf", "*.model", "*.txt", "*.jinja",
                     "*.tiktoken")  # fmt: skip
#: What ``huggingface_hub`` reads as true in ``HF_HUB_OFFLINE``.
_TRUE = ("1", "ON", "YES", "TRUE")
#: The files of a Hugging Face tokenizer (a directory with one of them is a tokenizer).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Text that makes ``chat_template`` a template rather than a file name (as vLLM reads it).
_TEMPLATE_MARKS = ("{%", "{{")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache of this process's environment."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return cache / "huggingface" / "hub"


def repo_id_of(name: str) -> str | None:
    """The Hugging Face repo id ``name`` stands for, or None: it is a local path that
    exists, or not spelled as a repo id (``./x``, ``/x``, ``a/b/c``, ``x.gguf``)."""
    if Path(name).expanduser().exists() or name.endswith(".gguf"):
        return None
    if not _REPO_ID.fullmatch(name) or "--" in name or ".." in name:
        return None
    return name


def downloads_allowed() -> bool:
    """Whether a revision the cache lacks may be fetched: ``huggingface_hub`` is
    installed and ``HF_HUB_OFFLINE`` is not set."""
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        return False
    return importlib.util.find_spec("huggingface_hub") is not None


def resolve_source(name: str, revision: str = DEFAULT_REVISION, field: str = "model") -> Path:
    """The local path ``name`` names: itself if it exists, else the snapshot of repo id
    ``name`` at ``revision`` in the hub cache (downloaded first where allowed).
    ``FileNotFoundError`` naming ``field`` (and for a repo id, the revision and the
    cache) otherwise."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    repo_id = repo_id_of(name)
    if repo_id is None:
        raise FileNotFoundError(f"{field}: path {str(path)!r} does not exist")
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision) or ".." in revision:
        raise ValueError(f"revision: must be a branch, tag or commit hash, got {revision!r}")
    cache = hub_cache_dir()
    snapshot = cached_snapshot(cache, repo_id, revision)
    if snapshot is not None:
        return snapshot
    if os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE:
        why = "downloads are off (HF_HUB_OFFLINE is set)"
    elif not downloads_allowed():
        why = "downloads need the huggingface_hub package"
    else:
        try:
            return _download(cache, repo_id, revision)
        except Exception as error:  # network, authentication, an unknown repo or revision
            why = f"downloading it failed: {type(error).__name__}: {error}"
    cached = sorted(_cached_refs(cache, repo_id))
    has = f" (cached: {', '.join(cached)})" if cached else ""
    raise FileNotFoundError(
        f"{field}: {repo_id!r} is not a local path, and the Hugging Face cache "
        f"{str(cache)!r} has no revision {revision!r} of it{has}; {why}"
    )


def resolve_tokenizer_path(name: str) -> Path:
    """The directory or .gguf file of the tokenizer ``name`` names (``--tokenizer``: a
    local path, or a repo id at its main revision); ``FileNotFoundError`` or
    ``ValueError`` naming the field otherwise."""
    path = resolve_source(name, DEFAULT_REVISION, "tokenizer")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"tokenizer: {str(path)!r} is neither a directory nor a .gguf file")
        return path
    if any((path / file).exists() for file in _TOKENIZER_FILES):
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise FileNotFoundError(
            f"tokenizer: directory {str(path)!r} has no tokenizer files "
            f"({', '.join(_TOKENIZER_FILES)}) and {len(ggufs)} .gguf files (need one)"
        )
    return ggufs[0]


def cached_snapshot(cache: Path, repo_id: str, revision: str) -> Path | None:
    """The snapshot directory of ``repo_id`` at ``revision`` (a ref's name or a commit
    hash) in ``cache``, if it holds one with a model or tokenizer in it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    if not _COMMIT.fullmatch(commit):
        return None
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir() or not _holds_files(snapshot):
        return None
    return snapshot


def _holds_files(snapshot: Path) -> bool:
    """A snapshot a download finished: a config, a tokenizer or a GGUF file in it."""
    names = ("config.json", *_TOKENIZER_FILES)
    return any((snapshot / name).exists() for name in names) or any(snapshot.glob("*.gguf"))


def _cached_refs(cache: Path, repo_id: str) -> list[str]:
    refs = cache / ("models--" + repo_id.replace("/", "--")) / "refs"
    if not refs.is_dir():
        return []
    return [ref.relative_to(refs).as_posix() for ref in refs.rglob("*") if ref.is_file()]


def _download(cache: Path, repo_id: str, revision: str) -> Path:
    from huggingface_hub import snapshot_download

    logger.warning("downloading %s at revision %s into %s", repo_id, revision, cache)
    folder = snapshot_download(
        repo_id, revision=revision, cache_dir=cache, allow_patterns=list(DOWNLOAD_PATTERNS)
    )
    return Path(folder)


def chat_template_text(value: str) -> str:
    """The chat template ``value`` gives: itself when it reads as a Jinja template
    (it holds ``{%`` or ``{{``), else the contents of the file it names."""
    if any(mark in value for mark in _TEMPLATE_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"chat_template: file {str(path)!r} does not exist (expected a Jinja chat "
            "template file, or the template itself, holding {% or {{)"
        )
    return path.read_text()
