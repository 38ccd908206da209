"""``tessera --help`` answers without loading torch, transformers, Ray or gRPC: the parser
is built from light modules, and each command imports what it runs when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "tessera.cluster.cli"]
HEAVY = ("torch", "transformers", "ray", "grpc")


def test_building_the_parser_imports_nothing_heavy():
    code = (
        "import json, sys\n"
        "from tessera.cluster.cli import build_parser\n"
        "build_parser()\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = {name.split(".")[0] for name in json.loads(done.stdout)}
    assert loaded.isdisjoint(HEAVY), sorted(loaded.intersection(HEAVY))


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ([], "{generate,cluster,serve,bench}"),
        (["bench", "serve"], "--goodput METRIC:MS [METRIC:MS ...]"),
        (["serve"], "--enable-prefix-caching, --no-enable-prefix-caching"),
        (["cluster"], "--speculative-method {ngram,draft}"),
        (["generate"], "--speculative-method {ngram,draft}"),
        (["serve"], "--reasoning-parser {deepseek_r1,qwen3}"),
        (["generate"], "--chat-template CHAT_TEMPLATE"),
    ],
    ids=[
        "tessera",
        "bench-serve",
        "serve",
        "cluster",
        "generate",
        "serve-reasoning",
        "generate-sources",
    ],
)
def test_help_exits_zero(command: list[str], expected: str):
    done = subprocess.run(
        [*CLI, *command, "--help"], capture_output=True, text=True, check=True, timeout=60
    )
    assert expected in done.stdout
    assert done.stderr == ""
