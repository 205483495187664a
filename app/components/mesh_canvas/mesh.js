// Mesh canvas: draws a MeshScene (app/figures.py) and answers clicks, boxes and hovers at once.
//
// Streamlit's component protocol, spoken directly: the frame says "streamlit:componentReady"
// (API version 1); the page sends "streamlit:render" with the arguments on every run that
// changed them; the frame answers "streamlit:setComponentValue" (the ids selected, its
// instance and a sequence number) and "streamlit:setFrameHeight". Positions are re-read only
// when the scene's key changes; a run's selection is taken unless this frame has clicked
// since the last pick the page applied ("ack"), so a quick second click is never undone.
"use strict";
(function () {
  const FAILED = "#d62728", BROKEN = "#b0b0b0", BRIDGE = "#e69f00", PICKED = "#111111";
  const DASH = { solid: [], dot: [2, 4], dash: [7, 5] };
  const TOP = 26, MARGIN = 6, PAD = 0.8, MIN_H = 180, FAILED_MIN_PX = 10, DRAG_PX = 4;
  const base = document.getElementById("base"), over = document.getElementById("over");
  const wrap = document.getElementById("wrap"), tip = document.getElementById("tip");
  const legendEl = document.getElementById("legend"), captionEl = document.getElementById("caption");
  const bctx = base.getContext("2d"), octx = over.getContext("2d");
  const instance = Math.random().toString(36).slice(2, 10) + Date.now().toString(36);

  let scene = null, cellOf = new Map(), selected = new Set(), marks = new Map();
  let seq = 0, sceneSeq = 0, args = null;
  let sx = new Float32Array(0), sy = new Float32Array(0), cellPx = 6, W = 0, H = 0, maxH = 760;
  let hover = -1, press = null, box = null, sentHeight = -1, ink = "#31333f";

  const post = (type, data) => window.parent.postMessage(Object.assign({ isStreamlitMessage: true, type: type }, data), "*");

  // What tests and the benchmark read: where a cell is drawn, what is selected, whether the last run is drawn.
  window.meshpact = {
    drawn: false,
    kind: () => (scene ? scene.kind : null),
    selected: () => [...selected].sort((a, b) => a - b),
    marks: () => [...marks].sort((a, b) => a[0] - b[0]),
    xy: (id) => {
      const i = cellOf.get(id);
      if (i === undefined) return null;
      const r = over.getBoundingClientRect();
      return [r.left + sx[i], r.top + sy[i]];
    },
  };

  window.addEventListener("message", (ev) => {
    const d = ev.data;
    if (!d || d.type !== "streamlit:render") return;
    if (d.theme && d.theme.textColor) {  // host names, legend and caption in the app's text colour (dark themes too)
      ink = d.theme.textColor;
      document.body.style.color = ink;
    }
    render(d.args || {});
  });
  window.addEventListener("resize", () => { if (scene) { layout(); paint(); } });

  function render(a) {
    window.meshpact.drawn = false;
    args = a;
    if (!scene || a.scene.key !== scene.key) {
      scene = a.scene;
      cellOf = new Map(scene.ids.map((id, i) => [id, i]));
      sceneSeq = seq;  // a pick made on another scene is never applied: take the run's selection
      hover = -1;
    }
    maxH = scene.kind === "nodes" ? 520 : 760;
    const acked = Array.isArray(a.ack) && a.ack[0] === instance ? a.ack[1] : -1;
    if (seq <= Math.max(acked, sceneSeq)) selected = new Set(a.selected || []);
    marks = new Map(a.marks || []);
    captionEl.textContent = a.caption || "";
    captionEl.style.display = a.caption ? "" : "none";
    layout();
    paint();
    window.meshpact.drawn = true;
  }

  function layout() {
    W = Math.max(200, document.body.clientWidth);
    const xs = scene.x, ys = scene.y, n = xs.length;
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (let i = 0; i < n; i++) {
      x0 = Math.min(x0, xs[i]); x1 = Math.max(x1, xs[i]); y0 = Math.min(y0, ys[i]); y1 = Math.max(y1, ys[i]);
    }
    const spanX = x1 - x0 + 2 * PAD, spanY = y1 - y0 + 2 * PAD;
    const scale = Math.min((W - 2 * MARGIN) / spanX, (maxH - TOP - MARGIN) / spanY, 44 / scene.step);
    H = Math.max(MIN_H, Math.ceil(TOP + spanY * scale + MARGIN));
    const ox = (W - (x1 - x0) * scale) / 2, oy = TOP + (H - TOP - MARGIN - (y1 - y0) * scale) / 2;
    sx = new Float32Array(n); sy = new Float32Array(n);
    for (let i = 0; i < n; i++) { sx[i] = ox + (xs[i] - x0) * scale; sy[i] = oy + (y1 - ys[i]) * scale; }
    cellPx = Math.max(2.5, Math.min(scene.labelled ? 24 : 18, scene.step * scale * 0.78));
    const dpr = window.devicePixelRatio || 1;
    for (const [c, ctx] of [[base, bctx], [over, octx]]) {
      c.width = Math.round(W * dpr); c.height = Math.round(H * dpr);
      c.style.width = W + "px"; c.style.height = H + "px";
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    }
    wrap.style.height = H + "px";
  }

  const isRanks = () => scene.kind === "ranks";
  const isMarked = (i) => (isRanks() ? selected.has(scene.ids[i]) : (marks.get(scene.ids[i]) || 0) > 0);

  function brokenGroups() {
    const out = new Set();
    if (!isRanks()) return out;
    for (const id of selected) { const i = cellOf.get(id); if (i !== undefined) out.add(scene.group[i]); }
    return out;
  }

  function paint() {
    const ctx = bctx, s = scene;
    ctx.clearRect(0, 0, W, H);
    const broken = brokenGroups();
    ctx.lineWidth = 1.5;
    for (const ring of s.rings) {  // each domain's ring: grey and dashed once a member failed
      const cells = ring.cells;
      if (cells.length < 2) continue;
      const ok = !broken.has(ring.group);
      ctx.strokeStyle = ok ? s.groups[ring.group].colour : BROKEN;
      ctx.setLineDash(ok ? [] : DASH.dash);
      ctx.beginPath();
      ctx.moveTo(sx[cells[0]], sy[cells[0]]);
      for (let k = 1; k < cells.length; k++) ctx.lineTo(sx[cells[k]], sy[cells[k]]);
      if (ring.closed) ctx.closePath();
      ctx.stroke();
    }
    ctx.lineWidth = 3;
    for (const l of s.links) {  // bridge links between domains
      const ok = !isMarked(l.a) && !isMarked(l.b);
      ctx.strokeStyle = ok ? l.colour : BROKEN;
      ctx.setLineDash(DASH[l.dash] || []);
      ctx.beginPath(); ctx.moveTo(sx[l.a], sy[l.a]); ctx.lineTo(sx[l.b], sy[l.b]); ctx.stroke();
    }
    ctx.setLineDash([]);
    const h = cellPx / 2, round = s.labelled;
    for (let gi = 0; gi < s.groups.length; gi++) {  // healthy cells, one fill style per domain
      ctx.fillStyle = s.groups[gi].colour;
      ctx.beginPath();
      for (let i = 0; i < s.ids.length; i++) {
        if (s.group[i] !== gi || isMarked(i)) continue;
        if (round) { ctx.moveTo(sx[i] + h, sy[i]); ctx.arc(sx[i], sy[i], h, 0, 2 * Math.PI); }
        else ctx.rect(sx[i] - h, sy[i] - h, cellPx, cellPx);
      }
      ctx.fill();
    }
    ctx.fillStyle = FAILED;  // failed ranks, or nodes holding some
    ctx.beginPath();
    for (let i = 0; i < s.ids.length; i++) if (isMarked(i)) ctx.rect(sx[i] - h, sy[i] - h, cellPx, cellPx);
    ctx.fill();
    if (isRanks()) {  // a cross on each failed rank, never smaller than FAILED_MIN_PX
      const c = Math.max(h, FAILED_MIN_PX / 2) * 0.8;
      ctx.lineWidth = cellPx >= 8 ? 2 : 2.5;
      ctx.strokeStyle = cellPx >= 8 ? "#ffffff" : FAILED;
      ctx.beginPath();
      for (const id of selected) {
        const i = cellOf.get(id);
        if (i === undefined) continue;
        ctx.moveTo(sx[i] - c, sy[i] - c); ctx.lineTo(sx[i] + c, sy[i] + c);
        ctx.moveTo(sx[i] + c, sy[i] - c); ctx.lineTo(sx[i] - c, sy[i] + c);
      }
      ctx.stroke();
      ctx.strokeStyle = BRIDGE; ctx.lineWidth = 2.5;  // a ring round each healthy bridge rank
      ctx.beginPath();
      for (const g of s.groups) {
        if (g.bridge < 0 || isMarked(g.bridge)) continue;
        const r = h + 2.5;
        ctx.moveTo(sx[g.bridge] + r, sy[g.bridge]); ctx.arc(sx[g.bridge], sy[g.bridge], r, 0, 2 * Math.PI);
      }
      ctx.stroke();
    } else {  // the nodes drawn rank by rank below
      ctx.strokeStyle = PICKED; ctx.lineWidth = 2;
      ctx.beginPath();
      for (const id of selected) {
        const i = cellOf.get(id);
        if (i !== undefined) ctx.rect(sx[i] - h - 1.5, sy[i] - h - 1.5, cellPx + 3, cellPx + 3);
      }
      ctx.stroke();
    }
    if (s.labelled) {  // rank ids in small meshes, in a font that fits the widest id inside its cell, or none
      ctx.textAlign = "center"; ctx.textBaseline = "middle";
      const widest = String(Math.max(...s.ids));
      let px = 11;
      for (; px >= 7; px--) {
        ctx.font = `${px}px sans-serif`;
        if (ctx.measureText(widest).width <= cellPx - 3) break;
      }
      if (px >= 7) {
        ctx.fillStyle = "#ffffff";
        for (let i = 0; i < s.ids.length; i++) if (!isMarked(i)) ctx.fillText(String(s.ids[i]), sx[i], sy[i]);
      }
    }
    ctx.fillStyle = ink; ctx.font = "bold 14px sans-serif"; ctx.textBaseline = "bottom";
    for (const host of s.hosts) {  // host names above their cells, kept inside the canvas
      const i = nearestTo(host.x, host.y);
      const w = ctx.measureText(host.name).width;
      const x = Math.min(Math.max(hostX(host), w / 2 + 2), W - w / 2 - 2);
      ctx.textAlign = "center";
      ctx.fillText(host.name, x, Math.max(16, (i >= 0 ? sy[i] : TOP) - h - 6));
    }
    paintOver();
    legend(broken);
    const aria = isRanks()
      ? `${s.ids.length} ranks in ${s.groups.length} domains; failed: ${selected.size ? [...selected].sort((a, b) => a - b).join(", ") : "none"}`
      : `${s.ids.length} nodes; picked: ${selected.size ? [...selected].sort((a, b) => a - b).join(", ") : "none"}`;
    over.setAttribute("aria-label", aria);
    sizeFrame();
  }

  function hostX(host) {  // the screen x of a host's centre, from its cells' screen extent
    let lo = Infinity, hi = -Infinity;
    for (let i = 0; i < scene.ids.length; i++) {
      if (scene.groups[scene.group[i]].host !== host.name) continue;
      lo = Math.min(lo, sx[i]); hi = Math.max(hi, sx[i]);
    }
    return (lo + hi) / 2;
  }

  function nearestTo(x, y) {  // the cell nearest a point in drawing units
    let best = -1, bd = Infinity;
    for (let i = 0; i < scene.ids.length; i++) {
      const d = (scene.x[i] - x) ** 2 + (scene.y[i] - y) ** 2;
      if (d < bd) { bd = d; best = i; }
    }
    return best;
  }

  function legend(broken) {
    const s = scene, items = [];
    const key = (swatch, text) => `<span class="key">${swatch}<span>${text}</span></span>`;
    const esc = (t) => String(t).replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
    const lost = new Set();
    if (isRanks()) {
      const failedIn = new Map();
      for (const id of selected) { const i = cellOf.get(id); if (i !== undefined) failedIn.set(s.group[i], (failedIn.get(s.group[i]) || 0) + 1); }
      const size = new Map();
      for (const g of s.group) size.set(g, (size.get(g) || 0) + 1);
      for (const [g, k] of failedIn) if (k === size.get(g)) lost.add(g);
    }
    s.groups.forEach((g, gi) => items.push(key(`<span class="sw" style="background:${g.colour}"></span>`,
      esc(g.label) + (lost.has(gi) ? " <b>lost</b>" : ""))));
    items.push(key(`<span class="sw" style="background:${FAILED}"></span>`, isRanks() ? "failed" : "node with failed ranks"));
    if (isRanks() && s.groups.some((g) => g.bridge >= 0))
      items.push(key(`<span class="sw" style="border:2.5px solid ${BRIDGE};border-radius:50%"></span>`, "bridge rank"));
    if (!isRanks()) items.push(key(`<span class="sw" style="border:2px solid ${PICKED}"></span>`, "drawn below"));
    const seen = new Set();
    for (const l of s.links) {
      if (seen.has(l.label)) continue;
      seen.add(l.label);
      const style = l.dash === "dot" ? "dotted" : l.dash === "dash" ? "dashed" : "solid";
      items.push(key(`<span class="line" style="border-top:3px ${style} ${l.colour}"></span>`, esc(l.label)));
    }
    if (broken.size || s.links.some((l) => isMarked(l.a) || isMarked(l.b)))
      items.push(key(`<span class="line" style="border-top:2px dashed ${BROKEN}"></span>`, "communicator broken"));
    const html = items.join("");
    if (legendEl.innerHTML !== html) legendEl.innerHTML = html;
  }

  function sizeFrame() {
    const h = Math.ceil(document.body.scrollHeight);
    if (h !== sentHeight) { sentHeight = h; post("streamlit:setFrameHeight", { height: h }); }
  }

  function paintOver() {
    octx.clearRect(0, 0, W, H);
    if (hover >= 0) {
      octx.strokeStyle = PICKED; octx.lineWidth = 1.5;
      const r = Math.max(cellPx / 2 + 3, 5);
      octx.strokeRect(sx[hover] - r, sy[hover] - r, 2 * r, 2 * r);
    }
    if (box) {
      octx.fillStyle = "rgba(31,119,180,0.12)"; octx.strokeStyle = "#1f77b4"; octx.lineWidth = 1; octx.setLineDash([4, 3]);
      const [x, y, w, h] = rect(box);
      octx.fillRect(x, y, w, h); octx.strokeRect(x, y, w, h); octx.setLineDash([]);
    }
  }

  const rect = (b) => [Math.min(b.x0, b.x1), Math.min(b.y0, b.y1), Math.abs(b.x1 - b.x0), Math.abs(b.y1 - b.y0)];

  function hit(x, y) {  // the cell under the pointer, if one is close enough
    const reach = Math.max(cellPx / 2 + 2, 6) ** 2;
    let best = -1, bd = reach;
    for (let i = 0; i < sx.length; i++) {
      const d = (sx[i] - x) ** 2 + (sy[i] - y) ** 2;
      if (d <= bd) { bd = d; best = i; }
    }
    return best;
  }

  function showTip(i, x, y) {
    if (i < 0) { tip.style.display = "none"; return; }
    const g = scene.groups[scene.group[i]], id = scene.ids[i];
    let text;
    if (isRanks()) {
      text = `rank ${id} · ${g.name} · ${g.host}` + (selected.has(id) ? " (failed)" : "") + (g.bridge === i ? " · bridge rank" : "");
    } else {
      const k = marks.get(id) || 0;
      text = `${scene.text[i]} · ${g.name} · ${g.host}` + (k ? ` · ${k} failed` : "");
    }
    tip.textContent = text;
    tip.style.display = "block";
    const w = tip.offsetWidth, h = tip.offsetHeight;  // kept inside the frame, never cut off
    tip.style.left = Math.max(2, Math.min(x + 12, W - w - 2)) + "px";
    tip.style.top = (y + 14 + h <= H ? y + 14 : Math.max(2, y - h - 8)) + "px";
  }

  function commit(next) {
    selected = next;
    seq += 1;
    paint();
    post("streamlit:setComponentValue", {
      value: { scene: scene.key, instance: instance, seq: seq, ids: [...selected].sort((a, b) => a - b) },
      dataType: "json",
    });
  }

  function pos(ev) { const r = over.getBoundingClientRect(); return [ev.clientX - r.left, ev.clientY - r.top]; }

  over.addEventListener("pointerdown", (ev) => {
    if (!scene || ev.button !== 0) return;
    const [x, y] = pos(ev);
    press = { x0: x, y0: y, x1: x, y1: y };
    over.setPointerCapture(ev.pointerId);
  });
  over.addEventListener("pointermove", (ev) => {
    if (!scene) return;
    const [x, y] = pos(ev);
    if (press) {
      press.x1 = x; press.y1 = y;
      if (box || Math.hypot(x - press.x0, y - press.y0) > DRAG_PX) { box = press; tip.style.display = "none"; paintOver(); }
      return;
    }
    const i = hit(x, y);
    if (i !== hover) { hover = i; paintOver(); }
    showTip(i, x, y);
  });
  over.addEventListener("pointerleave", () => { if (!press) { hover = -1; paintOver(); tip.style.display = "none"; } });
  over.addEventListener("pointerup", (ev) => {
    if (!scene || !press) return;
    const [x, y] = pos(ev);
    const b = box;
    press = null; box = null;
    if (b) {  // a box: every cell inside (ranks fail; nodes are drawn below)
      const [bx, by, bw, bh] = rect(b);
      const inside = [];
      for (let i = 0; i < sx.length; i++)
        if (sx[i] >= bx && sx[i] <= bx + bw && sy[i] >= by && sy[i] <= by + bh) inside.push(scene.ids[i]);
      paintOver();
      if (!inside.length) return;
      commit(isRanks() ? new Set([...selected, ...inside]) : new Set(inside));
      return;
    }
    const i = hit(x, y);  // a click: a rank toggles; a node is drawn below alone
    if (i < 0) return;
    const id = scene.ids[i];
    if (isRanks()) {
      const next = new Set(selected);
      if (next.has(id)) next.delete(id); else next.add(id);
      commit(next);
    } else commit(new Set([id]));
    showTip(i, x, y);
  });

  post("streamlit:componentReady", { apiVersion: 1 });
})();
