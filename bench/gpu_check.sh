#!/usr/bin/env bash
# The one prepared GPU check (issue 25): on a machine with a CUDA GPU, PyTorch and Triton and
# nothing else installed, run the `cuda` tests, then the GPU bench; logs and JSON go to $1.
#   bash bench/gpu_check.sh OUT_DIR        (at most 8 minutes: 280 s of cuda tests, 180 s of bench)
# Other packages travel as wheels in .whl/ (pip install --no-index --find-links .whl).
set -uo pipefail
out="${1:?usage: gpu_check.sh OUT_DIR}"
mkdir -p "$out"
cd "$(dirname "$0")/.."
{
  nvidia-smi || true
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$out/env.txt" 2>&1
if [ -d .whl ]; then
  python -m pip install -q --no-index --find-links .whl -e '.[test]' > "$out/pip.log" 2>&1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 280 python -m pytest tests/cuda -m cuda -q -rs -p no:cacheprovider \
  > "$out/cuda_tests.log" 2>&1
echo "cuda tests rc=$?" >> "$out/summary.txt"
timeout 180 python bench/gpu_bench.py --json-out "$out/gpu_bench.json" > "$out/gpu_bench.log" 2>&1
echo "gpu bench rc=$?" >> "$out/summary.txt"
cat "$out/summary.txt"
