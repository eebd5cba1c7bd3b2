"""What the engine's steps take and give: a step's plan, a new sequence, a running one, a step
on its way and its output (engine.generator runs them), a next-token batch on its way and its
output (engine.engine)."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from gpt2serve_client.types import LayerReport, ShapeStep

from ..introspection.probe import LayerProbe
from ..protocol import PromptScores, SampledToken, SamplingParams, StepControls, TopScores, TopTable, TraceContext
from ..telemetry.records import ForwardTimeline
from .head import read_top_k
from .lora import LoraAdapter


@dataclass(frozen=True)
class NewSequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    seed: int  # of the sequence's own generator: the same seed, the same draws
    prompt_logprobs: int | None = None  # score the prompt's positions too, with this many alternatives
    adapter: LoraAdapter | None = None  # its LoRA adapter (engine.lora); None: the base model


class PromptAsk(Protocol):
    """A next-token prompt and what it wants back, whether it runs in a batch of its own
    (Engine.next_token) or rides a generation step (Generator.launch): its top `top_k` next
    tokens; with `prompt_logprobs`, every position's log-probability with that many alternatives
    (engine.head); with a `trace` that wants layers, per-layer reports (introspection); with
    `controls`, a traced generation step's top tokens after them too; with `adapter`, under that
    LoRA adapter (engine.lora). scheduling's EngineRequest is one; `Ask` is one for every other
    caller."""

    prompt: Sequence[int]
    top_k: int
    prompt_logprobs: int | None
    trace: TraceContext | None
    controls: StepControls | None
    adapter: LoraAdapter | None


@dataclass(slots=True)  # not frozen: made per prompt (see protocol's PER_REQUEST)
class Ask:
    prompt: Sequence[int]
    top_k: int = 1
    prompt_logprobs: int | None = None
    trace: TraceContext | None = None
    controls: StepControls | None = None
    adapter: LoraAdapter | None = None


def traced(ask: PromptAsk) -> bool:
    """Whether a prompt's forward runs whole and traced (engine.engine): it wants per-layer reports,
    or a traced generation step's controls. Such a prompt rides no decode step and no graph."""
    return ask.controls is not None or (ask.trace is not None and ask.trace.layers_wanted)


def plain_asks(prompts: Sequence[Sequence[int]], top_ks: Sequence[int] | int = 1) -> list[Ask]:
    """Plain asks: each prompt's top-k (one k for all, or one each)."""
    ks = [top_ks] * len(prompts) if isinstance(top_ks, int) else top_ks
    return [Ask(p, k) for p, k in zip(prompts, ks)]


@dataclass(frozen=True)
class BatchOutput:
    top: Sequence[TopScores]  # per prompt, most likely first (a TopTable: rows read when indexed)
    forward_s: float
    padded_len: int
    started_ns: int  # wall clock (time.time_ns) of the forward
    ended_ns: int
    cuda_graph: bool = False  # replayed from a captured graph (padded_len is then the bucket's)
    layers: dict[int, list[LayerReport]] = field(default_factory=dict)  # traced row -> one report per block
    walkthrough: list[ShapeStep] = field(default_factory=list)  # with layers: the forward's shapes
    # Rows whose log-probs were not finite (a numerical overflow, e.g. fp16): their `top` is
    # meaningless, and the scheduler fails them alone.
    failed_rows: frozenset[int] = frozenset()
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # scored row -> its positions 1..L-1
    cached_tokens: list[int] = field(default_factory=list)  # per row, prompt tokens read from the prefix cache
    controlled: dict[int, tuple[TopScores, int]] = field(default_factory=dict)  # row -> controlled_view's
    base_top: dict[int, TopScores] = field(default_factory=dict)  # compare_base row -> the base model's top
    timeline: ForwardTimeline | None = None  # stage times, when any row was traced
    probe: LayerProbe | None = None  # set until Engine.layer_reports() has turned it into `layers`


@dataclass(frozen=True)
class StepPlan:
    """The rows of one step (Generator.launch), all of them in one forward:
    `decode`, one row of one position for every running sequence; `riders`, next-token prompts
    that keep no slot (their top-k, their scores); `joining`, new sequences whose prompts go into
    slots, each with its first token; `chunk`, that many tokens at most of the oldest prompt read
    in chunks (engine.chunked_prefill; 0: none). Prompts start after what the prefix cache holds of them. A plan
    of joining sequences alone is a prefill, which on cuda may replay a graph (engine.cuda_graphs);
    one of riders alone is a next-token batch (engine.engine), which may too."""

    decode: bool = True
    riders: Sequence[PromptAsk] = ()
    joining: Sequence[NewSequence] = ()
    chunk: int = 0

    @property
    def next_token(self) -> bool:
        """Riders alone: a next-token batch (engine.engine)."""
        return not (self.decode or self.joining or self.chunk)

    @property
    def decode_only(self) -> bool:
        """No prompt rides: a step that may be read a step late (the overlap)."""
        return not (self.riders or self.joining or self.chunk)


