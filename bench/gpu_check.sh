#!/usr/bin/env bash
# The checks that need a GPU, as one short run on a lent CUDA machine (no network there):
# the CUDA tests (tests/test_devices.py: side-stream pinned capture, replay on the device bit for
# bit), bench/cuda_bench.py (capture cost of a GPU pipeline stage), and bench/replay_bench.py on
# that machine's cores. Missing wheels travel in .whl/ (zstandard, lmdb, cffi, pycparser for
# cp312); results go to $OUT (default: bench/results/gpu-check/).
# Usage: bash bench/gpu_check.sh [tests|cuda|replay ...]   (default: all three; TESTS= names the test files)
set -u
OUT=${OUT:-bench/results/gpu-check}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, zstandard, lmdb; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cpus', __import__('os').cpu_count())"
steps=" ${*:-tests cuda replay} "
t0=$(date +%s)
[[ $steps == *" tests "* ]] && timeout 200 python3 -m pytest -q -ra -p no:cacheprovider ${TESTS:-tests/test_devices.py} 2>&1 | tee "$OUT/pytest_devices.log" | tail -25
echo "== tests: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
[[ $steps == *" cuda "* ]] && timeout 170 python3 bench/cuda_bench.py --out "$OUT/cuda.json" 2>&1 | tee "$OUT/cuda_bench.log" | tail -14
echo "== cuda_bench: $(( $(date +%s) - t0 )) s"; t0=$(date +%s)
[[ $steps == *" replay "* ]] && timeout "${REPLAY_S:-200}" python3 bench/replay_bench.py --rounds "${ROUNDS:-5}" \
    --max-wait-s 10 --out "$OUT/replay.json" 2>&1 | tee "$OUT/replay_bench.log" | tail -30
echo "== replay_bench: $(( $(date +%s) - t0 )) s"
