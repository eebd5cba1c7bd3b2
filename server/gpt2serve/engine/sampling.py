"""Choosing the next token of each generating row: greedy, or sampled with temperature, top-k
and top-p from one uniform draw per row.

The draw comes from the sequence's own seeded generator (engine.generator), and the token it
picks depends only on that row's logits and settings (inverse CDF over the row's candidates in
an order fixed by its own settings), so a seed gives the same text whatever shares the batch,
as far as the row's logits are the same. On cuda they are not quite: cuBLAS picks its kernels by
shape, so another batch makeup changes logits in their last bits, and a draw within that of a
step of the CDF picks the neighbour (measured on an H100: top-p 0.95 over a random model's flat
tail, steps about 1e-5 wide, diverged after five tokens; top-k's steps are far wider).

Every valid setting gives a valid token: logits are shifted so each row's best is 0 before they
are divided by the temperature, so a tiny temperature gives -inf for the others (weight 0), never
inf - inf = NaN; below GREEDY_TEMPERATURE a row is greedy. A row whose logits are not finite (a
NaN or +inf anywhere, or -inf everywhere: a numerical overflow in the model, e.g. fp16 on a GPU)
is flagged, not sampled: the caller fails that row alone, and its NaNs never reach another row.

Reported log-probabilities are the model's own (temperature 1, nothing filtered), as OpenAI's
API reports them.

On cuda, choose() never waits for the device: the rows' settings and draws reach it through
pinned memory (to_device), and nothing is read back, so the engine core can queue the next decode
step while this one runs (engine.generator.Generator.launch).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..protocol import SampledToken, SamplingParams, TokenScore

# A warm-up sequence's: every sampling and control path runs once before the server is ready.
WARM_UP_PARAMS = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.1, repetition_penalty=1.1,
                                logit_bias=((0, 1.0),), min_p=0.01, min_tokens=2, banned_early=(0,))

# Columns of choose()'s answer before the n top logprobs and their ids.
TOKEN, LOGPROB, FINITE, TOP = 0, 1, 2, 3


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list on `device`. On cuda through pinned memory, so the copy is queued
    behind the device's work instead of waiting for it (a pageable copy waits)."""
    host = torch.tensor(values, dtype=dtype)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def to_host(values: torch.Tensor, done: torch.cuda.Event) -> torch.Tensor:
    """A cuda tensor copied into pinned host memory without waiting for it; `done` is recorded
    behind the copy, so it fires once the values have landed (a launched step's answers)."""
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done.record()
    return host


def choose(logits: torch.Tensor, params: list[SamplingParams], uniform: list[float],
           controlled: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) logits -> (B, 3 + 2n) fp32: [token id, its logprob, finite (1.0 or 0.0), n top
    logprobs, their ids], n the most alternatives any row asked for; one tensor, so one copy to
    the host. A row that is not finite has token 0 and must not be used. `controlled`: the
    logits after each row's penalties, bias and min_tokens (engine.logits_controls), which the
    choice is made from; the logprobs reported stay the model's own."""
    # (B, V) row-major: on a CPU the lm_head's output is a transposed view (engine.gpt2.Linear), and
    # each row-wise op below read it 10-60x slower than a copy costs (16 rows: amax 2.1 ms against
    # 0.03, log_softmax 3.3 against 0.3; the copy 0.9).
    logits = logits.float().contiguous()
    finite = torch.isfinite(logits.amax(dim=-1))  # (B,): amax is NaN or +inf if any entry is, -inf if all are
    logits = torch.where(finite[:, None], logits, 0.0)  # (B, V): a bad row cannot poison the rest
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V)
    greedy = logprobs
    if controlled is not None:
        finite &= controlled.amax(dim=-1) > float("-inf")  # (B,): the controls left something to choose
        logits = greedy = torch.where(finite[:, None], controlled, 0.0)  # (B, V)
    tokens = greedy.argmax(dim=-1)  # (B,): greedy unless sampled below
    by_mode: dict[str, list[int]] = {}
    for row, p in enumerate(params):
        if not p.greedy:
            by_mode.setdefault("top_k" if p.top_k else "sorted" if p.top_p < 1.0 else "all", []).append(row)
    for mode, rows in by_mode.items():
        index = to_device(rows, logits.device)  # (S,)
        tokens[index] = _sample(logits[index], [params[r] for r in rows], [uniform[r] for r in rows], mode)
    n = max(p.logprobs for p in params)
    chosen = logprobs.gather(1, tokens[:, None])  # (B, 1)
    top_values, top_ids = torch.topk(logprobs, n, dim=-1)  # (B, n) each
    return torch.cat((tokens[:, None].float(), chosen, finite[:, None].float(), top_values, top_ids.float()),
                     dim=1)  # (B, 3 + 2n)


def _sample(logits: torch.Tensor, params: list[SamplingParams], uniform: list[float], mode: str) -> torch.Tensor:
    """(S, V) finite logits of rows that all sample the same way -> (S,) token ids.

    The candidates' order depends on the mode alone, which a row's own settings decide:
    top_k: the k best, best first (the first k of any longer top list are the same);
    sorted: best first (for top-p): the best TOP_P_CANDIDATES when they hold top_p of the mass,
    else the whole vocabulary, decided row by row from its own logits;
    all: vocabulary order (nothing to cut)."""
    device = logits.device
    temperature = to_device([p.temperature for p in params], device, torch.float32)  # (S,)
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # (S, V): best 0, others <= 0, never +inf
    scaled = shifted / temperature[:, None]  # (S, V): in [-inf, 0], the best one exactly 0
    scaled = min_p_filter(scaled, [p.min_p for p in params])
    if mode == "sorted":
        return _sample_top_p(scaled, params, uniform)
    ids = None
    if mode == "top_k":
        scaled, ids = torch.topk(scaled, max(p.top_k for p in params), dim=-1)  # (S, C), best first
    return _pick(torch.softmax(scaled, dim=-1), ids, params, uniform, cut=mode != "all")  # softmax: finite, some entry is 0