@dataclass(frozen=True)
class StepOutput:
    tokens: dict[int, SampledToken]  # seq_id -> its new token
    kind: str  # "prefill", "decode" or "next-token" (riders alone)
    rows: int  # sequences in the forward
    tokens_in: int  # tokens the forward computed: one per decode row, prompt tokens past the prefix cache
    forward_s: float
    started_ns: int  # wall clock, for the step's span
    ended_ns: int
    # Sequences whose logits were not finite (a numerical overflow): no token; the scheduler
    # fails them alone, and frees their slots at the next step.
    failed: frozenset[int] = frozenset()
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # seq_id -> its prompt's, where read
    cached_tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> prompt tokens from the prefix cache
    prompt_tokens: int = 0  # prompt tokens computed (a prefill's, a chunk's), riders' aside
    # sequences whose prompt was read to its end in this decode step (their prompt or its last
    # chunk rode it): their tokens are first tokens, as a prefill's are
    prompts_read: frozenset[int] = frozenset()
    riders: BatchOutput | None = None  # the next-token prompts that rode the step, answered as a batch's

    def first(self, seq_id: int) -> bool:
        """Whether this step gave the sequence its first token."""
        return self.kind == "prefill" or seq_id in self.prompts_read


@dataclass
class Running:
    seq_id: int
    params: SamplingParams
    rng: random.Random
    length: int  # positions filled in its cache slot (its last sampled token, in last_ids, is fed next)
    prompt_length: int = field(default=0)
    prompt: Sequence[int] = ()  # for its penalties' history (engine.logits_controls)
    matcher: object = None  # its grammar's (engine.constraints), made at its first step
    allowed: int = 0  # the tokens its grammar allowed at its last step
    finite: bool = True  # False once a step's logits were not finite: its slot is cleared as it leaves
    unread: int = 0  # decode steps launched for it whose answers the host has not read yet
    history_written: bool = False  # its prompt and tokens are in the token history
    adapter: LoraAdapter | None = None  # engine.lora

    @classmethod
    def of(cls, sequence: NewSequence, length: int | None = None) -> Running:
        """A sequence joining with its prompt in its slot (`length`: positions filled, default all)."""
        length = len(sequence.prompt) if length is None else length
        return cls(sequence.seq_id, sequence.params, random.Random(sequence.seed), length, length, sequence.prompt,
                   adapter=sequence.adapter)


@dataclass
class PackedAnswers:
    """What a decode step's packed forward (engine.step_forward) gave beside the decode tokens."""

    riders: BatchOutput | None = None  # the riders' answers, timed once the step is read
    prompt_tokens: int = 0  # of the chunk and the joining prompts, computed
    prompt_rows: int = 0  # sequences that joined, and the one whose chunk was read
    first_tokens: dict[int, SampledToken] = field(default_factory=dict)  # of the sequences that joined
    first_failed: frozenset[int] = frozenset()
    cached_tokens: dict[int, int] = field(default_factory=dict)
    prompt_scores: dict[int, PromptScores] = field(default_factory=dict)  # of the joining sequences scored
    failed_plans: list[int] = field(default_factory=list)  # prompts (riders, then joining) not finite

    @classmethod
    def merged(cls, parts: list[PackedAnswers], firsts: list[int]) -> PackedAnswers:
        """One prefill's answers from its parts' (joining prompts alone; part i's from prompt firsts[i])."""
        if len(parts) == 1:
            return parts[0]
        return cls(prompt_tokens=sum(p.prompt_tokens for p in parts), prompt_rows=sum(p.prompt_rows for p in parts),
                   first_tokens={k: v for p in parts for k, v in p.first_tokens.items()},
                   first_failed=frozenset().union(*(p.first_failed for p in parts)),
                   cached_tokens={k: v for p in parts for k, v in p.cached_tokens.items()},
                   prompt_scores={k: v for p in parts for k, v in p.prompt_scores.items()},
                   failed_plans=[a + i for a, p in zip(firsts, parts) for i in p.failed_plans])


@dataclass
class StepLaunch:
    """A step on its way: its decode rows' answers are in `chosen` once `done` has fired (a
    prefill's are in `packed` already); a next-token batch's are `prompts`, read or on its way."""

    rows: list[Running]
    chosen: torch.Tensor  # (B, 3 + 2n) fp32 on the host (pinned on cuda): choose()'s answers
    done: "torch.cuda.Event | None"  # cuda: fires when the copy into `chosen` has landed; None: there
    device_started: "torch.cuda.Event | None"  # cuda: the step's start on the device, for its time
    tokens_in: int
    started: float
    started_ns: int
    forward_s: float = 0.0  # the host's time to launch it (the whole step on a CPU)
    packed: PackedAnswers | None = None  # its prompt rows' answers (riders, joining, a chunk)
    prompts: BatchOutput | PromptLaunch | None = None  # a next-token batch's

    @property
    def answered(self) -> bool:
        """Whether its answers are on the host already: nothing runs on that a later read could overlap."""
        return self.done is None and not isinstance(self.prompts, PromptLaunch)


@dataclass(slots=True)
class PromptLaunch:
    """A plain next-token batch on its way (engine.cuda_graphs.BucketedForward.launch): its top-k
    values and ids are in `both` once `done` has fired."""

    both: torch.Tensor  # (2, B, k_max) on the host (pinned on cuda)
    done: "torch.cuda.Event | None"  # cuda: fires when the copy into `both` has landed; None: there
    device_started: "torch.cuda.Event | None"
    top_ks: Sequence[int]
    padded_len: int  # the bucket's length
    started: float
    started_ns: int
    looked_up: bool  # the prefix cache is on: each prompt reports 0 tokens read from it

    def read(self) -> tuple[TopTable, frozenset[int], float]:
        """Wait for the top-k (cuda; on a CPU it is there) and read it: each row's top-k, the rows
        not finite, and the batch's device seconds (on a CPU, since its launch)."""
        forward_s = time.perf_counter() - self.started
        if self.done is not None:
            self.done.synchronize()  # lets go of the GIL while it waits
            forward_s = self.device_started.elapsed_time(self.done) / 1000
        top, failed = read_top_k(self.both, self.top_ks)
        return top, failed, forward_s
