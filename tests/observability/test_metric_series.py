"""Metrics.request_done's held series and its observe(): the same samples as prometheus_client's
own Histogram.observe, for values on, just under and just over every bucket bound; and an
answered request moves its counters and histograms by exactly one call's worth, and leaves the
in-flight gauge where it was."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Histogram

from gpt2serve.telemetry.metrics import DURATION_BUCKETS, QUEUE_BUCKETS, Metrics, observe
from gpt2serve.telemetry.records import RequestDone


def samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect() for s in family.samples if not s.name.endswith("_created")}


def test_observe_matches_the_library_on_every_bound():
    values = [0.0, -1.0, 1e9, math.inf]
    for bound in DURATION_BUCKETS + QUEUE_BUCKETS:
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = Histogram("h", "h", ["api"], buckets=DURATION_BUCKETS, registry=ours).labels(api="rest")
    library = Histogram("h", "h", ["api"], buckets=DURATION_BUCKETS, registry=theirs).labels(api="rest")
    for value in values:
        observe(mine, value)
        library.observe(value)
    assert samples(ours) == samples(theirs)
    assert samples(ours)[("h_count", (("api", "rest"),))] == len(values)


def test_an_answered_request_moves_each_series_by_one_call():
    metrics = Metrics()
    before = samples(metrics.registry)
    for _ in range(3):
        metrics.request_started()
    metrics.request_done(RequestDone("rest", "NextToken", "OK", 0.03, "", 5, 1, (0.002,), None))
    metrics.request_done(RequestDone("grpc", "Generate", "OK", 0.5, "", 7, 16, (0.001,), 0.004))
    metrics.request_done(RequestDone("rest", "NextToken", "INVALID_ARGUMENT", 0.001))
    after = samples(metrics.registry)
    moved = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    rest, grpc = (("api", "rest"),), (("api", "grpc"),)
    assert moved == {
        ("gpt2serve_requests_total", (("api", "rest"), ("method", "NextToken"), ("status", "OK"))): 1,
        ("gpt2serve_requests_total", (("api", "rest"), ("method", "NextToken"), ("status", "INVALID_ARGUMENT"))): 1,
        ("gpt2serve_requests_total", (("api", "grpc"), ("method", "Generate"), ("status", "OK"))): 1,
        **{("gpt2serve_request_duration_seconds_bucket", (*api, ("le", le), ("method", m))): 1
           for api, m, les in ((rest, "NextToken", ("0.04", "0.08", "0.16", "0.32", "0.64", "1.28", "2.56", "5.12",
                                                    "10.24", "20.48", "40.96", "81.92", "+Inf")),
                               (grpc, "Generate", ("0.64", "1.28", "2.56", "5.12", "10.24", "20.48", "40.96",
                                                   "81.92", "+Inf")))
           for le in les},
        ("gpt2serve_request_duration_seconds_count", (*rest, ("method", "NextToken"))): 1,
        ("gpt2serve_request_duration_seconds_sum", (*rest, ("method", "NextToken"))): 0.03,
        ("gpt2serve_request_duration_seconds_count", (*grpc, ("method", "Generate"))): 1,
        ("gpt2serve_request_duration_seconds_sum", (*grpc, ("method", "Generate"))): 0.5,
        # a next token is the first token; a generation reports its own as it comes (first_token)
        **{("gpt2serve_time_to_first_token_seconds_bucket", (*rest, ("le", le), ("method", "NextToken"))): 1
           for le in ("0.04", "0.08", "0.16", "0.32", "0.64", "1.28", "2.56", "5.12", "10.24", "20.48", "40.96",
                      "81.92", "+Inf")},
        ("gpt2serve_time_to_first_token_seconds_count", (*rest, ("method", "NextToken"))): 1,
        ("gpt2serve_time_to_first_token_seconds_sum", (*rest, ("method", "NextToken"))): 0.03,
        ("gpt2serve_prompt_tokens_total", rest): 5, ("gpt2serve_prompt_tokens_total", grpc): 7,
        ("gpt2serve_generated_tokens_total", rest): 1, ("gpt2serve_generated_tokens_total", grpc): 16,
        **{("gpt2serve_queue_duration_seconds_bucket", (("le", le),)): n
           for le, n in (("0.001", 1), ("0.0025", 2), ("0.005", 2), ("0.01", 2), ("0.025", 2), ("0.05", 2),
                         ("0.1", 2), ("0.25", 2), ("0.5", 2), ("1.0", 2), ("2.5", 2), ("5.0", 2), ("10.0", 2),
                         ("+Inf", 2))},
        ("gpt2serve_queue_duration_seconds_count", ()): 2,
        ("gpt2serve_queue_duration_seconds_sum", ()): 0.003,
        **{("gpt2serve_time_per_output_token_seconds_bucket", (*grpc, ("le", le))): 1
           for le in ("0.005", "0.01", "0.025", "0.05", "0.075", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.75",
                      "1.0", "2.5", "+Inf")},
        ("gpt2serve_time_per_output_token_seconds_count", grpc): 1,
        ("gpt2serve_time_per_output_token_seconds_sum", grpc): 0.004,
    }


def test_every_answered_kind_has_its_series_before_its_first_request():
    """prepare_answered (called as a front end starts) makes each (api, method)'s series at 0, so
    the first request of a kind only moves values; the kinds listed are those the transports
    answer (their method names, read from their source), no more, no fewer."""
    import re
    from pathlib import Path

    import gpt2serve.transport as transport
    from gpt2serve.telemetry.metrics import ANSWERED

    used = set()
    for path in Path(transport.__file__).parent.rglob("*.py"):
        text = path.read_text()
        used |= {("grpc", m) for m in re.findall(r'request_options\("(\w+)", request', text)}
        used |= {("rest", m) for m in re.findall(r'request_options\(head, "[^"]+", "(\w+)"', text)}
        used |= {(api or "rest", m) for m, api in
                 re.findall(r'call_options\(head, [^,]+, "(\w+)"(?:, api="(\w+)")?', text)}
    assert used == set(ANSWERED)

    metrics = Metrics()
    metrics.prepare_answered()
    before = samples(metrics.registry)
    assert all(before[("gpt2serve_requests_total", (("api", api), ("method", method), ("status", "OK")))] == 0
               for api, method in ANSWERED)
    for api, method in ANSWERED:
        metrics.request_done(RequestDone(api, method, "OK", 0.03, "", 5, 1, (0.002,), None))
    assert set(samples(metrics.registry)) == set(before), "a request made a series prepare_answered had not"

