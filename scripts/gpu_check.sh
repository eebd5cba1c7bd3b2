#!/usr/bin/env bash
# One command on a GPU machine: the GPU tests, the in-process engine bench table (engine vs
# transformers' forward, bf16) on gpt2 and gpt2-xl, the served bench with --workers auto (gRPC and
# REST at 512 clients, 1 client), the generation bench (issue 14: 1..256 streams of 64 tokens
# against transformers' generate, gpt2 and gpt2-xl), and the whole suite. Logs and tables land in $GPU_CHECK_OUT
# (default gpu-check/).
#
#   make test-gpu                                  # with the project's venv
#   source .whl/setup.sh && scripts/gpu_check.sh   # on a GPU machine with no registry access: a venv
#                                                  # set up from wheels in .whl/ (scripts/gpu-wheels.txt lists them)
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
$python -c "import gpt2serve.launch.single_process, openai, zmq, msgpack, fastapi_offline" ||
  { echo "missing packages: without registry access, install the wheels listed in scripts/gpu-wheels.txt (pip download them elsewhere)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"

echo "== GPU tests"
$python -m pytest -q -rs tests/gpu/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" || status=1

echo "== engine bench (bf16, 5-token prompts)"
: >"$out/bench.md"
for model in random:gpt2 random:gpt2-xl; do
  $python -m gpt2serve.cli bench --in-process --model "$model" --device cuda --dtype bfloat16 \
      --batch-sizes 1,64,256,1024 2>&1 | grep -v WARN | tee -a "$out/bench.md" || status=1
  echo | tee -a "$out/bench.md"
done

echo "== served (issue 12): random:gpt2 bf16, --workers auto, clients over 8 processes"
log=$(mktemp)
$python -m gpt2serve.cli serve --model random:gpt2 --device cuda --dtype bfloat16 --workers auto \
    --host 127.0.0.1 --grpc-port 50081 --http-port 8081 >"$log" 2>&1 &
server=$!
for _ in $(seq 1 300); do grep -q "gpt2serve ready" "$log" && break; kill -0 $server 2>/dev/null || break; sleep 1; done
if grep -q "gpt2serve ready" "$log"; then
  for load in "-c 512 -p 8" "--api rest --http-target http://127.0.0.1:8081 -c 512 -p 8" "-c 1"; do
    echo "-- bench $load" | tee -a "$out/serve-bench.txt"
    $python -m gpt2serve.cli bench --target 127.0.0.1:50081 $load -d 10 2>&1 | grep -v WARN | tee -a "$out/serve-bench.txt" || status=1
  done
else
  cat "$log"; status=1
fi
kill $server 2>/dev/null; wait $server 2>/dev/null
cp "$log" "$out/serve.log"

echo "== generation (issue 14): streams of 64 tokens, bf16, --workers auto"
: >"$out/generate-bench.md"
for model in random:gpt2 random:gpt2-xl; do
  log=$(mktemp)
  $python -m gpt2serve.cli serve --model "$model" --device cuda --dtype bfloat16 --workers auto \
      --host 127.0.0.1 --grpc-port 50082 --http-port 8082 >"$log" 2>&1 &
  server=$!
  for _ in $(seq 1 300); do grep -q "gpt2serve ready" "$log" && break; kill -0 $server 2>/dev/null || break; sleep 1; done
  if grep -q "gpt2serve ready" "$log"; then
    $python -m gpt2serve.cli bench --generate --target 127.0.0.1:50082 --streams 1,16,64,256 -p 8 -d 10 \
        --limit-duration 6 2>&1 | grep -v WARN | tee -a "$out/generate-bench.md" || status=1
    echo | tee -a "$out/generate-bench.md"
  else
    cat "$log"; status=1
  fi
  kill $server 2>/dev/null; wait $server 2>/dev/null
  cp "$log" "$out/generate-serve-${model#random:}.log"
done

if [ "${SUITE:-1}" = 1 ]; then
  echo "== whole suite"
  $python -m pytest -q -rs 2>&1 | tee "$out/suite.log" || status=1
fi
exit $status
