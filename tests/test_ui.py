"""The /ui layer viewer, rendered by a real headless Chromium (Debian's; `make test` installs it).

Chromium loads a deep link, runs the page's script against the real server (virtual time lets
the fetches finish), and prints the resulting DOM, which is checked against the model.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import launch_server
from reference import reference_logprobs, transformers_random_model

CHROMIUM = shutil.which("chromium")
PROMPT = "The capital of France is"


def chromium(tmp_path: Path, url: str, *extra: str) -> str:
    assert CHROMIUM, "chromium is missing: `make test` installs it (scripts/debian_test_deps.sh)"
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=15000", *extra, url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def dom(tmp_path: Path, url: str) -> str:
    return chromium(tmp_path, url, "--dump-dom")


def texts(html: str, pattern: str) -> list[str]:
    return [unescape(t) for t in re.findall(pattern, html)]


def visible(token: str) -> str:
    return token.replace(" ", "␣")


def deep_link(server, prompt: str = PROMPT, layer: int = 1, head: int = 2) -> str:
    return f"{server.http_url}/ui?prompt={quote(prompt)}&layer={layer}&head={head}"


def test_a_deep_link_renders_layers_heatmaps_lens_and_parameters(server, tmp_path, tiny_model, tokenizer):
    html = dom(tmp_path, deep_link(server))
    cfg, ids = tiny_model.model.config, tokenizer.encode(PROMPT)
    tokens = [visible(tokenizer.token_text(i)) for i in ids]
    assert len(re.findall(r'class="layer-row"', html)) == cfg.n_layer
    assert len(re.findall(r'<svg class="heatmap"[^>]*data-layer="1"', html)) == cfg.n_head  # the chosen layer
    assert texts(html, r'<text class="axis-token query"[^>]*>([^<]*)</text>')[:len(ids)] == tokens
    assert texts(html, r'<text class="axis-token key"[^>]*>([^<]*)</text>')[:len(ids)] == tokens
    assert len(re.findall(r'class="lens-row"', html)) == cfg.n_layer
    assert re.search(r'<figure class="head chosen">\s*<svg class="heatmap"[^>]*data-head="2"', html)
    best = reference_logprobs(tiny_model.model, ids).argmax().item()
    assert texts(html, r'id="next-token">([^<]*)<') == [visible(tokenizer.token_text(best))]
    assert "3,332,928" in html  # the parameter table's total for random:tiny
    assert re.search(r'id="error"[^>]*hidden', html)


def test_the_servers_error_message_is_shown(server, tmp_path):
    html = dom(tmp_path, deep_link(server, prompt=" a" * 140))  # 140 tokens: past the 128 of attention maps
    error = texts(html, r'id="error" role="alert">([^<]*)<')
    assert error and "INVALID_ARGUMENT" in error[0] and "at most 128 tokens" in error[0]
    assert re.search(r'<main id="results"[^>]*hidden', html) or 'class="layer-row"' not in html


def test_a_screenshot_of_the_page(server, tmp_path):
    png = tmp_path / "ui.png"
    chromium(tmp_path, deep_link(server), f"--screenshot={png}", "--window-size=1300,1500")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank one


def test_trace_layers_never_says_layer_data_is_off(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", "--trace-layers", "never")
    try:
        html = dom(tmp_path, deep_link(srv))
        assert "Layer data is off on this server" in html
        assert re.search(r'id="next-token">', html) and 'class="heatmap"' not in html
    finally:
        srv.stop()


def test_an_api_key_is_asked_for_and_never_put_in_the_url(tmp_path):
    srv = launch_server(tmp_path, "--model", "random:tiny", env={"GPT2SERVE_API_KEY": "ui-secret"})
    try:
        html = dom(tmp_path, deep_link(srv))
        assert re.search(r'<form id="key-form">', html), "the key form is shown (not hidden)"
        assert "Enter the API key first." in html and 'id="next-token"' not in html
        script = (Path(__file__).parents[1] / "server/gpt2serve/ui/app.js").read_text()
        assert "sessionStorage" in script and "authorization" in script and "searchParams" not in script
    finally:
        srv.stop()


def test_a_checkpoint_renders_with_its_own_shapes(tmp_path, tokenizer):
    saved = transformers_random_model(seed=8, n_layer=3, n_head=2, n_embd=32)
    saved.save_pretrained(tmp_path / "ckpt")
    srv = launch_server(tmp_path, "--model", str(tmp_path / "ckpt"))
    try:
        html = dom(tmp_path, deep_link(srv, layer=2, head=1))
        assert len(re.findall(r'class="layer-row"', html)) == 3 and len(re.findall(r'class="lens-row"', html)) == 3
        assert len(re.findall(r'<svg class="heatmap"[^>]*data-layer="2"', html)) == 2
        best = reference_logprobs(saved, tokenizer.encode(PROMPT)).argmax().item()
        assert texts(html, r'id="next-token">([^<]*)<') == [visible(tokenizer.token_text(best))]
    finally:
        srv.stop()


@pytest.mark.parametrize("path", ["/ui", "/ui/app.js", "/ui/style.css", "/ui/config.json",
                                  "/docs/static/swagger-ui-bundle.js", "/docs/static/swagger-ui.css"])
def test_the_page_is_served_from_the_package(server, path):
    import httpx

    response = httpx.get(f"{server.http_url}{path}")
    assert response.status_code == 200 and response.content
    if path.startswith("/ui"):  # ours: nothing loaded from outside (Swagger's bundle mentions URLs in its code)
        assert "cdn" not in response.text.lower() and "https://" not in response.text


@pytest.mark.parametrize("path, rendered", [
    ("/docs", r'class="opblock-summary-path" data-path="/v1/next-token"'),  # Swagger UI drew the operation
    ("/redoc", r'/v1/next-token/batch'),
])
def test_the_api_docs_render_offline(server, tmp_path, path, rendered):
    import httpx

    page = httpx.get(f"{server.http_url}{path}").text
    assert "cdn" not in page.lower() and "https://" not in page  # nothing from outside
    html = dom(tmp_path, f"{server.http_url}{path}")
    assert re.search(rendered, html), html[-3000:]
