// The status page: polls /v1/overview and draws it.  Every value from the control plane
// (model names, failure messages, reasons) reaches the document through textContent or
// setAttribute, never as markup, and so does the filter.
"use strict";

(() => {
  const POLL_MS = 2000;
  const ROW_H = 32;
  const OVERSCAN = 8;
  const COLORS = {misses: "#f26b3a", evictions: "#d64545", errors: "#d64545", requests: "#3a6df0",
    hit: "#17a06b", hot: "#f26b3a", warm: "#f2b63a", cold: "#5b9cf5", staging: "#9aa5b8"};
  const TIER_ORDER = {hot: 0, staging: 1, warm: 2, cold: 3};
  const state = {data: null, rows: [], lower: [], filtered: [], query: "", sort: {key: "tier", dir: 1},
    lastOk: 0, failing: null, timer: null};

  // ------------------------------------------------------------------ helpers
  function h(tag, props, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(props || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = String(v);
      else if (k === "style") Object.assign(e.style, v);
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = String(dv);
      else e.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }
  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);

  function fmtBytes(n) {
    if (!isNum(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n >= 100 ? 0 : 1) : String(n)) + " " + units[i];
  }
  const fmtPct = (v, digits = 1) => (isNum(v) ? (v * 100).toFixed(digits) + "%" : "–");
  function fmtMs(v) {
    if (!isNum(v)) return "–";
    if (v >= 1000) return (v / 1000).toFixed(2) + " s";
    return (v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2)) + " ms";
  }
  function fmtRate(v) {
    if (!isNum(v)) return "–";
    return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2).replace(/\.?0+$/, "") || "0";
  }
  function fmtAgo(t, now) {
    if (!isNum(t)) return "never";
    const s = Math.max(0, now - t);
    if (s < 5) return "just now";
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return Math.round(s / 86400) + " d ago";
  }
  const fmtNum = (v) => (isNum(v) ? v.toLocaleString("en-US") : "–");
  const badge = (text, cls) => h("span", {class: "badge " + (cls || text)}, text);

  // ------------------------------------------------------------------ polling
  async function poll() {
    clearTimeout(state.timer);
    try {
      const resp = await fetch("/v1/overview", {credentials: "same-origin", cache: "no-store",
        headers: {Accept: "application/json"}});
      if (resp.status === 401) { location.reload(); return; }
      if (!resp.ok) {
        let msg = "HTTP " + resp.status;
        try { msg = (await resp.json()).message || msg; } catch (e) { /* not JSON */ }
        throw new Error(msg);
      }
      const data = await resp.json();
      state.lastOk = Date.now();
      state.failing = null;
      render(data);
    } catch (e) {
      state.failing = String(e.message || e);
    }
    showLiveness();
    if (!document.hidden) state.timer = setTimeout(poll, POLL_MS);
  }

  function showLiveness() {
    const live = $("live");
    const banner = $("banner");
    const age = state.lastOk ? (Date.now() - state.lastOk) / 1000 : null;
    live.className = "live " + (state.failing ? "down" : age !== null && age < 6 ? "ok" : "stale");
    $("updated").textContent = age === null ? "connecting…" : "updated " + (age < 2 ? "now" : Math.round(age) + " s ago");
    banner.hidden = !state.failing;
    if (state.failing) banner.textContent = "The control plane did not answer (" + state.failing + "); retrying every 2 s. What you see is from " + (age === null ? "never" : Math.round(age) + " s ago") + ".";
  }

  // ------------------------------------------------------------------ drawing
  function render(data) {
    state.data = data;
    document.body.dataset.updatedAt = String(data.at);
    $("role").textContent = data.control_plane.role;
    $("role").className = "badge " + data.control_plane.role;
    renderKpis(data);
    renderProblems(data);
    renderServers(data);
    renderCharts(data);
    renderRollouts(data);
    setRows(data);
  }

  function kpi(key, label, value, unit, sub, spark) {
    return h("div", {class: "kpi", data: {kpi: key}},
      h("div", {class: "kpi-label"}, label),
      h("div", {class: "kpi-value"}, h("span", {class: "v", data: {value: key}}, value), unit ? h("span", {class: "unit"}, unit) : null),
      sub ? h("div", {class: "kpi-sub"}, sub) : null,
      spark || null);
  }

  function renderKpis(data) {
    const s = data.summary;
    const hist = data.history;
    const tiers = s.tiers || {};
    const total = s.models || 0;
    const stack = h("div", {class: "stack"}, ["hot", "staging", "warm", "cold"].filter((t) => tiers[t]).map((t) =>
      h("span", {style: {width: (100 * tiers[t] / total) + "%", background: COLORS[t]}, title: t + ": " + tiers[t]})));
    const legend = h("div", {class: "legend"}, ["hot", "warm", "cold", "staging"].filter((t) => tiers[t]).map((t) =>
      h("span", null, h("i", {style: {background: COLORS[t]}}), t + " " + fmtNum(tiers[t]))));
    const traffic = trafficWindow(data.traffic);
    $("kpis").replaceChildren(
      h("div", {class: "kpi", data: {kpi: "models"}},
        h("div", {class: "kpi-label"}, "Models"),
        h("div", {class: "kpi-value"}, h("span", {class: "v", data: {value: "models"}}, fmtNum(total))),
        stack, legend, h("div", {class: "kpi-sub"}, fmtNum(s.pinned) + " pinned")),
      kpi("hit_ratio", "Hit ratio", fmtPct(s.hit_ratio), "", traffic,
        Charts.sparkline(hist.hit_ratio, {color: COLORS.hit, max: 1})),
      kpi("misses_per_min", "Misses", fmtRate(s.misses_per_min), "/min", "loads a request or mmctl asked for",
        Charts.sparkline(hist.misses_per_min, {color: COLORS.misses})),
      kpi("evictions_per_min", "Evictions", fmtRate(s.evictions_per_min), "/min", "unloaded to make room, on a miss or ahead of one",
        Charts.sparkline(hist.evictions_per_min, {color: COLORS.evictions})),
      kpi("requests_per_s", "Requests", fmtRate(s.requests_per_s), "/s", fmtNum(s.requests) + " in the window",
        Charts.sparkline(hist.requests_per_s, {color: COLORS.requests})),
      kpi("latency", "Latency p99", fmtMs(s.p99_ms), "", "p50 " + fmtMs(s.p50_ms) + " · through the router, " + traffic));
  }

  function trafficWindow(t) {
    if (!t.configured) return "no router metrics here";
    if (!t.available) return t.error ? "router metrics unreadable" : "reading the router's metrics…";
    return t.since ? "last 5 min" : "since the router started";
  }

  function renderProblems(data) {
    const items = [];
    for (const srv of data.servers) {
      if (!srv.up) items.push(h("li", {data: {problem: "server"}}, h("b", null, srv.server), " is down" + (srv.lost ? " and lost: its models were placed elsewhere" : "")));
    }
    const cols = data.models.columns;
    const iFailure = cols.indexOf("failure");
    for (const row of data.models.rows) {
      if ((row[2] === "failed" || row[2] === "unload_failed") && row[iFailure]) {
        const text = String(row[iFailure]);
        const first = text.split("\n")[0];
        items.push(h("li", {data: {problem: "model"}, title: text}, h("b", {class: "mono"}, row[0]), " failed: ",
          h("span", {class: "failure"}, first + (first.length < text.length ? " …" : ""))));
        if (items.length > 20) break;
      }
    }
    if (data.workers && data.workers.expected && data.workers.live < data.workers.expected) {
      items.push(h("li", null, `${data.workers.live} of ${data.workers.expected} router workers in touch`));
    }
    if (data.traffic.error) items.push(h("li", null, data.traffic.error));
    for (const c of data.canaries) {
      if (c.status === "rolled_back") items.push(h("li", null, "the canary of ", h("b", {class: "mono"}, c.route), " was rolled back: " + (c.why || "")));
    }
    const box = $("problems");
    box.hidden = !items.length;
    box.replaceChildren(h("b", null, "Needs attention"), h("ul", null, items));
  }

  function renderServers(data) {
    const servers = data.servers.map((s) => {
      const budget = s.memory_budget_bytes;
      const used = s.used_bytes || 0;
      const pinned = Math.min(s.pinned_bytes || 0, used);
      const denom = budget || used || 1;
      const meter = h("div", {class: "meter", title: `${fmtBytes(pinned)} pinned, ${fmtBytes(used)} used of ${budget ? fmtBytes(budget) : "no budget"}`},
        h("span", {class: "pinned", style: {width: (100 * pinned / denom) + "%"}}),
        h("span", {class: "used", style: {width: (100 * (used - pinned) / denom) + "%"}}));
      let slots = null;
      if (s.max_loaded) {
        const loaded = s.loaded || [];
        const pinnedSet = new Set(s.pinned);
        const boxes = [];
        const ordered = [...loaded].sort((a, b) => (pinnedSet.has(b) - pinnedSet.has(a)) || a.localeCompare(b));
        for (let i = 0; i < Math.max(s.max_loaded, loaded.length) && i < 128; i++) {
          const name = ordered[i];
          boxes.push(h("span", {class: "slot" + (name ? (pinnedSet.has(name) ? " pinned" : " used") : ""), title: name || "free"}));
        }
        slots = [h("div", {class: "meter-label"}, h("span", null, "Slots"), h("span", {data: {slots: s.server}}, `${loaded.length} / ${s.max_loaded}`)),
          h("div", {class: "slots"}, boxes)];
      }
      const pinnedChips = s.pinned.map((m) => h("span", {class: "chip pinned", data: {pinned: m}}, m));
      const otherChips = (s.loaded || []).filter((m) => !s.pinned.includes(m)).slice(0, 40).map((m) => h("span", {class: "chip"}, m));
      const more = (s.loaded || []).length - s.pinned.length - otherChips.length;
      return h("div", {class: "server", data: {server: s.server}},
        h("div", {class: "server-head"}, h("span", {class: "server-name"}, s.server), badge(s.device, "device"),
          badge(s.up ? "up" : (s.lost ? "lost" : "down"))),
        h("div", {class: "meter-label"}, h("span", null, "Memory"),
          h("span", null, `${fmtBytes(used)} of ${budget ? fmtBytes(budget) : "∞"}` + (pinned ? ` · ${fmtBytes(pinned)} pinned` : ""))),
        meter, slots,
        h("div", {class: "chips"}, pinnedChips, otherChips, more > 0 ? h("span", {class: "muted small"}, `+${more} more`) : null,
          !(s.loaded || []).length ? h("span", {class: "muted small"}, "nothing loaded") : null));
    });
    $("servers").replaceChildren(...servers);
    $("servers-note").textContent = data.workers ? `${data.workers.live} of ${Math.max(data.workers.expected, data.workers.live)} router workers in touch` : "";
  }

  function renderCharts(data) {
    const hist = data.history;
    // Half an hour once there is that much; a young control plane's minutes fill the width.
    const age = hist.t.length ? data.at - hist.t[0] : 0;
    const span = Math.min(1800, Math.max(300, Math.ceil(age / 60) * 60));
    const churn = $("chart-churn");
    Charts.timeChart(churn, {t: hist.t, now: data.at, span_s: span, hoverX: churn.dataset.hoverX, series: [
      {name: "misses/min", values: hist.misses_per_min, color: COLORS.misses, fmt: fmtRate},
      {name: "evictions/min", values: hist.evictions_per_min, color: COLORS.evictions, fmt: fmtRate, fill: false, dash: "5 3"}]});
    const traffic = $("chart-traffic");
    Charts.timeChart(traffic, {t: hist.t, now: data.at, span_s: span, hoverX: traffic.dataset.hoverX, rightMax: 1, series: [
      {name: "requests/s", values: hist.requests_per_s, color: COLORS.requests, fmt: fmtRate},
      {name: "errors/s", values: hist.errors_per_s, color: COLORS.errors, fmt: fmtRate, fill: false},
      {name: "hit ratio", values: hist.hit_ratio, color: COLORS.hit, axis: "right", fill: false, fmt: (v) => fmtPct(v),
        fmtAxis: (v) => Math.round(v * 100) + "%"}]});
  }

  function variantNumbers(variants, names) {
    const cells = [h("span", {class: "h"}, ""), h("span", {class: "h"}, "requests"), h("span", {class: "h"}, "error rate"), h("span", {class: "h"}, "p99")];
    for (const [label, key] of names) {
      const v = variants[key] || {};
      cells.push(h("span", {class: "h"}, label), h("span", null, fmtNum(v.requests ?? 0)),
        h("span", null, isNum(v.error_rate) ? v.error_rate.toFixed(3) : "–"), h("span", null, fmtMs(v.p99_ms)));
    }
    return h("div", {class: "numbers"}, cells);
  }

  function renderRollouts(data) {
    $("rollouts-note").textContent = data.router ? "" : "no router runs with this control plane";
    const canaries = data.canaries.map((c) => {
      const stages = c.stages.map((pct, i) => {
        let cls = "stage";
        if (c.status === "promoted" || i < c.stage_index) cls += " done";
        if (i === c.stage_index && c.status === "running") cls += " current";
        if (i === c.stage_index && c.status === "rolled_back") cls += " failed";
        return h("div", {class: cls}, h("span", {class: "pip"}), pct + "%");
      });
      return h("div", {class: "card", data: {canary: c.route}},
        h("div", {class: "card-head"}, h("span", {class: "card-title"}, c.route + " → " + c.candidate),
          badge(c.status.replace("_", " "), c.status)),
        h("div", {class: "stages"}, stages),
        h("div", {class: "verdict"}, c.status === "promoted" ? "Candidate serves " : "Candidate gets ",
          h("b", {data: {percent: c.route}}, (c.status === "promoted" ? 100 : c.percent) + "%"),
          ` of traffic · stage ${c.stage_index + 1} of ${c.stages.length} · checks failed ${c.failed_checks}/${c.max_failed_checks}`),
        h("div", {class: "verdict"}, "Verdict: ", h("b", {data: {verdict: c.route}}, c.verdict),
          c.why ? h("span", {class: "why", data: {why: c.route}}, " — " + c.why) : null),
        Charts.steps(c.steps, {now: data.at}),
        variantNumbers(c.variants, [["canary", "canary"], ["baseline", "baseline"]]));
    });
    $("canaries").replaceChildren(...(canaries.length ? canaries : [h("div", {class: "empty"}, "No canaries.")]));

    const shadows = data.shadows.map((s) => {
      const rate = s.divergence_rate;
      const dropped = (s.dropped || 0) > 0;
      return h("div", {class: "card", data: {shadow: s.route}},
        h("div", {class: "card-head"}, h("span", {class: "card-title"}, s.route + " ⇢ " + s.model),
          h("span", {class: "muted small"}, s.percent + "% mirrored")),
        h("div", {class: "meter-label"}, h("span", null, "Divergence"),
          h("span", {data: {divergence: s.route}}, isNum(rate) ? fmtPct(rate) + ` (${fmtNum(s.diverged)} of ${fmtNum(s.compared)})` : "nothing compared yet")),
        h("div", {class: "bar " + (isNum(rate) && rate > 0.05 ? "bad" : "good")}, h("span", {style: {width: (isNum(rate) ? 100 * rate : 0) + "%"}})),
        h("div", {class: "counts"},
          h("span", null, "mirrored ", h("b", null, fmtNum(s.mirrored))),
          h("span", {class: dropped ? "alarm" : ""}, "dropped ", h("b", {data: {dropped: s.route}}, fmtNum(s.dropped))),
          h("span", null, "shed ", h("b", null, fmtNum(s.shed))),
          h("span", null, "errors ", h("b", null, fmtNum(s.errors))),
          h("span", null, "timeouts ", h("b", null, fmtNum(s.timeouts))),
          h("span", null, "latency Δ ", h("b", null, isNum(s.mean_latency_delta_ms) ? (s.mean_latency_delta_ms >= 0 ? "+" : "") + fmtMs(s.mean_latency_delta_ms) : "–"))));
    });
    $("shadows").replaceChildren(...(shadows.length ? shadows : [h("div", {class: "empty"}, "No shadows.")]));

    if (!data.experiments.length) {
      $("experiments").replaceChildren(h("div", {class: "empty"}, "No experiments."));
    } else {
      const rows = data.experiments.map((e) => {
        const ctl = e.variants.control || {};
        const tr = e.variants.treatment || {};
        return h("tr", {data: {experiment: e.id}},
          h("td", {class: "mono"}, e.id), h("td", {class: "mono"}, e.route),
          h("td", null, h("div", {class: "split", title: `${100 - e.treatment_percent}% ${e.control} / ${e.treatment_percent}% ${e.treatment}`},
            h("span", {class: "control", style: {width: (100 - e.treatment_percent) + "%"}}),
            h("span", {class: "treatment", style: {width: e.treatment_percent + "%"}}))),
          h("td", {class: "mono"}, e.control), h("td", {class: "mono"}, `${e.treatment} (${e.treatment_percent}%)`),
          h("td", null, `${fmtNum(ctl.requests ?? 0)} / ${fmtNum(tr.requests ?? 0)}`),
          h("td", null, `${fmtMs(ctl.p99_ms)} / ${fmtMs(tr.p99_ms)}`),
          h("td", null, badge(e.enabled ? "on" : "off", e.enabled ? "running" : "aborted")));
      });
      $("experiments").replaceChildren(h("table", {class: "plain"},
        h("thead", null, h("tr", null, ["experiment", "route", "split", "control", "treatment", "requests c / t", "p99 c / t", ""].map((t) => h("th", null, t)))),
        h("tbody", null, rows)));
    }
  }

  // ------------------------------------------------------------------ the models table
  const COLUMNS = [
    {key: "model", label: "Model"}, {key: "tier", label: "Tier"}, {key: "state", label: "State"},
    {key: "pinned", label: "Pin"}, {key: "server", label: "Server"}, {key: "last_used", label: "Last used"},
    {key: "load_time_s", label: "Load time", num: true}, {key: "hit_ratio", label: "Hit ratio"},
    {key: "requests", label: "Requests", num: true}, {key: "p50_ms", label: "p50", num: true},
    {key: "p99_ms", label: "p99", num: true}];
  let idx = {};

  function buildTable() {
    const head = h("div", {class: "thead", role: "row"}, COLUMNS.map((c) =>
      h("span", {role: "columnheader", class: c.num ? "num" : "", data: {sort: c.key},
        onclick: () => { state.sort = {key: c.key, dir: state.sort.key === c.key ? -state.sort.dir : 1}; applyFilter(); }}, c.label)));
    const spacer = h("div", {class: "spacer"});
    const viewport = h("div", {class: "viewport", onscroll: () => requestAnimationFrame(drawRows)}, spacer);
    $("models").replaceChildren(head, viewport);
    state.head = head;
    state.viewport = viewport;
    state.spacer = spacer;
  }

  function setRows(data) {
    idx = Object.fromEntries(data.models.columns.map((c, i) => [c, i]));
    state.rows = data.models.rows;
    state.lower = state.rows.map((r) => r[0].toLowerCase());
    const since = data.traffic.since;
    $("traffic-note").textContent = !data.traffic.configured
      ? "no router runs here: hit ratio and latency are on the routers' /metrics"
      : "hit ratio, requests and latency: " + (data.traffic.available ? (since ? "last 5 minutes" : "since the router started") : trafficWindow(data.traffic));
    applyFilter();
  }

  // "cust0 tier:hot state:ready pinned server:triton0": every word must match.
  function parseQuery(q) {
    const terms = [];
    for (const word of q.toLowerCase().split(/\s+/).filter(Boolean)) {
      const m = word.match(/^(tier|state|server):(.*)$/);
      if (m) terms.push({field: m[1], value: m[2]});
      else if (word === "pinned" || word === "pin") terms.push({field: "pinned"});
      else terms.push({field: "name", value: word});
    }
    return terms;
  }

  function applyFilter() {
    const terms = parseQuery(state.query);
    const names = terms.filter((t) => t.field === "name").map((t) => t.value);
    const rows = state.rows;
    const out = [];
    outer: for (let i = 0; i < rows.length; i++) {
      const r = rows[i];
      for (const t of terms) {
        if (t.field === "name") { if (!state.lower[i].includes(t.value)) continue outer; }
        else if (t.field === "pinned") { if (!r[idx.pinned]) continue outer; }
        else if (!String(r[idx[t.field]] ?? "").toLowerCase().startsWith(t.value)) continue outer;
      }
      out.push(i);
    }
    const k = idx[state.sort.key];
    const dir = state.sort.dir;
    const key = state.sort.key;
    out.sort((a, b) => {
      let va = rows[a][k];
      let vb = rows[b][k];
      if (key === "tier") { va = TIER_ORDER[va] ?? 9; vb = TIER_ORDER[vb] ?? 9; }
      if (va === vb) return state.lower[a] < state.lower[b] ? -1 : 1;
      if (va === null || va === undefined) return 1;
      if (vb === null || vb === undefined) return -1;
      return (va < vb ? -1 : 1) * dir;
    });
    state.filtered = out;
    state.highlight = names;
    for (const span of state.head.children) {
      span.classList.toggle("sorted", span.dataset.sort === key);
      span.classList.toggle("asc", span.dataset.sort === key && dir === -1);
    }
    const total = rows.length;
    $("filter-count").textContent = state.query ? `${fmtNum(out.length)} of ${fmtNum(total)} models` : `${fmtNum(total)} models`;
    state.spacer.style.height = Math.max(out.length * ROW_H, out.length ? 0 : 56) + "px";
    drawRows();
  }

  function highlighted(name) {
    const lower = name.toLowerCase();
    for (const term of state.highlight || []) {
      const at = lower.indexOf(term);
      if (at >= 0 && term) {
        return [name.slice(0, at), h("mark", null, name.slice(at, at + term.length)), name.slice(at + term.length)];
      }
    }
    return [name];
  }

  function ratioCell(v) {
    if (!isNum(v)) return h("span", {class: "muted"}, "–");
    return h("div", {class: "ratio" + (v < 0.5 ? " bad" : v < 0.9 ? " low" : "")},
      h("div", {class: "bar"}, h("span", {style: {width: (100 * v) + "%"}})), h("span", null, fmtPct(v, 0)));
  }

  function drawRows() {
    const vp = state.viewport;
    if (!vp) return;
    const now = state.data ? state.data.at : Date.now() / 1000;
    const first = Math.max(0, Math.floor(vp.scrollTop / ROW_H) - OVERSCAN);
    const last = Math.min(state.filtered.length, Math.ceil((vp.scrollTop + (vp.clientHeight || 600)) / ROW_H) + OVERSCAN);
    const out = [];
    if (!state.filtered.length) {
      out.push(h("div", {class: "no-rows", data: {empty: "1"}},
        state.rows.length ? ["No model matches ", h("span", {class: "mono", data: {query: "1"}}, "“" + state.query + "”"), "."] : "No models."));
    }
    for (let n = first; n < last; n++) {
      const r = state.rows[state.filtered[n]];
      const failure = r[idx.failure];
      out.push(h("div", {class: "row", role: "row", style: {top: (n * ROW_H) + "px"}, data: {model: r[0]}, title: failure || null},
        h("span", {class: "name", data: {col: "model"}}, highlighted(r[0])),
        h("span", {data: {col: "tier"}}, badge(r[idx.tier])),
        h("span", {data: {col: "state"}}, badge(r[idx.state])),
        h("span", {data: {col: "pinned"}}, r[idx.pinned] ? badge("pin", "pin") : ""),
        h("span", {class: "mono", data: {col: "server"}}, [r[idx.server], ...(r[idx.copies] || [])].filter(Boolean).join(", ") || "–"),
        h("span", {data: {col: "last_used"}}, fmtAgo(r[idx.last_used], now)),
        h("span", {class: "num", data: {col: "load_time_s"}}, isNum(r[idx.load_time_s]) ? fmtMs(r[idx.load_time_s] * 1000) : "–"),
        h("span", {data: {col: "hit_ratio"}}, ratioCell(r[idx.hit_ratio])),
        h("span", {class: "num", data: {col: "requests"}}, fmtNum(r[idx.requests])),
        h("span", {class: "num", data: {col: "p50_ms"}}, fmtMs(r[idx.p50_ms])),
        h("span", {class: "num", data: {col: "p99_ms"}}, fmtMs(r[idx.p99_ms]))));
    }
    state.spacer.replaceChildren(...out);
  }

  // ------------------------------------------------------------------ start
  function readHash() {
    const params = new URLSearchParams(location.hash.slice(1));
    return params.get("q") || "";
  }

  function start() {
    buildTable();
    const filter = $("filter");
    state.query = readHash();
    filter.value = state.query;
    filter.addEventListener("input", () => {
      state.query = filter.value;
      history.replaceState(null, "", state.query ? "#q=" + encodeURIComponent(state.query) : location.pathname);
      applyFilter();
    });
    window.addEventListener("hashchange", () => { state.query = readHash(); filter.value = state.query; applyFilter(); });
    $("signout").addEventListener("click", async () => {
      await fetch("/v1/session", {method: "DELETE", headers: {"Content-Type": "application/json"}, body: "{}", credentials: "same-origin"});
      location.reload();
    });
    document.addEventListener("visibilitychange", () => { if (!document.hidden) poll(); });
    setInterval(showLiveness, 1000);
    window.addEventListener("resize", () => { if (state.data) renderCharts(state.data); });
    poll();
  }

  // For tests and the curious: the filter's own timing, and the last document drawn.
  window.statusPage = {
    get data() { return state.data; },
    filterTiming(query) {
      const t0 = performance.now();
      state.query = query;
      $("filter").value = query;
      applyFilter();
      return performance.now() - t0;
    },
  };
  start();
})();
