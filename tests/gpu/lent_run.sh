#!/bin/bash
# Run on a lent GPU machine (tests/gpu/README.md), after tests/gpu/lent_prepare.sh here:
# the set-up, `tests/gpu` but the Ray test, and the CUDA engine benchmarks, each under
# its own time limit, their logs and results in $OUT. ~4 minutes on an H200.
set -u
start=$(date +%s)
stage() { echo "[+$(($(date +%s) - start)) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/ns/tessera
for folder in workers scheduler cluster protos; do
    ln -sfn "$PWD/$folder" "/tmp/ns/tessera/$folder"
done
export PYTHONPATH=/tmp/site:/tmp/ns:$PWD:$PWD/.gpu/model PYTHONUNBUFFERED=1
out=${OUT:-/tmp/out}
mkdir -p "$out"
nvidia-smi -L
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
stage "tests/gpu (the first ~75 s: the native CPU kernels' first build)"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_engine.py \
    tests/gpu/test_cuda_quant.py -rfE --durations=10 2>&1 | tee "$out/pytest.log" | tail -25
for flags in "" "--no-cuda-graphs" "--no-packed-weights"; do
    stage "step_overhead.py --device cuda $flags"
    timeout 90 python3 benchmarks/step_overhead.py --device cuda $flags 2>&1 | tail -6
done
stage "cuda_quant_matmul.py"
timeout 90 python3 benchmarks/cuda_quant_matmul.py 2>&1 | grep -v '^{'
stage done
tar czf "$out/results.tgz" benchmarks/results/*cuda*
