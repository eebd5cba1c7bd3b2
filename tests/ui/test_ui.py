"""The /ui viewer, rendered by a real headless Chromium (Debian's; `make test` installs it).

Chromium loads a deep link, runs the page's script against the real server (virtual time lets
the fetches finish), and prints the resulting DOM, which is checked against the model. Every
page load is also checked for console messages (script errors, failed loads): there must be none
but those a test expects.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest
from support.servers import launch_server
from support.reference import reference_logprobs, transformers_random_model
from support.walkthrough import expected

from gpt2serve.engine.loading import ARCHITECTURES
from gpt2serve.introspection.architectures import PRESETS
from gpt2serve.introspection.params import count

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium")
PROMPT = "The capital of France is"


def chromium(tmp_path: Path, url: str, *extra: str, console_allowed: str = "") -> str:
    """Run headless Chromium on `url`; its console (logged to stderr) must be silent, but for
    messages matching the regex `console_allowed`."""
    assert CHROMIUM, "chromium is missing: `make test` installs it (scripts/debian_test_deps.sh)"
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=15000",
                          "--enable-logging=stderr", "--v=0", *extra, url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    console = [line for line in out.stderr.splitlines() if ":CONSOLE" in line]
    unexpected = [line for line in console if not (console_allowed and re.search(console_allowed, line))]
    assert not unexpected, unexpected
    return out.stdout


def dom(tmp_path: Path, url: str, console_allowed: str = "") -> str:
    return chromium(tmp_path, url, "--dump-dom", console_allowed=console_allowed)


def texts(html: str, pattern: str) -> list[str]:
    return [unescape(t) for t in re.findall(pattern, html)]


def visible(token: str) -> str:
    """As the page shows a token (common.js): spaces as ␣, newlines and tabs escaped."""
    return token.replace(" ", "␣").replace("\n", "\\n").replace("\t", "\\t")


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
    html = dom(tmp_path, deep_link(server, prompt=" a" * 140),  # 140 tokens: past the 128 of attention maps
               console_allowed=r"Failed to load resource: the server responded with a status of 400")
    error = texts(html, r'id="error" role="alert">([^<]*)<')
    assert error and "INVALID_ARGUMENT" in error[0] and "at most 128 tokens" in error[0]
    assert re.search(r'<main id="results"[^>]*hidden', html) or 'class="layer-row"' not in html


@pytest.mark.parametrize("view", ["", "&view=generate&max_tokens=6&step=3", "&view=shapes&preset=llama-3-8b",
                                  "&view=score&text=The%20capital%20of%20France%20is%20Paris."])
def test_a_screenshot_of_each_view(server, tmp_path, view):
    png = tmp_path / "ui.png"
    chromium(tmp_path, deep_link(server) + view, f"--screenshot={png}", "--window-size=1300,1500")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank one


def drawn(html: str, container: str) -> dict[str, tuple[str, list[int]]]:
    """The shape blocks drawn inside the element with id `container`: name -> (kind, shape)."""
    start = html.index(f'id="{container}"')
    section = html[start:html.index('<div id="', start)]  # up to the next container (the detail panel)
    blocks = re.findall(r'<figure class="shape-block (data|weight)[^"]*"[^>]*data-name="([^"]*)" data-shape="([^"]*)"',
                        section)
    return {unescape(name): (kind, [int(n) for n in shape.split(",")]) for kind, name, shape in blocks}


def test_the_walk_through_is_drawn_with_the_forwards_shapes(server, tmp_path, tiny_model, tokenizer):
    html = dom(tmp_path, deep_link(server))
    blocks = drawn(html, "walkthrough")
    want = expected(tiny_model.model.config, 1, len(tokenizer.encode(PROMPT)))
    assert {name: blocks[name][1] for name in want} == want
    assert {name for name, (kind, _) in blocks.items() if kind == "weight"} == {
        "token embedding", "position embedding", "attention norm", "W_QKV", "W_O (projection)", "MLP norm",
        "W_up (fc)", "W_down (proj)", "final norm", "lm_head"}
    assert "Each block (× 2, the same shapes in every block)" in html
    note = texts(html, r'id="seeds-note">([^<]*)<')[0]
    assert "50,257 tokens, not 50,000" in note and "nothing is padded to 1024" in note and "ran at 5 positions" in note
    assert "the logits are [1, 50257], not [1, 5, 50257]" in note


@pytest.mark.parametrize("click, shown", [
    ("softmax: attention weights", r'<svg class="heatmap"[^>]*data-layer="1"'),  # the chosen block's maps
    ("residual + MLP", r"residual norm"),
    ("W_QKV", r"A weight: 12,288 parameters \(64 × 192\)"),
])
def test_clicking_a_block_shows_its_numbers(server, tmp_path, tiny_model, click, shown):
    html = dom(tmp_path, deep_link(server, layer=1) + f"&click={quote(click)}")
    detail = html[html.index('id="shape-detail"'):]
    detail = detail[:detail.index("</section>")]
    assert re.search(r'<figure class="shape-block[^"]*selected', html)
    assert re.search(shown, detail), detail[:2000]
    if click.startswith("softmax"):
        assert len(re.findall(r'<svg class="heatmap"', detail)) == tiny_model.model.config.n_head
    if click.startswith("residual"):
        assert len(re.findall(r"<tr><td>\d+</td>", detail)) == tiny_model.model.config.n_layer


def test_generate_mode_walks_the_steps(server, tmp_path, tiny_model, tokenizer):
    import httpx

    ids = tokenizer.encode(PROMPT)
    reference = httpx.post(f"{server.http_url}/v1/generate", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0},
                           timeout=60).json()
    generated = [visible(t["token"]) for t in reference["tokens"]]
    html = dom(tmp_path, f"{server.http_url}/ui?view=generate&prompt={quote(PROMPT)}&max_tokens=5&temperature=0&step=3")
    cfg = tiny_model.model.config
    assert texts(html, r'<span class="seq-token prompt-token"[^>]*>([^<]*)<') == [visible(tokenizer.token_text(i)) for i in ids]
    assert texts(html, r'<span class="seq-token gen-token[^"]*"[^>]*>([^<]*)<') == generated
    assert texts(html, r'<span class="seq-token gen-token current"[^>]*>([^<]*)<') == [generated[3]]
    cache = re.search(r'<svg id="kv-cache-svg"[^>]*data-heads="(\d+)" data-columns="(\d+)" data-new="(\d+)"', html)
    assert cache.groups() == (str(cfg.n_head), str(len(ids) + 3), "1")
    assert len(re.findall(r'class="cache-new"', html)) == cfg.n_head  # this step's one new column, in every head
    assert len(re.findall(r'<tr class="attn-row">', html)) == cfg.n_layer
    assert len(re.findall(r'<tr class="step-lens-row">', html)) == cfg.n_layer
    assert texts(html, r'<tr class="chosen-token"><td>1</td><td class="tok">([^<]*)<') == [generated[3]]  # greedy
    blocks = drawn(html, "step-walkthrough")
    assert blocks["K cache per head"][1] == [1, cfg.n_head, len(ids) + 3, cfg.d_head]
    assert blocks["Q per head"][1] == [1, cfg.n_head, 1, cfg.d_head]
    assert blocks["new row: token + position embedding"][1] == [1, 1, cfg.d_model]
    prefill = dom(tmp_path, f"{server.http_url}/ui?view=generate&prompt={quote(PROMPT)}&max_tokens=5&temperature=0&step=0")
    assert drawn(prefill, "step-walkthrough")["Q per head"][1] == [1, cfg.n_head, len(ids), cfg.d_head]
    assert re.search(r'data-columns="5" data-new="5"', prefill)  # the prefill fills the cache at once


def test_generate_mode_shows_what_the_controls_made_of_each_step(server, tmp_path, tokenizer):
    """A deep link with a repetition penalty and a choice: each step's table after the controls
    and its allowed count are the server's own for the same request; without controls the
    section stays hidden."""
    import httpx

    choices = "yes please|no thanks"
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "repetition_penalty": 1.3, "trace_steps": True,
            "logprobs": 5, "structured_outputs": {"choice": choices.split("|")}}
    reference = httpx.post(f"{server.http_url}/v1/generate", json=body, timeout=60).json()
    assert reference["text"] in choices.split("|")
    link = (f"{server.http_url}/ui?view=generate&prompt={quote(PROMPT)}&max_tokens=6&temperature=0"
            f"&repetition_penalty=1.3&constraint=choice&constraint_text={quote(choices)}")
    for index, step in enumerate(reference["steps"]):
        html = dom(tmp_path, f"{link}&step={index}")
        assert texts(html, r'<span class="seq-token gen-token[^"]*"[^>]*>([^<]*)<') == [
            visible(t["token"]) for t in reference["tokens"]]
        assert re.search(r'<section id="step-controlled-section">', html)  # shown
        vocab = tokenizer.vocab_size
        shown = texts(html, r'<p id="step-allowed">([^<]*)<')[0]
        assert shown.startswith(f"{step['allowed_tokens']} of {vocab} tokens allowed")
        assert shown.endswith("forced this one") == (step["allowed_tokens"] == 1)
        table = re.search(r'<table id="step-controlled-table">(.*?)</table>', html).group(1)
        assert texts(table, r'<td class="tok">([^<]*)<') == [visible(t["token"]) for t in step["controlled_top"]]
        assert texts(table, r'<tr class="chosen-token"><td>\d+</td><td class="tok">([^<]*)<') == [
            visible(reference["tokens"][index]["token"])]
    plain = dom(tmp_path, f"{server.http_url}/ui?view=generate&prompt={quote(PROMPT)}&max_tokens=2&temperature=0")
    assert re.search(r'<section id="step-controlled-section" hidden="">', plain)


def test_generate_mode_takes_a_chat_message_through_the_template(server, tmp_path, tokenizer):
    """`chat=1`: the text goes as a user message; the prefill's tokens are the template's prompt."""
    import httpx

    template = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml.jinja"
    srv = launch_server(tmp_path, "--model", "random:tiny", "--chat-template", str(template))
    try:
        messages = [{"role": "user", "content": "Hi"}]
        ids = tokenizer.apply_chat_template(messages, template.read_text(), True, False, {})
        reference = httpx.post(f"{srv.http_url}/v1/generate", timeout=60, json={
            "messages": messages, "max_tokens": 3, "temperature": 0}).json()
        assert reference["prompt_token_ids"] == ids
        html = dom(tmp_path, f"{srv.http_url}/ui?view=generate&chat=1&prompt=Hi&max_tokens=3&temperature=0&step=0")
        assert texts(html, r'<span class="seq-token prompt-token"[^>]*>([^<]*)<') == [
            visible(tokenizer.token_text(i)) for i in ids]
        assert texts(html, r'<span class="seq-token gen-token[^"]*"[^>]*>([^<]*)<') == [
            visible(t["token"]) for t in reference["tokens"]]
    finally:
        srv.stop()
    html = dom(tmp_path, f"{server.http_url}/ui?view=generate&chat=1&prompt=Hi",  # no template there
               console_allowed=r"Failed to load resource: the server responded with a status of 400")
    error = texts(html, r'id="error" role="alert">([^<]*)<')
    assert error and "FAILED_PRECONDITION" in error[0] and "--chat-template" in error[0]


def test_the_score_view_draws_every_position_as_the_model_scored_it(server, tmp_path, tiny_model, tokenizer):
    """Each token's surprisal and rank, the [tokens, vocab] rows with one marker per scored
    position at its rank, and the table's top-k: all against transformers' forward."""
    import math

    import torch
    from support.reference import reference_prompt_logprobs

    text = "The capital of France is Paris, and \u2603 is a snowman."
    ids = tokenizer.encode(text)
    html = dom(tmp_path, f"{server.http_url}/ui?view=score&text={quote(text)}&top_k=3")
    ref = reference_prompt_logprobs(tiny_model.model, ids)
    tokens = re.findall(r'<span class="score-token" data-position="(\d+)" data-rank="(\d*)" data-surprisal="([^"]*)"', html)
    assert [int(p) for p, _, _ in tokens] == list(range(len(ids)))
    assert tokens[0][1:] == ("", "")  # the first token: nothing before it
    for position, rank, surprisal in tokens[1:]:
        want = ref[int(position) - 1, ids[int(position)]].item()
        assert float(surprisal) == pytest.approx(-want / math.log(2), abs=1e-3)
        assert int(rank) == int((ref[int(position) - 1] > want).sum()) + 1
    svg = re.search(r'<svg id="score-vocab"[^>]*data-rows="(\d+)" data-vocab="(\d+)"', html)
    assert svg.groups() == (str(len(ids)), "50257")
    assert [int(r) for r in re.findall(r'<circle [^>]*class="actual" data-rank="(\d+)"', html)] == [int(r) for _, r, _ in tokens[1:]]
    assert len(re.findall(r'class="top-tick"', html)) == 3 * (len(ids) - 1)
    rows = re.findall(r'<tr class="score-row">(.*?)</tr>', html)
    assert len(rows) == len(ids)
    best = torch.topk(ref[0], 3)
    cells = re.findall(r'<td class="tok[^"]*" title="p ([\d.e+-]+)">', rows[1])
    assert [float(p) for p in cells] == pytest.approx([math.exp(v) for v in best.values.tolist()], rel=1e-3)
    assert "perplexity" in re.search(r'<p id="score-summary">([^<]*)<', html).group(1)


@pytest.mark.parametrize("preset", ["llama-3-8b", "gpt2-xl", "deepseek-v3"])
def test_a_presets_walk_through_is_drawn_without_weights(server, tmp_path, preset):
    html = dom(tmp_path, f"{server.http_url}/ui?view=shapes&preset={preset}&tokens=5")
    blocks = drawn(html, "shapes-walkthrough")
    arch = PRESETS[preset]
    if preset == "gpt2-xl":  # the same picture as the served model's, from the config alone
        want = expected(ARCHITECTURES["gpt2-xl"], 1, 5)
        assert {name: blocks[name][1] for name in want} == want
    elif preset == "llama-3-8b":
        assert blocks["K per head"] == ("data", [1, 8, 5, 128]) and blocks["Q per head"] == ("data", [1, 32, 5, 128])
        assert blocks["W_K"] == ("weight", [4096, 1024]) and blocks["W_gate"] == ("weight", [4096, 14336])
        assert blocks["lm_head"] == ("weight", [4096, 128256]) and "position embedding" not in blocks
    else:
        assert blocks["kv latent (what the cache keeps)"] == ("data", [1, 5, 576])
        assert blocks["routed experts: W_gate, W_up, W_down"] == ("weight", [256, 3, 7168, 2048])
        assert f"{count(arch).active:,}" in html
    assert f"{count(arch).total:,}" in html and arch.describe() in unescape(html)


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
        script = "".join(path.read_text() for path in (Path(__file__).resolve().parents[2] / "server/gpt2serve/ui").glob("*.js"))
        assert "sessionStorage" in script and "authorization" in script and "searchParams" not in script
        generate = dom(tmp_path, f"{srv.http_url}/ui?view=generate&prompt=Hi")
        assert "Enter the API key first." in generate and 'class="seq-token' not in generate
        # a preset's shapes hold no model data: drawn without the key
        shapes = dom(tmp_path, f"{srv.http_url}/ui?view=shapes&preset=qwen2.5-7b")
        assert 'data-name="K per head" data-shape="1,4,5,128"' in shapes
        import httpx

        assert httpx.get(f"{srv.http_url}/ui/presets/llama-3-8b.json").status_code == 200
        assert httpx.get(f"{srv.http_url}/ui/presets/nope.json").status_code == 404
        assert httpx.get(f"{srv.http_url}/ui/presets/gpt2.json?tokens=0").status_code == 400
        assert httpx.get(f"{srv.http_url}/v1/model").status_code == 401  # the model itself stays behind the key
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
        blocks = drawn(html, "walkthrough")  # the checkpoint's own shapes
        T = len(tokenizer.encode(PROMPT))
        assert blocks["Q per head"] == ("data", [1, 2, T, 16]) and blocks["W_QKV"] == ("weight", [32, 96])
        assert "Each block (× 3," in html
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


def test_an_adapter_is_drawn_beside_the_base_as_peft_measures_it(tmp_path, tokenizer):
    """The adapter chosen on the page (a deep link's &adapter=): both top-k lists and, per block,
    how far the adapter moved it from the base, equal to peft's own forward with and without it."""
    from support.generation import LIVELY
    from support.lora import make_adapter, peft_blocks, peft_model, peft_shifts

    transformers_random_model(seed=3, **LIVELY).save_pretrained(tmp_path / "ckpt")
    adapter = make_adapter(tmp_path / "ckpt", tmp_path / "coder", 8, ["c_attn", "c_proj", "c_fc"], 16, False, seed=1)
    judge, ids = peft_model(tmp_path / "ckpt", adapter), tokenizer.encode(PROMPT)
    srv = launch_server(tmp_path, "--model", str(tmp_path / "ckpt"), "--lora-modules", f"coder={adapter}")
    try:
        html = dom(tmp_path, f"{deep_link(srv)}&adapter=coder")
        assert re.search(r'<label id="adapter-label" title', html)  # shown (not hidden): the server serves one
        rows = re.findall(r'<tr class="beside-top-row"><td>\d+</td><td class="tok">([^<]*)</td><td>([\d.]+)</td>'
                          r'<td class="tok">([^<]*)</td><td>([\d.]+)</td></tr>', html)
        adapted, base = peft_blocks(judge, ids, base=False)[1], peft_blocks(judge, ids, base=True)[1]
        for (got_token, got_p, base_token, base_p), (p, i), (bp, bi) in zip(
                rows, zip(*adapted.softmax(-1).topk(5)), zip(*base.softmax(-1).topk(5))):
            assert float(got_p) == pytest.approx(p.item(), abs=2e-4) and float(base_p) == pytest.approx(bp.item(), abs=2e-4)
        assert len(rows) == 5 and unescape(rows[0][0]) == visible(tokenizer.token_text(adapted.argmax().item()))
        assert unescape(rows[0][2]) == visible(tokenizer.token_text(base.argmax().item()))
        drawn_shifts = [tuple(float(v) for v in found) for found in re.findall(
            r'data-residual="([^"]+)".*?data-attn="([^"]+)".*?data-mlp="([^"]+)"', html)]
        assert drawn_shifts == [pytest.approx(w, rel=1e-3, abs=1e-5) for w in peft_shifts(judge, ids)]
        assert len(re.findall(r'class="shift-row"', html)) == judge.config.n_layer
        assert "one of them this prompt under the base model" in html  # the walk-through's batch of 2, explained
        # Without an adapter the section stays hidden and the request asks for no base.
        plain = dom(tmp_path, deep_link(srv))
        assert re.search(r'<section id="beside-base" hidden', plain) and "beside-top-row" not in plain
    finally:
        srv.stop()
