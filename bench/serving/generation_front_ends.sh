#!/usr/bin/env bash
# Generation at S streams through servers with different front-end counts, in alternating
# rounds (a shared machine's speed drifts): does the count of front-end processes, which share
# the cores with the engine and the client processes, set the served rate?
#
#   bash bench/serving/generation_front_ends.sh [WORKERS...]     # default: auto 8
#   STREAMS=256 ROUNDS=2 DEVICE=cuda DTYPE=bfloat16 MODEL=random:gpt2 bash bench/serving/generation_front_ends.sh auto 8 4
#
# Python: $PYTHON, else the project's venv, else python3. One `gpt2serve bench --generate` line
# per server and round (its transformers column is that round's reference on this machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
streams=${STREAMS:-256} rounds=${ROUNDS:-2} model=${MODEL:-random:gpt2}
device=${DEVICE:-cuda} dtype=${DTYPE:-bfloat16}
counts=("$@")
(( ${#counts[@]} )) || counts=(auto 8)
log=$(mktemp)
echo "model $model, $dtype on $device, $streams streams of 64 tokens, -p 8, $rounds round(s)"
for (( round = 0; round < rounds; round++ )); do
  order=("${counts[@]}")
  (( round % 2 )) && order=($(printf '%s\n' "${counts[@]}" | tac))
  for workers in "${order[@]}"; do
    $python -m gpt2serve.cli serve --model "$model" --device "$device" --dtype "$dtype" \
        --workers "$workers" --host 127.0.0.1 --grpc-port 50091 --http-port 8091 >"$log" 2>&1 &
    server=$!
    for _ in $(seq 120); do
      grep -q "gpt2serve ready" "$log" || ! kill -0 $server 2>/dev/null && break
      sleep 1
    done
    if grep -q "gpt2serve ready" "$log"; then
      line=$(timeout 90 $python -m gpt2serve.cli bench --generate --target 127.0.0.1:50091 \
          --streams "$streams" -p 8 -d 6 --rounds 1 --limit-duration 3 2>/dev/null | grep "^| $streams ")
      front_ends=$(grep -oE 'ready: .*workers=[0-9]+' "$log" | grep -oE 'workers=[0-9]+')
      echo "round $round, --workers $workers (${front_ends:-?}): ${line:-no result}"
    else
      echo "round $round, --workers $workers: not ready"; tail -5 "$log"
    fi
    kill $server 2>/dev/null; wait $server 2>/dev/null
  done
done
rm -f "$log"
