// Hand-written SVG plots for the status page: a time chart with a hover read-out, and a
// sparkline.  Values only ever reach the document as text nodes and numeric attributes.
"use strict";

window.Charts = (() => {
  const NS = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, ...children) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }

  // 0, 1, 2, 5 x 10^n steps: a top for the axis at or above ``max``.
  function niceTop(max) {
    if (!(max > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(max)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= max) return m * p;
    return 10 * p;
  }

  function fmtAxis(v) {
    if (v === 0) return "0";
    if (Math.abs(v) >= 1000) return (v / 1000).toFixed(v % 1000 ? 1 : 0) + "k";
    if (Math.abs(v) < 1) return v.toFixed(2).replace(/0+$/, "").replace(/\.$/, "");
    return String(Math.round(v * 10) / 10);
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return String(d.getHours()).padStart(2, "0") + ":" + String(d.getMinutes()).padStart(2, "0");
  }

  // Lines through the points that have a value; a line breaks where two of them are more
  // than ``maxGap`` apart (a series read less often than others has nulls between its
  // points, which are no gap; a router that could not be read for minutes is one).
  function runs(t, values, maxGap = Infinity) {
    const out = [];
    let cur = [];
    for (let i = 0; i < t.length; i++) {
      const v = values[i];
      if (v === null || v === undefined || Number.isNaN(v)) continue;
      if (cur.length && t[i] - cur[cur.length - 1][0] > maxGap) {
        out.push(cur);
        cur = [];
      }
      cur.push([t[i], v]);
    }
    if (cur.length) out.push(cur);
    return out;
  }

  // A time chart.  opts: {t: [unix s], series: [{name, values, color, unit, axis: "left"|"right",
  // fmt}], span_s, now, rightMax}.  Returns a container's content; hover shows every
  // series' value at the nearest time.
  function timeChart(container, opts) {
    const width = Math.max(container.clientWidth || 600, 260);
    const height = container.clientHeight || 200;
    const pad = {l: 40, r: opts.series.some((s) => s.axis === "right") ? 42 : 12, t: 10, b: 22};
    const now = opts.now;
    const x0 = now - opts.span_s;
    const W = width - pad.l - pad.r;
    const H = height - pad.t - pad.b;
    const x = (t) => pad.l + ((t - x0) / opts.span_s) * W;
    const left = opts.series.filter((s) => s.axis !== "right");
    const right = opts.series.filter((s) => s.axis === "right");
    const maxOf = (list) => Math.max(0, ...list.flatMap((s) => s.values.filter((v) => v !== null && v !== undefined)));
    const topL = niceTop(maxOf(left));
    const topR = opts.rightMax || niceTop(maxOf(right));
    const yL = (v) => pad.t + H - (v / topL) * H;
    const yR = (v) => pad.t + H - (v / topR) * H;
    const root = svg("svg", {viewBox: `0 0 ${width} ${height}`, role: "img",
      "aria-label": opts.series.map((s) => s.name).join(", ")});
    for (let i = 0; i <= 4; i++) {
      const vy = pad.t + (H * i) / 4;
      root.append(svg("line", {class: "gridline", x1: pad.l, x2: pad.l + W, y1: vy, y2: vy}));
      root.append(svg("text", {x: pad.l - 6, y: vy + 3.5, "text-anchor": "end"}, fmtAxis(topL * (1 - i / 4))));
      if (right.length) {
        root.append(svg("text", {x: pad.l + W + 6, y: vy + 3.5},
          (right[0].fmtAxis || fmtAxis)(topR * (1 - i / 4))));
      }
    }
    const tickEvery = opts.span_s >= 1200 ? 300 : 60;
    for (let t = Math.ceil(x0 / tickEvery) * tickEvery; t <= now; t += tickEvery) {
      root.append(svg("text", {x: x(t), y: height - 6, "text-anchor": "middle"}, clock(t)));
    }
    root.append(svg("line", {class: "axis", x1: pad.l, x2: pad.l + W, y1: pad.t + H, y2: pad.t + H}));
    const shown = opts.t.map((t) => t >= x0);
    for (const s of opts.series) {
      const y = s.axis === "right" ? yR : yL;
      const points = runs(opts.t.filter((_, i) => shown[i]), s.values.filter((_, i) => shown[i]), opts.maxGap_s || 90);
      for (const run of points) {
        const line = run.map(([t, v], i) => (i ? "L" : "M") + x(t).toFixed(1) + "," + y(v).toFixed(1)).join("");
        if (s.fill !== false && run.length > 1) {
          const area = line + `L${x(run[run.length - 1][0]).toFixed(1)},${pad.t + H}L${x(run[0][0]).toFixed(1)},${pad.t + H}Z`;
          root.append(svg("path", {d: area, fill: s.color, "fill-opacity": 0.12, stroke: "none"}));
        }
        root.append(svg("path", {d: line, fill: "none", stroke: s.color, "stroke-width": 2,
          "stroke-linejoin": "round", "stroke-dasharray": s.dash || "none"}));
        if (run.length === 1) {
          root.append(svg("circle", {cx: x(run[0][0]), cy: y(run[0][1]), r: 2.5, fill: s.color}));
        }
      }
    }
    const cursor = svg("line", {class: "cursor", x1: 0, x2: 0, y1: pad.t, y2: pad.t + H, visibility: "hidden"});
    root.append(cursor);
    const hit = svg("rect", {x: pad.l, y: pad.t, width: W, height: H, fill: "transparent"});
    root.append(hit);
    container.replaceChildren(root);
    const tip = document.createElement("div");
    tip.className = "tooltip";
    tip.hidden = true;
    container.append(tip);

    function show(clientX) {
      const box = root.getBoundingClientRect();
      const px = ((clientX - box.left) / box.width) * width;
      const t = x0 + ((px - pad.l) / W) * opts.span_s;
      let best = -1;
      for (let i = 0; i < opts.t.length; i++) {
        if (!shown[i]) continue;
        if (best < 0 || Math.abs(opts.t[i] - t) < Math.abs(opts.t[best] - t)) best = i;
      }
      if (best < 0) { hide(); return; }
      const cx = x(opts.t[best]);
      cursor.setAttribute("x1", cx);
      cursor.setAttribute("x2", cx);
      cursor.setAttribute("visibility", "visible");
      const rows = [document.createElement("b")];
      rows[0].textContent = clock(opts.t[best]) + ":" + String(new Date(opts.t[best] * 1000).getSeconds()).padStart(2, "0");
      for (const s of opts.series) {
        const line = document.createElement("div");
        const dot = document.createElement("i");
        dot.style.background = s.color;
        const v = s.values[best];
        line.append(dot, document.createTextNode(s.name + ": " + (v === null || v === undefined ? "–" : (s.fmt || fmtAxis)(v))));
        rows.push(line);
      }
      tip.replaceChildren(...rows);
      tip.hidden = false;
      const left = (cx / width) * box.width;
      tip.style.left = Math.min(left + 12, box.width - tip.offsetWidth - 4) + "px";
      tip.style.top = "4px";
      container.dataset.hoverX = String(clientX);
    }
    function hide() {
      cursor.setAttribute("visibility", "hidden");
      tip.hidden = true;
      delete container.dataset.hoverX;
    }
    hit.addEventListener("mousemove", (e) => show(e.clientX));
    hit.addEventListener("mouseleave", hide);
    if (opts.hoverX !== undefined) show(Number(opts.hoverX));
  }

  // A small line with its area, no axes: a trend at a glance.
  function sparkline(values, opts = {}) {
    const width = opts.width || 160;
    const height = opts.height || 30;
    const vals = values.map((v) => (v === null || v === undefined ? null : v));
    const present = vals.filter((v) => v !== null);
    const root = svg("svg", {width: "100%", height, viewBox: `0 0 ${width} ${height}`,
      preserveAspectRatio: "none", "aria-hidden": "true"});
    if (present.length < 2) return root;
    const top = opts.max || niceTop(Math.max(...present));
    const x = (i) => (i / (vals.length - 1)) * width;
    const y = (v) => height - 2 - (v / top) * (height - 4);
    for (const run of runs(vals.map((_, i) => i), vals)) {  // by index: no gap is too long
      if (run.length < 2) continue;
      const line = run.map(([i, v], k) => (k ? "L" : "M") + x(i).toFixed(1) + "," + y(v).toFixed(1)).join("");
      root.append(svg("path", {d: line + `L${x(run[run.length - 1][0])},${height}L${x(run[0][0])},${height}Z`,
        fill: opts.color || "currentColor", "fill-opacity": 0.14}));
      root.append(svg("path", {d: line, fill: "none", stroke: opts.color || "currentColor", "stroke-width": 1.6,
        "vector-effect": "non-scaling-stroke"}));
    }
    return root;
  }

  // A canary's traffic share over time, as steps, with its verdicts marked.
  function steps(points, opts = {}) {
    const width = opts.width || 360;
    const height = opts.height || 46;
    const root = svg("svg", {width: "100%", height, viewBox: `0 0 ${width} ${height}`,
      preserveAspectRatio: "none", "aria-hidden": "true"});
    const valid = points.filter((p) => p.at !== null && p.at !== undefined);
    if (!valid.length) return root;
    const t0 = valid[0].at;
    const t1 = Math.max(opts.now || t0, valid[valid.length - 1].at, t0 + 1);
    const x = (t) => 4 + ((t - t0) / (t1 - t0)) * (width - 8);
    const y = (p) => height - 4 - (p / 100) * (height - 10);
    let d = "";
    let last = null;
    for (const p of valid) {
      const pct = p.percent === null || p.percent === undefined ? 0 : p.percent;
      d += last === null ? `M${x(p.at)},${y(pct)}` : `L${x(p.at)},${y(last)}L${x(p.at)},${y(pct)}`;
      last = pct;
    }
    d += `L${x(t1)},${y(last)}`;
    root.append(svg("path", {d, fill: "none", stroke: opts.color || "#3a6df0", "stroke-width": 2,
      "vector-effect": "non-scaling-stroke"}));
    for (const p of valid) {
      const bad = p.decision === "rollback" || p.decision === "fail" || p.decision === "abort";
      const good = p.decision === "promote" || p.decision === "promote_by_hand" || p.decision === "advance";
      if (!bad && !good) continue;
      root.append(svg("circle", {cx: x(p.at), cy: y(p.percent || 0), r: 3.5,
        fill: bad ? "#d64545" : "#17a06b"}));
    }
    return root;
  }

  return {timeChart, sparkline, steps, niceTop};
})();
