"""`gpt2serve serve` with faults injected into the engine (for test_faults.py).

Real server, real ports; only the forward pass misbehaves, on prompts that ask for it:
- a prompt containing FAIL_TOKEN makes its batch's forward raise (a bug, a bad kernel);
- a batch of more than one prompt that contains OOM_TOKEN raises the engine's OutOfMemory, as a
  CUDA out-of-memory does on a GPU (there is no GPU here), so the scheduler must split it;
- NAN_TOKEN embeds as NaN, as an fp16 overflow would leave a position of the residual stream,
  and the real forward carries it on: through attention to the later tokens of its prompt (and
  to any prompt packed beside it, engine.step_forward). Only that request may fail.
Each forward's batch size is printed, so the test can see the splits.
"""

import sys

import torch

from gpt2serve.cli import main
from gpt2serve.engine import engine as engine_module
from gpt2serve.engine import gpt2 as gpt2_module

FAIL_TOKEN = 40000
OOM_TOKEN = 40001
NAN_TOKEN = 40002
real_next_token = engine_module.Engine.next_token
real_embedding = gpt2_module.Embedding.forward


def next_token(self, asks):
    prompts = [a.prompt for a in asks]
    if any(FAIL_TOKEN in p for p in prompts):
        raise RuntimeError("injected fault in the forward pass")
    if len(prompts) > 1 and any(OOM_TOKEN in p for p in prompts):
        print(f"injected OOM for a batch of {len(prompts)}", flush=True)
        raise engine_module.OutOfMemory("CUDA out of memory (injected)")
    return real_next_token(self, asks)


def embedding(self, ids):
    vectors = real_embedding(self, ids)  # (B, T, C)
    return torch.where((ids == NAN_TOKEN)[..., None], float("nan"), vectors)


engine_module.Engine.next_token = next_token
gpt2_module.Embedding.forward = embedding

if __name__ == "__main__":
    sys.exit(main())
