// Shared by the viewer's scripts: DOM helpers, colours, and the API's headers. No framework.
// The API key, when the server wants one, lives in this tab's sessionStorage and travels only
// as an Authorization header.
"use strict";

const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function visible(token) {  // GPT-2's leading space, shown
  return token.replace(/ /g, "␣").replace(/\n/g, "\\n").replace(/\t/g, "\\t");
}

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  for (const child of children) node.append(child);
  return node;
}

function shade(value, max) {  // 0..max -> white..blue
  const t = max > 0 ? Math.max(0, Math.min(1, value / max)) : 0;
  return `rgb(${Math.round(255 - 205 * t)},${Math.round(255 - 160 * t)},255)`;
}

function show(id, text) {
  $(id).textContent = text;
  $(id).hidden = !text;
}

function headers() {
  const h = { "content-type": "application/json" };
  const key = sessionStorage.getItem("gpt2serve-key");
  if (key) h.authorization = `Bearer ${key}`;
  return h;
}

const shapeText = (shape) => `[${shape.join(", ")}]`;
const elements = (shape) => shape.reduce((a, b) => a * b, 1);

// POST to the API; on an error shows it (and asks for the key again on 401) and returns null.
async function post(path, body) {
  const response = await fetch(path, { method: "POST", headers: headers(), body: JSON.stringify(body) });
  const data = await response.json();
  if (response.ok) return data;
  if (response.status === 401) { sessionStorage.removeItem("gpt2serve-key"); $("key-form").hidden = false; }
  show("error", `${data.error.code}: ${data.error.message}`);
  return null;
}

function tokenTable(id, rows, chosen) {  // rows: [{token, token_id, logprob}]
  const head = el("tr", {}, ...["rank", "token", "prob", "logprob", "id"].map((h) => el("th", {}, h)));
  return el("table", { id }, head, ...rows.map((t, i) => el("tr", { class: t.token_id === chosen ? "chosen-token" : "" },
    el("td", {}, String(i + 1)), el("td", { class: "tok" }, visible(t.token)), el("td", {}, Math.exp(t.logprob).toFixed(4)),
    el("td", {}, t.logprob.toFixed(3)), el("td", {}, String(t.token_id)))));
}
