"""A Hugging Face hub cache written as ``huggingface_hub`` lays it out, for tests that
resolve repo ids with no network::

    <cache>/models--Org--Name/
        blobs/<sha256>                  each file's content, once
        refs/<revision>                 a commit hash
        snapshots/<commit>/<file>       a link to its blob
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_hash(text: str) -> str:
    """A 40-hex commit hash made from ``text`` (stable across runs)."""
    return hashlib.sha1(text.encode()).hexdigest()


def cache_snapshot(
    cache: Path, repo_id: str, commit: str, source: Path, refs: tuple[str, ...] = ()
) -> Path:
    """Put the files of directory ``source`` in ``cache`` as ``repo_id``'s snapshot
    ``commit``, and point each of ``refs`` at it; return the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