def min_p_filter(scaled: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """(S, V) logits over the temperature, each row's best exactly 0 -> the same with -inf for
    every token less likely than min_p times the best one (the ratio of their probabilities is
    exp(scaled)); a row's min_p of 0 keeps all (log 0 = -inf)."""
    if not any(min_p):
        return scaled
    floor = to_device(min_p, scaled.device, torch.float32).log()  # (S,)
    return scaled.masked_fill(scaled < floor[:, None], float("-inf"))


# Sorting 50257 logits took 5 ms a row on a 2-core CPU (39 ms for 16), a top-256 0.3 ms (2 ms):
# most nuclei are far narrower than that, so top-p looks there first.
TOP_P_CANDIDATES = 256


def _sample_top_p(scaled: torch.Tensor, params: list[SamplingParams], uniform: list[float]) -> torch.Tensor:
    """(S, V) scaled logits of top-p rows (no top-k) -> (S,) token ids. Probabilities are over the
    whole vocabulary either way, so the rows that need their whole vocabulary sorted get the
    same candidates, in the same order, as the others' best TOP_P_CANDIDATES."""
    log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (S, 1): finite, some entry is 0
    if scaled.device.type != "cpu":  # a sort is cheap there, and choosing the rows would wait for the device
        candidates, ids = torch.sort(scaled, dim=-1, descending=True)  # (S, V)
        return _pick((candidates - log_total).exp(), ids, params, uniform, cut=True)
    best, best_ids = torch.topk(scaled, min(TOP_P_CANDIDATES, scaled.shape[1]), dim=-1)  # (S, K), best first
    best_probs = (best - log_total).exp()  # (S, K): over the whole vocabulary
    top_p = torch.tensor([p.top_p for p in params])  # (S,)
    enough = best_probs.sum(dim=-1) >= top_p  # (S,): the nucleus ends within the K best
    tokens = torch.empty(scaled.shape[0], dtype=torch.long, device=scaled.device)  # (S,)
    for rows, short in ((enough.nonzero()[:, 0], True), ((~enough).nonzero()[:, 0], False)):
        if len(rows) == 0:
            continue
        chosen = rows.tolist()
        if short:
            probs, ids = best_probs[rows], best_ids[rows]  # (R, K)
        else:
            candidates, ids = torch.sort(scaled[rows], dim=-1, descending=True)  # (R, V)
            probs = (candidates - log_total[rows]).exp()
        tokens[rows] = _pick(probs, ids, [params[r] for r in chosen], [uniform[r] for r in chosen], cut=True)
    return tokens


def _pick(probs: torch.Tensor, ids: torch.Tensor | None, params: list[SamplingParams], uniform: list[float],
          cut: bool) -> torch.Tensor:
    """(S, C) probabilities of each row's candidates, best first when `cut` (then top-k and top-p
    keep a prefix) -> (S,) token ids, by inverse CDF at each row's uniform draw."""
    device = probs.device
    if cut:
        rank = torch.arange(probs.shape[1], device=device)  # (C,)
        top_k = to_device([p.top_k or probs.shape[1] for p in params], device)  # (S,)
        top_p = to_device([p.top_p for p in params], device, torch.float32)  # (S,)
        mass_before = probs.cumsum(dim=-1) - probs  # (S, C): probability of the better candidates
        keep = (rank[None, :] < top_k[:, None]) & (mass_before < top_p[:, None])  # the best one always
        keep[:, 0] = True  # (even if rounding made mass_before[0] a hair above 0 and top_p is tiny)
        probs = probs * keep
    # The last candidate a draw may land on: the last with any probability. A draw near 1 times a
    # total that rounds to the total itself falls past the CDF's end, onto a token of probability
    # 0 (logprob -inf) unless clamped here (temperature 1e-5 over logits of 3e38 did that).
    positive = (probs > 0).flip(-1).int()  # (S, C): the best candidate always has some
    last = probs.shape[1] - 1 - positive.argmax(dim=-1)  # (S,)
    cdf = probs.cumsum(dim=-1)  # (S, C)
    target = to_device(uniform, device, cdf.dtype) * cdf[:, -1]  # (S,)
    picked = torch.minimum(torch.searchsorted(cdf, target[:, None], right=True), last[:, None])  # (S, 1)
    return picked[:, 0] if ids is None else ids.gather(1, picked)[:, 0]


def read_choices(chosen: list[list[float]], rows: Sequence) -> tuple[dict[int, SampledToken], frozenset[int]]:
    """The host's part of a step: each row's (3 + 2n) values from choose() become its token, or
    mark the row failed (rows: engine.generator's running sequences, `finite` set False there)."""
    n = (len(chosen[0]) - TOP) // 2
    out, failed = {}, set()
    for r, values in zip(rows, chosen):
        token = int(values[TOKEN])
        if not values[FINITE]:
            r.finite = False
            failed.add(r.seq_id)
            continue
        if r.matcher is not None:
            r.matcher.consume_token(token)  # allowed by its mask, so taken (at the end: the end of text)
        k = r.params.logprobs
        top = [TokenScore(int(i), v) for v, i in zip(values[TOP:TOP + k], values[TOP + n:TOP + n + k])] if k else []
        out[r.seq_id] = SampledToken(token, values[LOGPROB], top, r.allowed)
    return out, frozenset(failed)
