#!/usr/bin/env bash
# The GPU check, capped: about 8 minutes on an H100 or H200 (--quick: about 5), ending in one
# summary table. Each step has its own time cap and the whole run a budget; the most important
# steps come first, so a check cut short still says the most:
#   1. the GPU tests (tests/gpu)
#   2. the engine in process against transformers' forward, bf16: gpt2 (MODELS="random:gpt2
#      random:gpt2-xl" adds gpt2-xl: its random weights take most of a minute to make on the CPU)
#   3. served next-token, random:gpt2 bf16, --workers auto: gRPC and REST at 512 clients over 8
#      client processes, NextTokenBatch (64 prompts a call, 16 clients over 4 processes), and 1
#      client (--quick: neither REST nor 1 client). Each load takes 40-45 s on an H100: client
#      processes to start, the in-process limit's model to load, warm-up, load
#   4. generation on the same server, 1/16/64/256 streams of 64 tokens (--quick: 1 and 256), the
#      engine process's CPU under 256 streams where py-spy is there (bench/host_path/engine_profile.py; not
#      in --quick), then the engine alone at the same batches in process (bench/engine/generate_engine.py)
#   5. the prefix cache, scoring, and structured output at 64 streams (a 10-field JSON schema
#      against none) on cuda (not in --quick)
#   6. the suite, -n over the machine's cores, until the budget is spent: the tests left then are
#      skipped and counted as such (not in --quick; the stack, browser and helm tiers need
#      Docker, Chromium and helm, which such a machine lacks)
#
#   bash scripts/gpu_check.sh [--quick]      # from the project's root
#   make test-gpu
#
# Python: the project's venv where there is one, else the machine's python3 (its own torch) with
# the wheels carried in .whl/ (../shared/gpu/fetch-wheels.sh fills it; scripts/gpu-wheels.txt
# lists what the project adds). Output in $OUT (default gpu-check/), five files: summary.md,
# all.log, gpu-tests.log, suite.log, serve.log. BUDGET_S overrides the budget; COMMIT names the
# commit where the tree has no .git.
set -uo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = --quick ] && quick=1
budget=${BUDGET_S:-$([ $quick = 1 ] && echo 280 || echo 460)}
# Caps in seconds (full, then --quick): GPU tests, in process per model, server start, a
# next-token load (and its seconds of load), generation (and its seconds per stream count).
if [ $quick = 1 ]; then caps=(75 35 60 55 5 50 4); else caps=(150 50 90 60 5 100 6); fi
out=${OUT:-${GPU_CHECK_OUT:-gpu-check}}
mkdir -p "$out"
exec > >(tee -a "$out/all.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1

if [ -x .venv/bin/python ]; then
  python=.venv/bin/python
else
  [ -f .whl/setup.sh ] && source .whl/setup.sh
  python=python3
fi
$python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check here')" || exit 1
$python -c "import gpt2serve.launch.single_process, openai, msgpack, uvloop, fastapi_offline, ngh2" ||
  { echo "missing packages: without registry access, carry the wheels of scripts/gpu-wheels.txt in .whl/"; exit 1; }

t0=$(date +%s)
summary=$out/summary.md
rows=$(mktemp)
details=$(mktemp)
left() { echo $(( budget - ($(date +%s) - t0) )); }
capped() { local cap=$1 remaining; remaining=$(left); echo $(( cap < remaining ? cap : remaining )); }
row() { echo "| $1 | $2 | $3 |" >>"$rows"; echo "[$(( $(date +%s) - t0 )) s] $1: $3"; }
section() { local body; body=$(cat); [ -n "$body" ] && printf '\n### %s\n\n%s\n' "$1" "$body" >>"$details"; true; }
outcome() { case $1 in 0) echo ok;; 124|137) echo "cut at its cap";; 125) echo "not run: the budget is spent";; *) echo "failed (rc $1)";; esac; }
status=0

