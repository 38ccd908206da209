"""docs/benchmarks.md is what benchmarks/report.py generates from the result JSONs now."""

from __future__ import annotations

import json

from benchmarks.report import DOC, RESULTS, machine, ratio_headline, render


def test_docs_benchmarks_is_generated_from_the_results():
    assert DOC.read_text() == render(), (
        "docs/benchmarks.md is stale: run `.venv/bin/python -m benchmarks.report`"
    )


def test_every_result_has_a_row_with_its_command_peer_and_date():
    text = DOC.read_text()
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        assert f"[{path.stem}]" in text
        for field in ("command", "peer", "date"):
            assert data.get(field), f"{path.name} has no {field!r}"


def test_the_headline_skips_the_peer_rows_and_names_the_others():
    rows = [
        {"mode": "plain", "batch": 1, "tok_s": 10.0, "speedup": 1.0},
        {"mode": "ngram", "batch": 1, "tok_s": 12.5, "speedup": 1.25},
        {"mode": "ngram", "batch": 4, "tok_s": 30.0, "speedup": 0.9},
    ]
    assert ratio_headline(rows) == "speedup: 1.25x (batch 1), 0.90x (batch 4)"
    assert ratio_headline([{"rows": 1, "ms": 2.0}]) == ""


def test_the_machine_names_the_cpu_its_best_instruction_set_and_a_gpu():
    cpu = {"model": "AMD EPYC", "family": "25", "model_number": "17", "avx2": True}
    assert machine({"threads": 2, "cpu_features": {**cpu, "avx512_bf16": True}}) == (
        "AMD EPYC (family 25 model 17; AVX512_BF16), 2 threads"
    )
    assert machine({"threads": 16, "cpu_features": cpu, "cuda": "NVIDIA H200"}) == (
        "NVIDIA H200; host AMD EPYC (family 25 model 17; AVX2), 16 threads"
    )
    assert machine({"cpu": "x86_64", "threads": 2}) == "x86_64, model not recorded, 2 threads"
