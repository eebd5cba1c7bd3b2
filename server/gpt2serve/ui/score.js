// "Score a text": one POST /v1/next-token with prompt_logprobs, drawn as the model's output the
// seeds draw, [tokens, vocab]: a distribution at every position. Each row is one position's
// vocabulary, ranked on a log scale (rank 1 at the left, 50,257 at the right); the top-k are the
// ticks at the left and the token the text actually has there is the marker, coloured by its
// surprisal (-log2 p, bits). The text above is coloured the same way.
"use strict";

const scoring = { result: null };
const MAX_SURPRISAL_BITS = 20;  // the colour scale's end: p = 2^-20 and rarer look the same

function startScore(params) {
  if (params.get("top_k")) $("score-k").value = params.get("top_k");
  if (params.get("text")) {
    $("score-text").value = params.get("text");
    return score();
  }
}

async function score() {
  show("error", "");
  if (keyMissing()) return;
  const k = Math.max(1, Math.min(20, Number($("score-k").value) || 5));
  const data = await post("/v1/next-token", { prompt: $("score-text").value, top_k: 1, prompt_logprobs: k });
  if (!data) { $("score-view").hidden = true; return; }
  scoring.result = data;
  $("score-view").hidden = false;
  renderScores(data, k);
}

const bits = (logprob) => -logprob / Math.LN2;
const prob = (logprob) => { const p = Math.exp(logprob); return p >= 0.001 ? p.toFixed(3) : p.toExponential(1); };

function surprisalColour(logprob) {  // 0 bits white .. MAX_SURPRISAL_BITS red
  const t = Math.max(0, Math.min(1, bits(logprob) / MAX_SURPRISAL_BITS));
  return `rgb(255,${Math.round(255 - 175 * t)},${Math.round(255 - 205 * t)})`;
}

function renderScores(data, k) {
  const entries = data.prompt_logprobs, vocab = state.model ? state.model.architecture.vocab_size : 50257;
  const scored = entries.slice(1);
  const mean = scored.reduce((sum, e) => sum + e.logprob, 0) / Math.max(scored.length, 1);
  $("score-summary").textContent = scored.length
    ? `${entries.length} tokens; ${scored.length} scored: mean log-probability ${mean.toFixed(3)}, ` +
      `perplexity ${Math.exp(-mean).toFixed(2)}; the model's own choice at ${scored.filter((e) => e.rank === 1).length} of them`
    : "One token: nothing before it to score it against.";
  $("score-tokens").replaceChildren(...entries.map((e, position) => el("span", {
    class: "score-token", "data-position": position, "data-rank": e.rank ?? "",
    "data-surprisal": e.logprob === null ? "" : bits(e.logprob).toFixed(4),
    style: e.logprob === null ? "" : `background:${surprisalColour(e.logprob)}`,
    title: e.logprob === null ? "the first token: nothing before it" : `p ${Math.exp(e.logprob).toExponential(2)}, rank ${e.rank}`,
  }, visible(e.token))));
  drawVocabRows(entries, vocab, k);
  const head = el("tr", {}, ...["pos", "token", "p", "bits", "rank", ...Array.from({ length: k }, (_, i) => `#${i + 1}`)]
    .map((h) => el("th", {}, h)));
  $("score-table").replaceChildren(head, ...entries.map((e, position) => el("tr", { class: "score-row" },
    el("td", {}, String(position)), el("td", { class: "tok" }, visible(e.token)),
    el("td", {}, e.logprob === null ? "–" : prob(e.logprob)),
    el("td", { style: e.logprob === null ? "" : `background:${surprisalColour(e.logprob)}` }, e.logprob === null ? "–" : bits(e.logprob).toFixed(2)),
    el("td", {}, e.rank === null ? "–" : String(e.rank)),
    ...e.top.map((t) => el("td", { class: t.token_id === e.token_id ? "tok top-actual" : "tok", title: `p ${Math.exp(t.logprob).toExponential(4)}` },
      `${visible(t.token)} ${prob(t.logprob)}`)))));
}

function drawVocabRows(entries, vocab, k) {
  // x = log(rank) / log(vocab): rank 1 at 0, the whole vocabulary at the right edge.
  const left = 110, width = 560, row = 16, x = (rank) => left + width * Math.log(rank) / Math.log(vocab);
  const svg = el("svg:svg", { id: "score-vocab", width: left + width + 60, height: entries.length * row + 24,
                              "data-rows": entries.length, "data-vocab": vocab });
  svg.append(el("svg:text", { x: left, y: 10 }, "rank 1"), el("svg:text", { x: left + width - 30, y: 10 }, `${vocab.toLocaleString("en")}`));
  entries.forEach((e, position) => {
    const y = 16 + position * row;
    svg.append(el("svg:text", { x: 0, y: y + row * 0.7 }, `${position} ${visible(e.token)}`.slice(0, 16)),
               el("svg:rect", { x: left, y, width, height: row - 3, class: "vocab-row" }));
    if (e.logprob === null) return;
    e.top.forEach((t, i) => svg.append(el("svg:rect", { x: x(i + 1), y, width: 2, height: row - 3, class: "top-tick",
      style: `fill-opacity:${Math.max(0.15, Math.exp(t.logprob) * 4)}` })));
    svg.append(el("svg:circle", { cx: x(e.rank), cy: y + (row - 3) / 2, r: 4, class: "actual", "data-rank": e.rank,
                                  style: `fill:${surprisalColour(e.logprob)}` }));
  });
  $("score-vocab-box").replaceChildren(svg, el("p", { class: "note" }, `Each row is one position's distribution over the ` +
    `${vocab.toLocaleString("en")}-token vocabulary, ranked (log scale). Ticks: the ${k} most likely tokens; circle: ` +
    `the token the text has, coloured by its surprisal. The server computed these rows chunk by chunk and kept only ` +
    `this much of each: a [tokens, vocab] tensor is never held whole.`));
}

$("score-form").addEventListener("submit", (event) => { event.preventDefault(); score(); });
