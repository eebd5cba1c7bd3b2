#!/usr/bin/env bash
# The README's /ui captures: the walk-through, the generate mode and a preset's shapes, taken by
# headless Chromium from a random:gpt2 server on loopback (random weights: the patterns are noise,
# the shapes are GPT-2 small's). Writes docs/ui.png, docs/ui-walkthrough.png, docs/ui-generate.png,
# docs/ui-shapes.png, docs/ui-score.png, and docs/ui-adapter.png: a random rank-8 LoRA adapter on
# all four target modules (bench/engine/lora_mixed.py's) beside the base.
#   scripts/ui_screenshots.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-random:gpt2}
log=$(mktemp)
adapters=$(mktemp -d)
.venv/bin/python -c 'import sys; sys.path.insert(0, "bench"); from pathlib import Path
from engine.lora_mixed import write_adapter
from gpt2serve.engine.loading import load_model
write_adapter(Path(sys.argv[2]), load_model(sys.argv[1], "cpu", "float32").model.config, 8, 0)' "$model" "$adapters/coder"
.venv/bin/gpt2serve serve --model "$model" --device cpu --host 127.0.0.1 --http-port 0 --grpc-port 0 \
    --kv-cache-mb 512 --lora-modules coder="$adapters/coder" >"$log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; rm -rf "$log" "$adapters"' EXIT
for _ in $(seq 300); do grep -q "gpt2serve ready" "$log" && break; sleep 0.5; done
url=$(grep -o 'http=http://[^ ]*' "$log" | head -1 | cut -d= -f2)
prompt="The%20capital%20of%20France%20is"
shot() {  # NAME PATH HEIGHT
    chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --user-data-dir="$(mktemp -d)" \
        --virtual-time-budget=20000 --window-size=1300,"$3" --screenshot="docs/$1" "$url$2" 2>/dev/null
}
shot ui.png "/ui?prompt=$prompt&layer=5&head=3" 1500
shot ui-walkthrough.png "/ui?prompt=$prompt&layer=5&click=softmax:%20attention%20weights" 1450
shot ui-generate.png "/ui?view=generate&prompt=$prompt&max_tokens=8&temperature=0&step=4" 1300
shot ui-shapes.png "/ui?view=shapes&preset=llama-3-8b&tokens=5" 1250
shot ui-score.png "/ui?view=score&text=The%20capital%20of%20France%20is%20Paris%2C%20and%20it%20is%20lovely.&top_k=5" 1150
shot ui-adapter.png "/ui?prompt=$prompt&adapter=coder" 1100
ls -l docs/ui*.png
