#!/usr/bin/env bash
# The docs/benchmarks.md table: for each dtype, start a server on loopback and run
# `gpt2serve bench` at 64 gRPC clients, 1 gRPC client and 64 REST clients.
# Usage: bench/serving/table.sh [model] [extra serve flags...]   (default model random:gpt2)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=${1:-random:gpt2}; shift || true
bin=.venv/bin/gpt2serve
for dtype in ${DTYPES:-float32 bfloat16}; do
  log=$(mktemp)
  $bin serve --model "$model" --dtype "$dtype" --host 127.0.0.1 --grpc-port 50061 --http-port 8061 "$@" >"$log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until grep -q "gpt2serve ready" "$log"; do
    kill -0 $server 2>/dev/null || { cat "$log"; exit 1; }
    sleep 0.5
  done
  echo "== $dtype, serve flags: ${*:-(defaults)}"
  $bin bench --target 127.0.0.1:50061 -c 64 -d 10
  $bin bench --target 127.0.0.1:50061 -c 1 -d 10
  $bin bench --api rest --http-target http://127.0.0.1:8061 --target 127.0.0.1:50061 -c 64 -d 10
  kill $server; wait $server 2>/dev/null || true
done
