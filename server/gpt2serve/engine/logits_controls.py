"""A request's controls on its row's logits before the row is sampled, each applied to that row
alone (its neighbours in the batch are never touched), in vLLM's order:

1. min_tokens: while fewer than `min_tokens` tokens were generated, the tokens in
   `banned_early` (the end-of-text token unless ignore_eos, and stop_token_ids) get -inf;
2. logit_bias (OpenAI): logit[j] += bias[j];
3. repetition_penalty p (CTRL, transformers' RepetitionPenaltyLogitsProcessor), over every token j
   in the prompt or the output so far: logit[j] / p where logit[j] > 0, else logit[j] * p;
4. frequency and presence penalties (OpenAI), over the output so far, c[j] the times j was
   generated: logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty;
5. a grammar (structured output, engine.constraints): -inf for every token it does not allow.

Then sampling divides by the temperature and applies min_p (engine.sampling): a token whose
probability is below min_p times the most likely one's is dropped (transformers' MinPLogitsWarper).
Greedy rows take the argmax of the controlled logits. Reported logprobs stay the model's own.

The penalties need each row's tokens. They are kept on the device (`TokenHistory`), written by
the step that samples them, so a step launched before the host read the last one (the overlap,
engine.generator) still sees every token. Only rows that ask for a penalty are written.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from ..protocol import StepControls, TopScores
from .constraints import Grammars, allowed
from .sampling import SamplingParams, to_device


def needs_history(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


class Row(Protocol):
    """What a running sequence tells the controls (engine.steps.Running)."""

    params: SamplingParams
    prompt: Sequence[int]
    prompt_length: int
    history_written: bool
    matcher: object  # its grammar's llguidance matcher (engine.constraints), made at its first step
    allowed: int  # the tokens its grammar allowed at its last step


class TokenHistory:
    """(slots, n_ctx) token ids on the device: each controlled row's prompt and output, by
    position, in its slot. Slots move with their sequences (`move`)."""

    def __init__(self, slots: int, n_ctx: int, device: torch.device):
        self.ids = torch.zeros(slots, n_ctx, dtype=torch.long, device=device)  # (S, T)
        self.device = device

    def write_prompt(self, slot: int, prompt: Sequence[int]) -> None:
        self.ids[slot, :len(prompt)] = to_device(list(prompt), self.device)

    def record(self, slots: list[int], positions: list[int], tokens: torch.Tensor) -> None:
        """tokens: (R,) the ids just sampled (on the device, not read), at these slots and positions."""
        self.ids[to_device(slots, self.device), to_device(positions, self.device)] = tokens.long()

    def move(self, source: int, target: int) -> None:
        self.ids[target] = self.ids[source]

    def counts(self, slots: list[int], starts: list[int], ends: list[int], vocab_size: int) -> torch.Tensor:
        """(R, V) float: how many times each token sits in positions [start, end) of each slot."""
        width = max(ends)
        ids = self.ids[to_device(slots, self.device), :width]  # (R, W)
        position = torch.arange(width, device=self.device)  # (W,)
        inside = ((position[None, :] >= to_device(starts, self.device)[:, None])
                  & (position[None, :] < to_device(ends, self.device)[:, None]))  # (R, W)
        counts = torch.zeros(len(slots), vocab_size, device=self.device)  # (R, V)
        return counts.scatter_add_(1, ids, inside.float())


def controlled_logits(logits: torch.Tensor, rows: Sequence[Row], slots: Sequence[int], generated: Sequence[int],
                      history: TokenHistory | None, grammars: Grammars | None = None) -> torch.Tensor | None:
    """(B, V) logits -> (B, V) fp32 logits with each row's controls applied, or None when no
    row has any. `generated[i]`: tokens row i generated before this one; the token chosen now
    will sit at position prompt_length + generated[i]."""
    chosen = [i for i, r in enumerate(rows) if r.params.controlled]
    if not chosen:
        return None
    device, vocab_size = logits.device, logits.shape[-1]
    out = logits.float().clone(memory_format=torch.contiguous_format)  # (B, V), row-major (see sampling.choose)
    early = [(i, t) for i in chosen if generated[i] < rows[i].params.min_tokens
             for t in rows[i].params.banned_early]
    if early:
        # The value a tensor already on the device: a Python float would be copied there from
        # pageable memory, which waits for the device (and so breaks the core's overlap).
        out.index_put_((to_device([i for i, _ in early], device), to_device([t for _, t in early], device)),
                       out.new_full((len(early),), float("-inf")))
    biased = [(i, t, b) for i in chosen for t, b in rows[i].params.logit_bias]
    if biased:
        out.index_put_((to_device([i for i, _, _ in biased], device), to_device([t for _, t, _ in biased], device)),
                       to_device([b for _, _, b in biased], device, torch.float32), accumulate=True)
    penalized = [i for i in chosen if needs_history(rows[i].params)]
    if penalized:
        assert history is not None
        for i in penalized:
            if not rows[i].history_written:
                history.write_prompt(slots[i], rows[i].prompt)
                rows[i].history_written = True
        params = [rows[i].params for i in penalized]
        index = to_device(penalized, device)  # (P,)
        p_slots = [slots[i] for i in penalized]
        ends = [rows[i].prompt_length + generated[i] for i in penalized]
        output = history.counts(p_slots, [rows[i].prompt_length for i in penalized], ends, vocab_size)  # (P, V)
        seen = history.counts(p_slots, [0] * len(penalized), ends, vocab_size) > 0  # (P, V): prompt or output
        x = out[index]  # (P, V)
        repetition = to_device([p.repetition_penalty for p in params], device, torch.float32)[:, None]  # (P, 1)
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        frequency = to_device([p.frequency_penalty for p in params], device, torch.float32)[:, None]  # (P, 1)
        presence = to_device([p.presence_penalty for p in params], device, torch.float32)[:, None]  # (P, 1)
        out[index] = x - output * frequency - (output > 0).float() * presence
    constrained = [i for i in chosen if rows[i].params.grammar]
    if constrained:  # last: a token its grammar does not allow is never chosen, whatever the bias
        for i in constrained:
            if rows[i].matcher is None:
                rows[i].matcher = grammars.matcher(rows[i].params.grammar)
        mask, counts = allowed([rows[i].matcher for i in constrained], vocab_size, device)  # (G, V), (G,)
        for i, n in zip(constrained, counts):
            rows[i].allowed = n  # told with the token this step samples (engine.sampling.read_choices)
        if len(constrained) == len(rows):
            out.masked_fill_(~mask, float("-inf"))
        else:
            index = to_device(constrained, device)  # (G,)
            out[index] = out[index].masked_fill(~mask, float("-inf"))
    return out


class _TracedStep:
    """A traced generation step's sequence (service.step_trace) as controlled_logits reads a
    running one: its prompt and the tokens before this step, its grammar's matcher fed those."""

    def __init__(self, sequence: Sequence[int], controls: StepControls, grammars: Grammars):
        self.params, self.prompt, self.prompt_length = controls.params, sequence, controls.prompt_length
        self.history_written, self.matcher, self.allowed = False, None, 0
        if self.params.grammar:
            self.matcher = grammars.matcher(self.params.grammar)
            self.matcher.consume_tokens(list(sequence[self.prompt_length:]))


