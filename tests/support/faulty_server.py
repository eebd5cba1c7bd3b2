"""`gpt2serve serve` with faults injected into the engine (for test_faults.py).

Real server, real ports; only the forward pass misbehaves, on prompts that ask for it:
- a prompt containing FAIL_TOKEN makes its batch's forward raise (a bug, a bad kernel);
- a batch of more than one prompt that contains OOM_TOKEN raises the engine's OutOfMemory, as a
  CUDA out-of-memory does on a GPU (there is no GPU here), so the scheduler must split it;
- a prompt containing NAN_TOKEN gets NaN logits in its own row (next-token, and every step of a
  generation), as an fp16 overflow would: only that request may fail.
Each forward's batch size is printed, so the test can see the splits.
"""

import sys

import torch

from gpt2serve.cli import main
from gpt2serve.engine import engine as engine_module
from gpt2serve.engine import generator as generator_module
from gpt2serve.engine import gpt2 as gpt2_module

FAIL_TOKEN = 40000
OOM_TOKEN = 40001
NAN_TOKEN = 40002
real_next_token = engine_module.Engine.next_token
real_hidden_states = gpt2_module.GPT2.hidden_states
real_prefill = generator_module.Generator.prefill
real_choose = generator_module.Generator._choose
poisoned_sequences: set[int] = set()


def next_token(self, prompts, top_ks, traced_rows=(), mapped_rows=(), last_row_rows=(), scored_rows=None):
    if any(FAIL_TOKEN in p for p in prompts):
        raise RuntimeError("injected fault in the forward pass")
    if len(prompts) > 1 and any(OOM_TOKEN in p for p in prompts):
        print(f"injected OOM for a batch of {len(prompts)}", flush=True)
        raise engine_module.OutOfMemory("CUDA out of memory (injected)")
    return real_next_token(self, prompts, top_ks, traced_rows, mapped_rows, last_row_rows, scored_rows)


def hidden_states(self, input_ids, *args, **kwargs):
    hidden = real_hidden_states(self, input_ids, *args, **kwargs)  # (B, T, C)
    poisoned = (input_ids == NAN_TOKEN).any(dim=-1)  # (B,)
    return torch.where(poisoned[:, None, None], float("nan"), hidden)


def prefill(self, sequences):
    poisoned_sequences.update(s.seq_id for s in sequences if NAN_TOKEN in s.prompt)
    return real_prefill(self, sequences)


def choose(self, logits, rows):
    poisoned = torch.tensor([r.seq_id in poisoned_sequences for r in rows])  # (B,)
    return real_choose(self, torch.where(poisoned[:, None], float("nan"), logits), rows)


engine_module.Engine.next_token = next_token
gpt2_module.GPT2.hidden_states = hidden_states
generator_module.Generator.prefill = prefill
generator_module.Generator._choose = choose

if __name__ == "__main__":
    sys.exit(main())
