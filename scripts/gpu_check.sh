#!/usr/bin/env bash
# One command on a GPU machine: the GPU tests, the whole suite, and the in-process engine bench
# table (engine vs transformers' forward, bf16) on gpt2 and gpt2-xl. Logs and the table land in
# $GPU_CHECK_OUT (default gpu-check/).
#
#   make test-gpu                                  # with the project's venv
#   source .whl/setup.sh && scripts/gpu_check.sh   # on the offline GPU machines (../shared/gpu/)
#
# SUITE=0 skips the whole suite (the GPU tests and the bench still run).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
out=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

$python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"

echo "== GPU tests"
$python -m pytest -q -rs tests/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1

echo "== engine bench (bf16, 5-token prompts)"
: >"$out/bench.md"
for model in random:gpt2 random:gpt2-xl; do
  $python -m gpt2serve.cli bench --in-process --model "$model" --device cuda --dtype bfloat16 \
      --batch-sizes 1,64,256,1024 2>&1 | grep -v WARN | tee -a "$out/bench.md" || status=1
  echo | tee -a "$out/bench.md"
done

if [ "${SUITE:-1}" = 1 ]; then
  echo "== whole suite"
  $python -m pytest -q -rs 2>&1 | tee "$out/suite.log" || status=1
fi
exit $status