def controlled_view(logits: torch.Tensor, sequences: Sequence[Sequence[int]], controls: Sequence[StepControls],
                    grammars: Grammars, k: int) -> list[tuple[TopScores, int]]:
    """What the controls made of R traced steps' (R, V) logits, by the same code as the
    generation's own steps (the token history and the grammar's state rebuilt from each
    sequence): per row, its top-k log-probabilities after them (temperature 1; only tokens left
    possible) and how many tokens they left possible."""
    rows = [_TracedStep(s, c, grammars) for s, c in zip(sequences, controls)]
    history = TokenHistory(len(rows), max(map(len, sequences)), logits.device)
    generated = [len(s) - c.prompt_length for s, c in zip(sequences, controls)]
    out = controlled_logits(logits, rows, range(len(rows)), generated, history, grammars)  # (R, V)
    out = logits.float() if out is None else out
    possible = torch.isfinite(out)  # (R, V)
    logprobs = torch.log_softmax(out, dim=-1)  # (R, V)
    values, ids = torch.topk(logprobs, min(k, out.shape[-1]), dim=-1)  # (R, k) each
    views = []
    for row_values, row_ids, n in zip(values.tolist(), ids.tolist(), possible.sum(dim=-1).tolist()):
        shown = min(k, n)  # never a token the controls ruled out
        views.append((TopScores(row_ids[:shown], row_values[:shown]), n))
    return views
