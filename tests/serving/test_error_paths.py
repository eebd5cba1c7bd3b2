"""One HTTP error path: every POST route reads raw bodies the same way, answers its documented
status in its family's shape (REST, or OpenAI's error object), counts each refusal once under the
right labels, and the status tables of docs/api.md and /docs agree with gpt2serve_client.status."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from support.servers import launch_server, requests_total, openai_client

from gpt2serve_client.status import BY_KIND, ERROR_STATUSES

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
LIMIT = 4096
# route -> (metrics api label, method label, a valid body)
ROUTES = {
    "/v1/next-token": ("rest", "NextToken", b'{"prompt": "hi"}'),
    "/v1/next-token/batch": ("rest", "NextTokenBatch", b'{"prompts": ["hi"]}'),
    "/v1/generate": ("rest", "Generate", b'{"prompt": "hi", "max_tokens": 2}'),
    "/v1/completions": ("openai", "Completions", b'{"model": "random:tiny", "prompt": "hi", "max_tokens": 2}'),
    "/v1/chat/completions": ("openai", "ChatCompletions",
                             b'{"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}], '
                             b'"max_tokens": 2}'),
}
CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"
DEEP = b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"  # under the limit, past pydantic's depth of 200
BAD_BODIES = {
    "invalid UTF-8": (b'{"prompt": "caf\xe9 \xff"}', "json", "malformed"),
    "nested too deep": (DEEP, "json", "malformed"),
    "not JSON": (b'{"prompt": ', "json", "malformed"),
    "wrong type": (b'{"prompt": 5}', "json", "malformed"),
    "wrong content type": (b'{"prompt": "hi"}', "text/plain", "unsupported_media_type"),
    "over the limit": (b'{"prompt": "' + b"a" * (LIMIT + 10) + b'"}', "json", "payload_too_large"),
}


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    srv = launch_server(tmp_path_factory.mktemp("errors"), "--model", "random:tiny",
                        "--max-message-bytes", str(LIMIT), "--chat-template", str(CHAT_TEMPLATE))
    yield srv
    srv.stop()


def expect(route: str, kind: str, response: httpx.Response) -> None:
    """The status and the shape the table says for this route family."""
    status = BY_KIND[kind]
    error = response.json()["error"]
    if ROUTES[route][0] == "openai":
        assert response.status_code == status.openai_http, response.text
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == status.openai_type
    else:
        assert response.status_code == status.http, response.text
        assert set(error) == {"code", "message"} and error["code"] == status.code
    assert error["message"] and "Traceback" not in error["message"]
    assert (response.headers.get("retry-after") is not None) == status.retry_after


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", BAD_BODIES)
def test_every_route_answers_raw_bodies_one_way_and_counts_them_once(limited, route, case):
    body, content_type, kind = BAD_BODIES[case]
    api, method, _ = ROUTES[route]
    code = BY_KIND[kind].code
    before = requests_total(limited.http_url, api, method, code)
    content_type = "application/json" if content_type == "json" else content_type
    response = httpx.post(limited.http_url + route, content=body, headers={"content-type": content_type}, timeout=30)
    expect(route, kind, response)
    assert requests_total(limited.http_url, api, method, code) == before + 1


@pytest.mark.parametrize("route", ROUTES)
def test_a_chunked_body_over_the_limit_is_413_on_every_route(limited, route):
    api, method, _ = ROUTES[route]
    before = requests_total(limited.http_url, api, method, "RESOURCE_EXHAUSTED")

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"a" * 1024
        yield b'"}'

    response = httpx.post(limited.http_url + route, content=chunks(), headers={"content-type": "application/json"},
                          timeout=30)
    expect(route, "payload_too_large", response)
    assert requests_total(limited.http_url, api, method, "RESOURCE_EXHAUSTED") == before + 1


@pytest.mark.parametrize("route", ROUTES)
def test_a_valid_body_is_served_on_every_route(limited, route):
    response = httpx.post(limited.http_url + route, content=ROUTES[route][2],
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 200, response.text


def test_unknown_paths_and_methods_answer_in_the_error_shape(limited):
    missing = httpx.get(f"{limited.http_url}/v1/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"
    not_allowed = httpx.put(f"{limited.http_url}/v1/model", timeout=10)
    assert not_allowed.status_code == 405 and not_allowed.json()["error"]["code"] == "UNIMPLEMENTED"


def test_the_official_client_raises_the_matching_classes(limited):
    client = openai_client(limited.http_url)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert missing.value.body["param"] == "model" and missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad_type:
        client.completions.create(model="random:tiny", prompt="hi", max_tokens=2, extra_body={"top_k": "many"})
    assert "top_k" in bad_type.value.body["message"]
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model="random:tiny", prompt="hi", max_tokens=5000)
    assert "context" in too_long.value.body["message"]
    with pytest.raises(openai.APIStatusError) as too_large:
        client.completions.create(model="random:tiny", prompt="a" * LIMIT, max_tokens=2)
    assert too_large.value.status_code == 413


def test_the_documented_status_table_is_the_clients_table():
    text = API_DOC.read_text()
    table = text[text.index("<!-- statuses:start -->"):text.index("<!-- statuses:end -->")]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    parsed = [[cell.strip().strip("`") for cell in row.strip("|").split("|")] for row in rows]
    expected = [[s.code, str(s.http), str(s.openai_http), s.openai_type, "yes" if s.retry_after else "", s.when]
                for s in ERROR_STATUSES]
    assert parsed == expected


def test_openapi_documents_every_routes_real_errors(limited):
    spec = httpx.get(f"{limited.http_url}/openapi.json", timeout=10).json()
    for route, (api, _, _) in ROUTES.items():
        responses = spec["paths"][route]["post"]["responses"]
        openai_route = api == "openai"
        wanted = {str(s.openai_http if openai_route else s.http) for s in ERROR_STATUSES
                  if s.kind not in ("cancelled", "method_not_allowed") and (openai_route or s.kind != "not_found")}
        assert wanted <= set(responses), (route, sorted(responses))
        schema = "OpenAIErrorBody" if openai_route else "RestErrorBody"
        for status in wanted:
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/" + schema), (route, status, ref)
        assert "requestBody" in spec["paths"][route]["post"]  # the body's schema is documented too
    assert "HTTPValidationError" not in spec.get("components", {}).get("schemas", {})
    rest_error = spec["components"]["schemas"]["RestError"]
    assert set(rest_error["properties"]) == {"code", "message"}