# run CAP_S FILE command...: the command under min(CAP_S, what is left), its output in FILE, its
# seconds in LAST_S; its exit status is the function's (124: cut by the cap; 125: not run).
run() {
  local cap started rc; cap=$(capped "$1"); local file=$2; shift 2
  LAST_S=0
  if (( cap < 15 )); then echo "not run: the budget is spent" >"$file"; return 125; fi
  started=$(date +%s)
  timeout --kill-after=10 "$cap" "$@" >"$file" 2>&1; rc=$?
  LAST_S=$(( $(date +%s) - started ))
  (( rc == 124 || rc == 137 )) && echo "(cut at ${cap} s)" >>"$file"
  return $rc
}
pytest_line() { grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$1" | tail -1 | tr -d '='; }

echo "== GPU tests"
run ${caps[0]} "$out/gpu-tests.log" $python -m pytest -q -rs -p no:cacheprovider tests/gpu; rc=$?
(( rc != 0 )) && status=1
row "GPU tests" "$LAST_S" "$(pytest_line "$out/gpu-tests.log"); $(outcome $rc)"
grep -E '^(FAILED|ERROR)' "$out/gpu-tests.log" | section "GPU tests: failures"

echo "== engine in process, bf16"
for model in ${MODELS:-random:gpt2}; do
  file=$(mktemp)
  run ${caps[1]} "$file" $python -m gpt2serve.cli bench --in-process --model "$model" --device cuda \
      --dtype bfloat16 --batch-sizes 1,64,256,1024 --limit-duration 4 --rounds 2; rc=$?
  (( rc != 0 )) && status=1
  grep -v WARN "$file" | section "engine in process: $model, bf16 (gpt2serve bench --in-process --rounds 2)"
  row "in process, $model" "$LAST_S" "$(outcome $rc); below"
done

streams=1,16,64,256
[ $quick = 1 ] && streams=1,256
echo "== served, random:gpt2 bf16, --workers auto"
cap=$(capped ${caps[2]})
$python -m gpt2serve.cli serve --model random:gpt2 --device cuda --dtype bfloat16 --workers auto \
    --host 127.0.0.1 --grpc-port 50081 --http-port 8081 >"$out/serve.log" 2>&1 &
server=$!
started=$(date +%s)
until grep -q "gpt2serve ready" "$out/serve.log" || ! kill -0 $server 2>/dev/null || (( $(date +%s) - started > cap )); do
  sleep 1
done
if grep -q "gpt2serve ready" "$out/serve.log"; then
  row "server start" $(( $(date +%s) - started )) "ready"
  loads=("-c 512 -p 8" "--api grpc-batch -c 16 -p 4" "--api rest -c 512 -p 8" "-c 1")
  [ $quick = 1 ] && loads=("-c 512 -p 8" "--api grpc-batch -c 16 -p 4")
  # h2load and wrk where the machine has them (they are not the limit); else Python clients, whose
  # CPU the bench prints and judges (REJECTED when they had no headroom). One client stays Python:
  # its in-process forward is timed between its calls.
  # .whl/native/bin: the two tools copied from a Debian machine (scripts/bundle_native_tools.sh).
  [ -d .whl/native/bin ] && export PATH=$PWD/.whl/native/bin:$PATH
  # (wrk -v exits 1 after its version: under pipefail only grep's status may count)
  native=$(h2load --version >/dev/null 2>&1 && { wrk -v 2>&1 || true; } | grep -q '^wrk' && echo --native)
  echo "load generators: ${native:-Python clients (h2load or wrk missing)}"
  for load in "${loads[@]}"; do
    file=$(mktemp)
    [ "$load" = "-c 1" ] && how="" || how=$native
    run ${caps[3]} "$file" $python -m gpt2serve.cli bench --target 127.0.0.1:50081 \
        --http-target http://127.0.0.1:8081 $how $load -d ${caps[4]} --limit-duration 4; rc=$?
    (( rc != 0 )) && status=1
    grep -v WARN "$file" | section "served next-token: gpt2serve bench --target ... $how $load -d ${caps[4]}"
    row "next-token $load" "$LAST_S" "$(outcome $rc); below"
  done
  file=$(mktemp)
  steps_before=$(mktemp)
  $python bench/serving/step_metrics.py http://127.0.0.1:8081 --save "$steps_before" 2>/dev/null
  run ${caps[5]} "$file" $python -m gpt2serve.cli bench --generate --target 127.0.0.1:50081 \
      --streams $streams -p 8 -d ${caps[6]} --rounds 1 --limit-duration 4; rc=$?
  (( rc != 0 )) && status=1
  # The server's own step times over the generation (prefill against decode: time to first token)
  { echo; $python bench/serving/step_metrics.py http://127.0.0.1:8081 --since "$steps_before" 2>&1; } >>"$file"
  grep -v WARN "$file" | section "generation: gpt2serve bench --generate --streams $streams -p 8 -d ${caps[6]}"
  row "generation, $streams streams" "$LAST_S" "$(outcome $rc); below"
  # Where the engine process's CPU goes under 256 streams (py-spy, where the wheels carried it).
  spy=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null)
  if [ $quick = 0 ] && [ -n "$spy" ] && (( $(left) > 60 )); then
    file=$(mktemp)
    $python -m gpt2serve.cli bench --generate --target 127.0.0.1:50081 --streams 256 -p 8 -d 15 --rounds 1 \
        --limit-duration 1 >/dev/null 2>&1 &
    load=$!
    # The bench runs transformers' reference first: wait for the server's steps to move.
    $python -c "
import time
from gpt2serve.benchmarks.native_load import scrape
def steps():
    return sum(v for (name, _), v in scrape('http://127.0.0.1:8081').items() if name == 'gpt2serve_step_duration_seconds_count')
first, t0 = steps(), time.time()
while steps() - first < 500 and time.time() - t0 < 30:
    time.sleep(0.5)
" 2>/dev/null
    PATH=$(dirname "$spy"):$PATH run 30 "$file" $python bench/host_path/engine_profile.py --seconds 5; rc=$?
    kill $load 2>/dev/null; wait $load 2>/dev/null
    section "the engine process under 256 streams: bench/host_path/engine_profile.py --seconds 5" <"$file"
    row "engine profile, 256 streams" "$LAST_S" "$(outcome $rc); below"
  fi
else
  row "server start" $(( $(date +%s) - started )) "NOT READY (serve.log)"
  status=1
fi
kill $server 2>/dev/null; wait $server 2>/dev/null

# The engine alone at the same stream counts: what the served generation above could reach.
echo "== generation in process"
file=$(mktemp)
largest_first=$(echo "$streams" | tr , '\n' | sort -rn | paste -sd,)  # the issue's figure first, should the cap cut it
run 70 "$file" $python bench/engine/generate_engine.py --device cuda --dtype bfloat16 --batch-sizes $largest_first --rounds 2; rc=$?
(( rc != 0 )) && status=1
grep -v WARN "$file" | section "generation in process: bench/engine/generate_engine.py --device cuda --dtype bfloat16 --batch-sizes $largest_first --rounds 2"
row "generation in process" "$LAST_S" "$(outcome $rc); below"

if [ $quick = 0 ]; then
  echo "== prefix cache and scoring on cuda"
  file=$(mktemp)
  run 60 "$file" $python bench/engine/prefix_cache.py --model random:gpt2 --device cuda --dtype bfloat16 \
      --rounds 3; rc=$?
  (( rc != 0 )) && status=1
  tail -40 "$file" | section "prefix cache: bench/engine/prefix_cache.py --device cuda --dtype bfloat16 --rounds 3"
  row "prefix cache" "$LAST_S" "$(outcome $rc); below"
  file=$(mktemp)
  run 60 "$file" $python bench/serving/scoring.py --model random:gpt2 --device cuda --dtype bfloat16 \
      --clients 64 --seconds 8 --rounds 2 --memory-batch 0; rc=$?
  (( rc != 0 )) && status=1
  tail -1 "$file" | section "scoring: bench/serving/scoring.py --device cuda --dtype bfloat16 --clients 64 --seconds 8"
  row "scoring" "$LAST_S" "$(outcome $rc); below"
  file=$(mktemp)
  run 45 "$file" $python bench/engine/structured_output.py --device cuda --streams 64 --steps 48 --rounds 3; rc=$?
  (( rc != 0 )) && status=1
  tail -3 "$file" | section "structured output: bench/engine/structured_output.py --device cuda --streams 64 --rounds 3"
  row "structured output, 64 streams" "$LAST_S" "$(outcome $rc); below"

  echo "== the suite, until the budget is spent"
  workers=()
  $python -c "import xdist" 2>/dev/null && workers=(-n "$(nproc)")
  remaining=$(left)
  GPT2SERVE_SUITE_BUDGET_S=$(( remaining - 40 )) run "$remaining" "$out/suite.log" \
      $python -m pytest -q -rfEs -p no:cacheprovider "${workers[@]}" -m "not (stack or browser or helm or gpu)"; rc=$?
  (( rc != 0 )) && status=1
  cut=$(grep -E '^SKIPPED \[[0-9]+\].*budget is spent' "$out/suite.log" | sed -E 's/^SKIPPED \[([0-9]+)\].*/\1/' |
        awk '{n += $1} END {print n + 0}')
  row "suite" "$LAST_S" "$(pytest_line "$out/suite.log"); $cut skipped for the budget; $(outcome $rc)"
  grep -E '^(FAILED|ERROR)' "$out/suite.log" | section "suite: failures"
fi

{
  echo "## GPU check$([ $quick = 1 ] && echo ' (--quick)')"
  echo
  echo "$(date -u +%Y-%m-%d), commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}, \
$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1), \
$($python -c 'import torch, sys; print(f"torch {torch.__version__}, Python {sys.version.split()[0]}")'), \
$(nproc) cores; $(( $(date +%s) - t0 )) s of a $budget s budget"
  echo
  echo "| step | s | result |"
  echo "|---|---|---|"
  cat "$rows"
  cat "$details"
} >"$summary"
echo "== summary: $summary"
cat "$summary"
exit $status
