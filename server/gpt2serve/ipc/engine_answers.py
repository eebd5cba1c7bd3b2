"""How the engine's answers go back through the IPC door (ipc.engine_server): a generation's
events to the front end that asked (PeerSink), and a front end's one-prompt calls answered
straight into its Answers message of the batch (PlainCalls)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from ..protocol import Answers, SampledToken, Step, TokenEvent, Tokens, TopScores, TopTable
from .framing import Outbox

if TYPE_CHECKING:
    from ..scheduling.core import EngineCore
    from ..scheduling.scheduler import EngineRequest

Key = tuple[int, int]  # (front end's connection number, its request id)


class EngineServer(Protocol):
    """What the answers use of ipc.engine_server.EngineServer."""

    outbox: Outbox
    generations: dict[Key, int]
    core: EngineCore
    send_error: Callable[[Key, Exception, str], None]
    answers_of_batch: Callable[..., Answers]


class PeerSink:
    """A generation's events, on their way back to the front end that asked."""

    def __init__(self, server: EngineServer, key: Key):
        self.server, self.key = server, key

    def put(self, event: TokenEvent) -> None:
        """A plain token joins the peer's Tokens message of this step (one per front end per
        step); a first token, with its extras, goes as a Step."""
        if not (event.queue_s or event.prompt_logprobs is not None or event.cached_tokens):
            self.put_plain(event.token, event.finish_reason, event.forward_s, event.batch_size)
            return
        if event.finish_reason:
            self.server.generations.pop(self.key, None)
        self.server.outbox.put(self.key[0], Step(self.key[1], event))

    def put_plain(self, token: SampledToken, finish_reason: str, forward_s: float, batch_size: int) -> None:
        """A token with no extras, straight into the peer's Tokens message of this step."""
        server, (peer, request_id) = self.server, self.key
        if finish_reason:
            server.generations.pop(self.key, None)
        tokens = server.outbox.last(peer)  # only the last: a later token must not pass an earlier Step
        if type(tokens) is not Tokens or tokens.forward_s != forward_s or tokens.batch_size != batch_size:
            tokens = Tokens([], [], [], [], [], forward_s, batch_size, [])
            server.outbox.put(peer, tokens)
        tokens.request_ids.append(request_id)
        tokens.token_ids.append(token.token_id)
        tokens.logprobs.append(token.logprob)
        tokens.finish_reasons.append(finish_reason)
        tokens.tops.append(token.top)
        tokens.allowed.append(token.allowed)

    def fail(self, error: Exception) -> None:
        self.server.generations.pop(self.key, None)
        self.server.send_error(self.key, error, "generation")


class PlainCalls:
    """A front end's one-prompt calls, the core's output for each of their requests (request_id:
    the call's id): an answer goes straight into the front end's Answers message of the batch,
    with no PromptGroup, NextTokenOutput or object of its own made for it."""

    __slots__ = ("server", "peer", "pending")
    answers_top, finished = True, False  # finished: a call leaves `pending` instead

    def __init__(self, server: EngineServer, peer: int):
        self.server, self.peer = server, peer
        self.pending: dict[int, EngineRequest] = {}  # queued and not yet answered, by call id

    @staticmethod
    def answer_tops(requests: list[EngineRequest], rows: list[int], tops: Sequence[TopScores], started: float,
                    cached_tokens: list[int], forward_s: float, batch_size: int, batch_started_ns: int) -> None:
        """The plain calls a batch answered (`rows`: theirs in `tops`; `cached_tokens`: per batch row, [] if none),
        in columns: each front end's join its Answers of the batch (as rows of `tops` if a TopTable, not TopScores)."""
        by_front_end: dict[PlainCalls, tuple[list[EngineRequest], list[int]]] = {}
        for request, row in zip(requests, rows):
            calls = request.output
            if calls.pending.pop(request.request_id, None) is None:
                continue  # cancelled: nobody to answer
            taken = by_front_end.get(calls) or by_front_end.setdefault(calls, ([], []))
            taken[0].append(request)
            taken[1].append(row)
        table = tops if type(tops) is TopTable else None
        for calls, (answered, answered_rows) in by_front_end.items():
            calls.server.answers_of_batch(calls.peer, forward_s, batch_size, batch_started_ns, table).extend(
                [r.request_id for r in answered],
                answered_rows if table is not None else [tops[row] for row in answered_rows],
                [started - r.arrived for r in answered], [r.arrived_ns for r in answered],
                [cached_tokens[row] for row in answered_rows] if cached_tokens else [0] * len(answered))

    def fail(self, error: Exception, request: EngineRequest) -> None:
        if self.cancel(request.request_id):
            self.server.send_error((self.peer, request.request_id), error, "request")

    def cancel(self, call_id: int) -> bool:
        """The call leaves the queue (as a PromptGroup's prompts); False when it was not pending."""
        request = self.pending.pop(call_id, None)
        if request is None:
            return False
        self.server.core.cancel_requests((request,))
        return True

    def cancel_all(self) -> int:
        """Every pending call leaves the queue (its front end is gone); how many there were."""
        requests, self.pending = list(self.pending.values()), {}
        self.server.core.cancel_requests(requests)
        return len(requests)
