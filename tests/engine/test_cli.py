"""`tessera generate` as a user runs it: a real process, the built-in model."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "cluster.cli"]


def test_help_explains_every_option():
    out = subprocess.run([*CLI, "generate", "--help"], capture_output=True, text=True, check=True)
    for flag in (
        "--prompt",
        "--model",
        "--dtype",
        "--chat",
        "--max-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
        "--kv-cache-memory",
    ):
        assert flag in out.stdout


def test_generate_streams_the_greedy_completion(smollm2, hf_reference):
    prompt = "The capital of France is"
    ref = hf_reference.greedy(tuple(smollm2.tokenizer(prompt).input_ids), 12)
    expected = smollm2.tokenizer.decode(
        [t for t in ref.token_ids[: ref.token_ids.index(2) if 2 in ref.token_ids else None]]
    )
    out = subprocess.run(
        [*CLI, "generate", "--prompt", prompt, "--max-tokens", "12"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == expected
    assert "tok/s" in out.stderr and "finish reason" in out.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature: must be between 0 and 100, got -1.0"),
        (["--model", "/no/such"], "model: path '/no/such' does not exist"),
    ],
)
def test_invalid_option_is_a_clear_error(args, message):
    out = subprocess.run(
        [*CLI, "generate", "--prompt", "hi", *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert message in out.stderr
