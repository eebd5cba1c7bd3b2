// LoRA adapters in the "Next token" view: pick one the server serves (ModelInfo.adapters), and
// the answer comes with the base model beside it (compare_base: the same prompt under the base, a
// row of the same forward). Per block, how far the adapter moved it at the last position, as
// ||adapter - base|| / ||base||: the residual stream after the block (everything so far) and the
// block's own attention and MLP outputs; then both logit lenses and both top-k lists.
"use strict";

function fillAdapters(names, chosen) {
  $("adapter").replaceChildren(el("option", { value: "" }, "none (the base)"),
    ...names.map((name) => el("option", { value: name }, name)));
  $("adapter-label").hidden = !names.length;
  if (chosen && names.includes(chosen)) $("adapter").value = chosen;
}

function renderBeside(r) {
  const section = $("beside-base"), adapter = $("adapter").value;
  section.hidden = !r.base_top || !r.base_top.length || !r.layers.length;
  if (section.hidden) return;
  const p = (t) => Math.exp(t.logprob).toFixed(4);
  $("beside-top").replaceChildren(el("tr", {}, ...["rank", `with ${adapter}`, "prob", "base", "prob"].map((h) => el("th", {}, h))),
    ...r.top.map((t, i) => { const b = r.base_top[i];
      return el("tr", { class: "beside-top-row" }, el("td", {}, String(i + 1)), el("td", { class: "tok" }, visible(t.token)),
        el("td", {}, p(t)), el("td", { class: "tok" }, visible(b.token)), el("td", {}, p(b))); }));
  const shifts = r.layers.flatMap((l) => [l.base_residual_shift, l.base_attn_shift, l.base_mlp_shift]);
  const most = Math.max(...shifts, 1e-9);  // bars share one scale: the largest shift fills its cell
  const bar = (name, v) => el("td", { class: `shift ${name}`, [`data-${name}`]: String(v), title: `${name}: ${v.toPrecision(4)}` },
    el("span", { class: "bar", style: `width:calc(${(v / most).toFixed(4)} * (100% - 12px))` }), el("small", {}, `${(100 * v).toFixed(1)}%`));
  const lens = (t) => `${visible(t.token)} ${t.prob.toFixed(2)}`;
  $("beside-layers").replaceChildren(el("tr", {}, ...["block", "residual stream moved", "attention output moved",
    "MLP output moved", `lens with ${adapter}`, "lens of the base"].map((h) => el("th", {}, h))),
    ...r.layers.map((l) => el("tr", { class: "shift-row", "data-layer": l.index }, el("td", {}, String(l.index)),
      bar("residual", l.base_residual_shift), bar("attn", l.base_attn_shift), bar("mlp", l.base_mlp_shift),
      el("td", { class: "tok lens-adapter" }, lens(l.logit_lens[0])), el("td", { class: "tok lens-base" }, lens(l.base_logit_lens[0])))));
}
