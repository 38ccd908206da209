"""`tessera generate` as a user runs it: a real process, the built-in model."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tessera.cluster.cli"]


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
        "--n",
        "--best-of",
        "--beam-width",
        "--length-penalty",
        "--early-stopping",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "--speculative-method",
        "--speculative-num-tokens",
        "--speculative-min-tokens",
        "--draft-model",
        "--num-kv-blocks",
        "--max-model-len",
        # the old spellings, deprecated for one release
        "--no-prefix-caching",
        "--speculative {ngram,draft}",
        "--num-speculative-tokens",
        "--parallel-tokens",
        "--parallel-max-width",
        "--parallel-mode",
        "--json-schema FILE",
        "--regex REGEX",
        "--choice TEXT [TEXT ...]",
        "--grammar FILE",
    ):
        assert flag in out.stdout


def test_generate_streams_the_greedy_completion(smollm2, hf_reference):
    prompt = "The capital of France is"
    ref = hf_reference.greedy(tuple(smollm2.tokenizer(prompt).input_ids), 12)
    expected = smollm2.tokenizer.decode(
        [t for t in ref.token_ids[: ref.token_ids.index(2) if 2 in ref.token_ids else None]]
    )
    out = subprocess.run(
        [*CLI, "generate", "--prompt", prompt, "--max-tokens", "12", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == expected
    assert "tok/s" in out.stderr and "finish reason" in out.stderr
    assert "float32, exact mode" in out.stderr


def test_generate_defaults_to_the_fast_mode_where_this_cpu_runs_it():
    """No --dtype: auto, the fast mode on a CPU with AVX512_BF16 (the built-in model has
    Q4 matrices), else the exact mode; the load line says which."""
    from tessera.workers.model.loader import fast_mode_available

    out = subprocess.run(
        [*CLI, "generate", "--prompt", "The capital of France is", "--max-tokens", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    if fast_mode_available():
        assert "float32, fast mode: bf16 inputs to the GGUF matmuls" in out.stderr
    else:
        assert "float32, exact mode" in out.stderr


def test_speculative_and_parallel_tokens_from_the_command_line(make_engine):
    from tessera.workers.api import ParallelTokensParams, SamplingParams
    from tests.helpers import run_engine, text_of

    prompt = "Repeat: the cat sat on the mat. Repeat: the cat sat"
    engine = make_engine()
    greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    engine.add_request("plain", prompt, SamplingParams(**greedy))
    parallel = ParallelTokensParams(0.05, 3, "isolated")
    engine.add_request("sets", prompt, SamplingParams(parallel_tokens=parallel, **greedy))
    out = run_engine(engine)
    common = [*CLI, "generate", "--prompt", prompt, "--max-tokens", "12", "--temperature", "0"]
    common += ["--dtype", "float32"]
    spec = subprocess.run(
        [*common, "--speculative-method", "draft", "--draft-model", "target:10"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout.rstrip("\n") == text_of(out["plain"])
    assert re.search(r"drafts accepted \d+/\d+ \(\d+%\)", spec.stderr), spec.stderr
    sets = subprocess.run(
        [*common, "--parallel-tokens", "0.05", "--parallel-max-width", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sets.returncode == 0, sets.stderr
    expected = "".join(
        s.tokens[0] if len(s.tokens) == 1 else "[" + "|".join(s.tokens) + "]"
        for d in out["sets"]
        for s in d.parallel_sets
    )
    assert "[" in expected and sets.stdout.rstrip("\n") == expected
    bad = subprocess.run(
        [*common, "--speculative-method", "draft"], capture_output=True, text=True, timeout=300
    )
    assert bad.returncode == 2
    assert "speculative.method: 'draft' needs a worker started with a draft model" in bad.stderr
    old = subprocess.run(  # the deprecated spelling still works, and says what replaces it
        [*common, "--speculative", "draft"], capture_output=True, text=True, timeout=300
    )
    assert old.returncode == 2
    assert "speculative.method: 'draft' needs a worker started with a draft model" in old.stderr
    assert "warning: --speculative is deprecated" in old.stderr
    assert "use --speculative-method" in old.stderr


def test_beam_search_prints_each_beam_with_its_score(smollm2, hf_reference):
    prompt = "The capital of France is"
    prompt_ids = smollm2.tokenizer(prompt).input_ids
    eos = list(smollm2.config.eos_token_ids)
    import torch

    reference = hf_reference.model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        num_beams=3,
        num_return_sequences=2,
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
        output_scores=True,
        return_dict_in_generate=True,
    )
    out = subprocess.run(
        [
            *CLI,
            "generate",
            "--prompt",
            prompt,
            "--max-tokens",
            "8",
            "--beam-width",
            "3",
            "--n",
            "2",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    printed = [float(x) for x in re.findall(r"score (-?[0-9.]+)", out.stdout)]
    expected = [float(x) for x in reference.sequences_scores]
    assert printed == pytest.approx(expected, abs=2e-4)  # printed with 4 decimals
    for index in range(2):
        length = int((reference.beam_indices[index] != -1).sum())
        tokens = reference.sequences[index, len(prompt_ids) : len(prompt_ids) + length].tolist()
        text = smollm2.tokenizer.decode(tokens, skip_special_tokens=True)
        assert f"--- output {index}: {length} tokens" in out.stdout
        assert text in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature: must be between 0 and 100, got -1.0"),
        (["--model", "/no/such"], "model: path '/no/such' does not exist"),
        (["--beam-width", "2", "--n", "3"], "n: must be <= beam_width (2) with beam search, got 3"),
        (["--early-stopping", "maybe"], "must be true, false or never, got 'maybe'"),
        (["--regex", "a", "--choice", "b"], "give one of --json-schema, --regex, --choice"),
        (["--json-schema", "/no/such.json"], "--json-schema: cannot read '/no/such.json'"),
        (["--regex", "(unclosed"], "structured.spec: is not a valid regex"),
    ],
)
def test_invalid_option_is_a_clear_error(args, message):
    out = subprocess.run(
        [*CLI, "generate", "--prompt", "hi", *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2
    assert message in out.stderr


def test_structured_outputs_from_the_command_line(tmp_path):
    import json

    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"answer": {"enum": ["yes", "no"]}},
                "required": ["answer"],
                "additionalProperties": False,
            }
        )
    )
    runs = {
        "json": ["--json-schema", str(schema)],
        "regex": ["--regex", r"\d{3}-\d{4}"],
        "choice": ["--choice", "red", "green", "blue"],
    }
    outputs = {}
    for name, flags in runs.items():
        out = subprocess.run(
            [*CLI, "generate", "--prompt", "Answer:", "--max-tokens", "40", *flags],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        outputs[name] = out.stdout.rstrip("\n")
    assert json.loads(outputs["json"])["answer"] in ("yes", "no")
    assert re.fullmatch(r"\d{3}-\d{4}", outputs["regex"])
    assert outputs["choice"] in ("red", "green", "blue")
