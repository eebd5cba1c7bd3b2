"""GPT-2 next token behind LitServe, as a user would hand-roll it: transformers' GPT2LMHeadModel,
LitServe's dynamic batching, left padding with an attention mask, the last position's top 5.

It answers POST /v1/next-token with gpt2serve's body and result shape, so `bench/peers/rest_vs_litserve.py`
loads both servers with the same REST load generator. Run by that script; by hand:

    PYTHONPATH=.bench-deps .venv/bin/python bench/peers/litserve_gpt2.py --port 8090 [--max-batch-size 64]

(LitServe itself: `pip install --no-deps --target .bench-deps litserve==0.2.19`; its dependencies,
FastAPI and uvicorn, are gpt2serve's own, and pyzmq is in its dev extra.)
"""

from __future__ import annotations

import argparse
import time

import litserve as ls
import torch
from transformers import GPT2Config, GPT2LMHeadModel

TOP_K = 5


class GPT2NextToken(ls.LitAPI):
    def setup(self, device):
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config()).eval()  # GPT-2 small's shape, random weights

    def decode_request(self, request):
        return request["prompt_token_ids"]

    def batch(self, inputs):
        return inputs  # a list of token-id lists; padded in predict

    @torch.inference_mode()
    def predict(self, prompts):
        start = time.perf_counter()
        longest = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)  # (B, T), left padded
        mask = torch.zeros(len(prompts), longest, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits
        top = torch.log_softmax(logits[:, -1].float(), dim=-1).topk(TOP_K)  # (B, k)
        forward_ms = (time.perf_counter() - start) * 1000
        return [(prompt, values, indices, len(prompts), forward_ms)
                for prompt, values, indices in zip(prompts, top.values.tolist(), top.indices.tolist())]

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        prompt, values, indices, batch_size, forward_ms = output
        top = [{"token": "", "token_id": i, "logprob": v} for v, i in zip(values, indices)]
        return {"token": "", "token_id": indices[0], "logprob": values[0], "top": top, "prompt_token_ids": prompt,
                "timings": {"queue_ms": 0.0, "forward_ms": forward_ms, "total_ms": forward_ms},
                "batch_size": batch_size, "trace_id": "", "layers": []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--batch-timeout-s", type=float, default=0.025, help="as gpt2serve's --max-batch-delay-ms 25")
    args = parser.parse_args()
    api = GPT2NextToken(max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout_s,
                        api_path="/v1/next-token")
    server = ls.LitServer(api, accelerator="cpu", devices=1, timeout=120)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()
