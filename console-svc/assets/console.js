// The sandboxsched console's one script. Each page draws its first state from the JSON the
// server embedded in it, then follows the server's event stream (EventSource): no page polls.
// Everything the cluster says is drawn with textContent, never parsed as markup.
"use strict";

(() => {
  const $ = (selector, root = document) => root.querySelector(selector);

  /** An element with attributes (`text` sets its text; `on*` listeners) and children. */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else if (name === "class") node.className = value;
      // Through the CSSOM: the content security policy refuses style attributes.
      else if (name === "style") node.style.cssText = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else node.setAttribute(name, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  /** Replaces a node's children, skipping the absent ones. */
  function fill(node, ...children) {
    node.replaceChildren(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  }

  /** A CSS class for a state or level the cluster names: only ones the stylesheet knows,
   * so no name from a tenant or a peer can borrow the console's own classes. */
  const KNOWN = new Set(["degraded", "ready", "draining", "unhealthy", "running", "creating", "paused", "hibernated", "moving", "pooled",
    "waiting", "building", "error", "done", "finished", "running", "failed", "rollback", "rolledback", "info", "warn", "debug"]);
  const tone = (name) => {
    const lower = String(name || "").toLowerCase();
    return KNOWN.has(lower) ? lower : "other";
  };
  /** A finite number, for drawing (a missing or non-finite one draws as 0). */
  const num = (x) => (Number.isFinite(Number(x)) ? Number(x) : 0);

  const mib = (n) => (n >= 1024 ? `${(n / 1024).toFixed(1)} GiB` : `${n} MiB`);
  const pct = (part, whole) => (whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0);
  const when = (ms) => (ms ? new Date(ms).toLocaleString() : "—");
  function age(ms) {
    if (ms < 0) ms = 0;
    if (ms < 1000) return `${ms} ms`;
    if (ms < 60_000) return `${(ms / 1000).toFixed(1)} s`;
    if (ms < 3_600_000) return `${Math.floor(ms / 60_000)} min`;
    return `${(ms / 3_600_000).toFixed(1)} h`;
  }

  /** Calls "fn" once, `wait` ms after the last of a burst of calls. */
  function debounce(fn, wait) {
    let timer = null;
    return (...args) => {
      clearTimeout(timer);
      timer = setTimeout(() => fn(...args), wait);
    };
  }

  async function api(path, options = {}) {
    const response = await fetch(path, { credentials: "same-origin", ...options });
    if (response.status === 401) {
      location.assign("/console/login");
      throw new Error("signed out");
    }
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.message || `${response.status}`);
    return body;
  }

  function post(path, body) {
    return api(path, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify(body),
    });
  }

  /** Asks before an action; resolves true when confirmed. */
  function confirmAction(text) {
    const dialog = $("#confirm");
    $("#confirm-text").textContent = text;
    return new Promise((resolve) => {
      dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
      dialog.returnValue = "cancel";
      dialog.showModal();
      $("#confirm-ok").focus();
    });
  }

  function notice(text, isError) {
    let box = $("#notice");
    if (!box) {
      box = el("p", { id: "notice", role: "status" });
      $("#app").before(box);
    }
    box.textContent = text;
    box.className = isError ? "notice error" : "notice";
  }

  function setLive(state) {
    const live = $("#live");
    live.textContent = state === "live" ? "live" : state === "unreachable" ? "ledger unreachable: showing the last state seen" : state;
    live.dataset.state = state;
  }

  /** Follows the server's events the page draws; `handlers[name](data)` for each. */
  function follow(topics, handlers) {
    const source = new EventSource(`/console/events?topics=${encodeURIComponent(topics.join(","))}`);
    source.addEventListener("hello", (e) => setLive(JSON.parse(e.data).ledger));
    source.addEventListener("ledger", (e) => setLive(JSON.parse(e.data).ledger));
    source.addEventListener("reset", () => handlers.reset && handlers.reset());
    for (const topic of topics) {
      source.addEventListener(topic, (e) => handlers[topic](JSON.parse(e.data)));
    }
    source.onerror = () => setLive("reconnecting…");
    // Whatever changed between the page's first state and the stream opening (or while it
    // was reconnecting) is read again.
    source.onopen = () => handlers.reset && handlers.reset();
    return source;
  }

  /** A bar (role meter) of `used` out of `total`, with `reserved` shaded beyond it. */
  function bar(label, used, reserved, total, unit = mib) {
    return el(
      "div",
      {
        class: "bar",
        role: "meter",
        "aria-label": label,
        "aria-valuemin": 0,
        "aria-valuemax": total,
        "aria-valuenow": used,
        "aria-valuetext": `${unit(used)} used, ${unit(reserved)} allocated of ${unit(total)}`,
        title: `${unit(used)} used · ${unit(reserved)} allocated · ${unit(total)}`,
      },
      el("span", { class: "alloc", style: `width:${pct(reserved, total)}%` }),
      el("span", { class: "used", style: `width:${pct(used, total)}%` }),
      el("span", { class: "bar-text", text: `${unit(used)} / ${unit(reserved)} / ${unit(total)}` }),
    );
  }

  const SVG = "http://www.w3.org/2000/svg";

  /** A figure of lines over time: `lines` are [{points: [{t, v}], cls, name}] scaled to
   * 0..top over the last `windowMs`. */
  function lineChart(caption, lines, windowMs, top) {
    const w = 600;
    const h = 120;
    const now = Date.now();
    // As wide as the data reaches back (at least five minutes), up to the window.
    const first = Math.min(now, ...lines.flatMap((l) => l.points.map((p) => p.t)));
    windowMs = Math.min(windowMs, Math.max(300_000, now - first));
    const start = now - windowMs;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("role", "img");
    svg.setAttribute("aria-label", caption);
    svg.setAttribute("preserveAspectRatio", "none");
    for (const frac of [0.25, 0.5, 0.75]) {
      const grid = document.createElementNS(SVG, "line");
      grid.setAttribute("x1", 0);
      grid.setAttribute("x2", w);
      grid.setAttribute("y1", h * frac);
      grid.setAttribute("y2", h * frac);
      grid.setAttribute("class", "grid");
      svg.append(grid);
    }
    for (const line of lines) {
      const poly = document.createElementNS(SVG, "polyline");
      poly.setAttribute(
        "points",
        line.points
          .filter((p) => p.t >= start)
          .map((p) => `${(((p.t - start) / windowMs) * w).toFixed(1)},${(h - (Math.min(num(p.v), top) / top) * h).toFixed(1)}`)
          .join(" "),
      );
      poly.setAttribute("class", `series ${line.cls}`);
      svg.append(poly);
    }
    const legend = lines.length > 1 ? el("span", { class: "legend" }, lines.map((l) => el("span", { class: `key ${l.cls}`, text: l.name }))) : null;
    return el("figure", { class: "chart" }, el("figcaption", {}, caption, " ", legend), svg);
  }

  // ---- cluster ---------------------------------------------------------------------------

  function clusterPage(initial) {
    const nodes = new Map(initial.nodes.map((n) => [n.nodeId, n]));
    let placement = {};
    let spread = initial.spread || [];
    let counts = { total: initial.sandboxes, byState: initial.byState || {} };
    const app = $("#app");
    const summary = el("section", { class: "summary", "aria-label": "Summary" });
    let figure = el("figure", { class: "chart" });
    const tbody = el("tbody");
    app.append(
      summary,
      figure,
      el(
        "table",
        { class: "nodes", "aria-label": "Nodes" },
        el(
          "thead",
          {},
          el(
            "tr",
            {},
            ["Node", "State", "Memory (used / allocated / capacity)", "vCPU (used / allocated / capacity)", "Sandboxes", "Reserved", "Heartbeat", ""].map((h) =>
              el("th", { scope: "col", text: h }),
            ),
          ),
        ),
        tbody,
      ),
    );

    function drawSummary() {
      const states = Object.entries(counts.byState).map(([s, n]) => el("span", { class: `pill ${tone(s)}`, text: `${n} ${s}` }));
      const ready = [...nodes.values()].filter((n) => n.state === "ready").length;
      summary.replaceChildren(
        el("span", { class: "big", id: "node-count", text: `${nodes.size} nodes` }),
        el("span", { text: ` (${ready} ready) · ` }),
        el("span", { class: "big", id: "sandbox-count", text: `${counts.total} sandboxes` }),
        " ",
        ...states,
      );
    }

    function drawChart() {
      const top = Math.max(0.2, ...spread.map((p) => num(p.v)));
      const last = spread.length ? num(spread[spread.length - 1].v) : 0;
      figure.replaceWith(
        (figure = lineChart(`Spread the balancer watches (max − min of ready nodes' available memory ratio), last hour: now ${last.toFixed(3)}, scale 0–${top.toFixed(2)}`, [{ points: spread, cls: "spread", name: "spread" }], 3_600_000, top)),
      );
    }

    function row(n) {
      const p = placement[n.nodeId] || {};
      const draining = n.state === "draining";
      const heartbeat = el("td", { class: "num", "data-reported": n.reportedAtMs, text: age(Date.now() - n.reportedAtMs) });
      return el(
        "tr",
        { id: `node-${n.nodeId}`, "data-node-id": n.nodeId, "data-capacity-mib": n.memoryMib, "data-used-mib": n.usedMib, "data-allocated-mib": n.allocatedMib },
        el(
          "th",
          { scope: "row" },
          el("a", { href: `/console/sandboxes?node=${encodeURIComponent(n.nodeId)}`, text: n.nodeId }),
          (n.degraded || []).length ? el("ul", { class: "reasons", "aria-label": `Why ${n.nodeId} is degraded` }, n.degraded.map((r) => el("li", { text: r }))) : null,
        ),
        el(
          "td",
          {},
          el("span", { class: `pill ${tone(p.state === "unhealthy" ? "unhealthy" : n.state)}`, text: p.state === "unhealthy" ? "unhealthy" : n.state }),
          (n.degraded || []).length ? el("span", { class: "pill degraded", title: n.degraded.join("\n"), text: "degraded" }) : null,
        ),
        el("td", {}, bar(`Memory of ${n.nodeId}`, n.usedMib, n.allocatedMib, n.memoryMib)),
        el("td", {}, bar(`vCPUs of ${n.nodeId}`, p.cpuUsed || 0, n.allocatedVcpus, n.vcpus, (v) => `${Math.round(v * 10) / 10}`)),
        el("td", { class: "num", text: n.sandboxes }),
        el("td", { class: "num", text: p.pending ? `${p.pending} (${mib(p.reservedMib)})` : "—" }),
        heartbeat,
        el(
          "td",
          {},
          el("button", {
            type: "button",
            class: draining ? "" : "danger",
            "aria-label": `${draining ? "Undrain" : "Drain"} ${n.nodeId}`,
            text: draining ? "Undrain" : "Drain",
            onclick: () => drain(n.nodeId, draining),
          }),
        ),
      );
    }

    function drawRow(n) {
      const fresh = row(n);
      const old = document.getElementById(`node-${n.nodeId}`);
      if (old) old.replaceWith(fresh);
      else {
        const after = [...tbody.children].find((tr) => tr.dataset.nodeId > n.nodeId);
        tbody.insertBefore(fresh, after || null);
      }
    }

    async function drain(nodeId, undo) {
      const text = undo
        ? `Make ${nodeId} ready again? Placement may choose it for new sandboxes.`
        : `Drain ${nodeId}? Nothing new lands on it and the balancer moves its sandboxes away.`;
      if (!(await confirmAction(text))) return;
      try {
        const answer = await post(`/console/api/nodes/${encodeURIComponent(nodeId)}/drain`, { undo });
        notice(undo ? `${nodeId} is ready again.` : `${nodeId} is draining: ${answer.remaining} sandboxes to move.`);
      } catch (err) {
        notice(`Drain failed: ${err.message}`, true);
      }
    }

    async function refresh() {
      try {
        const snap = await api("/console/api/cluster");
        placement = snap.placement || {};
        nodes.clear();
        snap.nodes.forEach((n) => nodes.set(n.nodeId, n));
        spread = snap.spread;
        counts = { total: snap.sandboxes, byState: snap.byState };
        tbody.replaceChildren(...[...nodes.values()].map(row));
        drawSummary();
        drawChart();
        if (snap.placementError) notice(`Placement did not answer: ${snap.placementError}`, true);
      } catch (err) {
        notice(`Could not read the cluster: ${err.message}`, true);
      }
    }
    const recount = debounce(async () => {
      const page = await api("/console/api/sandboxes?limit=1");
      counts = { total: page.total, byState: page.byState };
      drawSummary();
    }, 250);

    tbody.replaceChildren(...[...nodes.values()].map(row));
    drawSummary();
    drawChart();
    refresh();
    setInterval(() => {
      // Ages only: redrawn from what the page has, nothing is asked of the server.
      for (const td of tbody.querySelectorAll("td[data-reported]")) td.textContent = age(Date.now() - Number(td.dataset.reported));
    }, 1000);
    follow(["node", "spread", "sandbox"], {
      node(n) {
        if (n.gone) {
          nodes.delete(n.nodeId);
          document.getElementById(`node-${n.nodeId}`)?.remove();
        } else {
          nodes.set(n.nodeId, n);
          drawRow(n);
        }
        drawSummary();
      },
      spread(p) {
        spread.push(p);
        spread = spread.filter((q) => q.t >= Date.now() - 3_600_000);
        drawChart();
      },
      sandbox() {
        recount();
      },
      reset: debounce(refresh, 100),
    });
  }

  // ---- sandboxes ---------------------------------------------------------------------------

  const ROW_HEIGHT = 34;

  function sandboxesPage(initial) {
    const params = new URLSearchParams(location.search);
    const filters = { q: params.get("q") || "", state: params.get("state") || "", node: params.get("node") || "", team: params.get("team") || "" };
    const app = $("#app");
    const count = el("p", { id: "matched", role: "status", "aria-live": "polite" });
    const input = (name, label, extra = {}) =>
      el("label", {}, label, " ", el("input", { name, value: filters[name], type: "search", "aria-label": label, ...extra, oninput: (e) => setFilter(name, e.target.value) }));
    const stateSelect = el(
      "select",
      { name: "state", "aria-label": "State", onchange: (e) => setFilter("state", e.target.value) },
      ["", "creating", "running", "paused", "hibernated", "moving", "pooled"].map((s) => el("option", { value: s, text: s || "any", selected: s === filters.state })),
    );
    const viewport = el("div", { class: "viewport", tabindex: "0", role: "region", "aria-label": "Sandboxes (scroll for more)" });
    const spacer = el("div", { class: "spacer" });
    const rows = el("div", { class: "rows", role: "table", "aria-label": "Sandboxes" });
    const header = el(
      "div",
      { class: "vrow head", role: "row" },
      ["Sandbox", "Team", "Template", "Node", "State", "Memory asked", "Measured", "Age"].map((h) => el("span", { role: "columnheader", text: h })),
    );
    viewport.append(spacer, rows);
    app.append(
      el("form", { class: "filters", role: "search", onsubmit: (e) => e.preventDefault() }, input("q", "Search", { placeholder: "ID, team, template or node", id: "search" }), el("label", {}, "State ", stateSelect), input("node", "Node"), input("team", "Team")),
      count,
      header,
      viewport,
    );

    let page = initial;
    let shown = new Map();

    function line(s, index) {
      return el(
        "div",
        { class: "vrow", role: "row", id: `sbx-${s.sandboxId}`, "data-sandbox-id": s.sandboxId, style: `transform:translateY(${index * ROW_HEIGHT}px)` },
        el("span", { role: "cell" }, el("a", { href: `/console/sandboxes/${encodeURIComponent(s.sandboxId)}`, text: s.sandboxId })),
        el("span", { role: "cell", text: s.teamId || "(pool)" }),
        el("span", { role: "cell", text: s.template }),
        el("span", { role: "cell", text: s.nodeId || "—" }),
        el("span", { role: "cell" }, el("span", { class: `pill ${tone(s.state)}`, text: s.state })),
        el("span", { role: "cell", class: "num", text: `${mib(s.memoryMib)} (${s.memorySource})` }),
        el("span", { role: "cell", class: "num", text: s.measuredMib == null ? "—" : mib(s.measuredMib) }),
        el("span", { role: "cell", class: "num", text: age(Date.now() - s.startedAtMs) }),
      );
    }

    function draw() {
      spacer.style.height = `${page.matched * ROW_HEIGHT}px`;
      shown = new Map(page.rows.map((s) => [s.sandboxId, s]));
      rows.replaceChildren(...page.rows.map((s, i) => line(s, page.offset + i)));
      count.textContent = `${page.matched} of ${page.total} sandboxes match`;
    }

    let asked = 0;
    async function load() {
      const first = Math.max(0, Math.floor(viewport.scrollTop / ROW_HEIGHT) - 20);
      const visible = Math.ceil(viewport.clientHeight / ROW_HEIGHT) + 40;
      const query = new URLSearchParams({ ...filters, offset: first, limit: visible });
      const mine = ++asked;
      try {
        const answer = await api(`/console/api/sandboxes?${query}`);
        if (mine === asked) {
          page = answer;
          draw();
        }
      } catch (err) {
        notice(`Could not read sandboxes: ${err.message}`, true);
      }
    }
    const reload = debounce(load, 120);

    function setFilter(name, value) {
      filters[name] = value;
      const url = new URL(location.href);
      for (const [k, v] of Object.entries(filters)) v ? url.searchParams.set(k, v) : url.searchParams.delete(k);
      history.replaceState(null, "", url);
      viewport.scrollTop = 0;
      reload();
    }

    viewport.addEventListener("scroll", reload, { passive: true });
    if (Object.values(filters).some(Boolean)) load();
    else draw();
    follow(["sandbox"], {
      sandbox(s) {
        const drawn = document.getElementById(`sbx-${s.sandboxId}`);
        if (drawn && !s.gone && shown.has(s.sandboxId)) {
          const index = page.rows.findIndex((r) => r.sandboxId === s.sandboxId);
          page.rows[index] = s;
          drawn.replaceWith(line(s, page.offset + index));
        } else {
          // Something joined, left or moved in the order: read this window again.
          reload();
        }
      },
      reset: reload,
    });
  }

  // ---- one sandbox ---------------------------------------------------------------------------

  function sandboxPage(initial) {
    const id = initial.sandboxId;
    const app = $("#app");
    async function draw() {
      let detail;
      try {
        detail = await api(`/console/api/sandboxes/${encodeURIComponent(id)}`);
      } catch (err) {
        app.replaceChildren(el("p", { class: "notice error", text: `${id}: ${err.message}` }));
        return;
      }
      const s = detail.sandbox;
      drawn = s;
      const facts = [
        ["Sandbox", s.sandboxId], ["Team", s.teamId || "(pool)"], ["Template", s.template], ["Node", s.nodeId || "—"],
        ["State", s.state], ["vCPUs", s.vcpus], ["Memory asked", `${mib(s.memoryMib)} (${s.memorySource})`],
        ["Measured", s.measuredMib == null ? "—" : mib(s.measuredMib)], ["Started", when(s.startedAtMs)],
        ["Ends", s.endAtMs > 4e15 ? "never" : when(s.endAtMs)], ["Epoch", s.epoch],
      ];
      const explain = detail.explain || {};
      const metrics = Array.isArray(detail.metrics) ? detail.metrics : [];
      const memTop = Math.max(s.memoryMib, ...metrics.map((m) => m.memMib), 1);
      const logs = Array.isArray(detail.logs) ? detail.logs : [];
      fill(
        app,
        el("dl", { class: "facts", id: "facts" }, facts.map(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })])),
        el("h2", { text: "Metrics" }),
        detail.metrics.error
          ? el("p", { class: "notice error", text: detail.metrics.error })
          : lineChart(
              `Memory used (of ${mib(memTop)}) and CPU (% of its vCPUs) over the hour its node keeps: ${metrics.length} samples`,
              [
                { points: metrics.map((m) => ({ t: m.t, v: m.memMib / memTop })), cls: "mem", name: "memory" },
                { points: metrics.map((m) => ({ t: m.t, v: m.cpuPct / 100 })), cls: "cpu", name: "CPU" },
              ],
              3_600_000,
              1,
            ),
        el("h2", { text: "Log" }),
        detail.logs.error
          ? el("p", { class: "notice error", text: detail.logs.error })
          : el("pre", { class: "log-box", id: "sandbox-log", tabindex: "0", "aria-label": "Sandbox log" }, logs.map((l) => el("span", { class: `log ${tone(l.level)}`, text: `${new Date(l.atMs).toLocaleTimeString()} ${l.level} ${l.message}\n` }))),
        el("h2", { text: "Manifest history (the ledger's change log)" }),
        detail.history.error
          ? el("p", { class: "notice error", text: detail.history.error })
          : el(
              "table",
              { "aria-label": "Manifest history", id: "history" },
              el("thead", {}, el("tr", {}, ["Revision", "Version", "What changed"].map((h) => el("th", { scope: "col", text: h })))),
              el("tbody", {}, detail.history.map((h) => el("tr", {}, el("td", { class: "num", text: h.revision }), el("td", { class: "num", text: h.version }), el("td", { text: h.changes.join(" · ") })))),
            ),
        el("h2", { text: "Placement now, for its size" }),
        explain.error
          ? el("p", { class: "notice error", text: explain.error })
          : el(
              "table",
              { "aria-label": "Placement's candidates" },
              el("thead", {}, el("tr", {}, ["Node", "Feasible", "Score", "Reason"].map((h) => el("th", { scope: "col", text: h })))),
              el(
                "tbody",
                {},
                (explain.candidates || []).map((c) =>
                  el("tr", { class: c.nodeId === explain.chosen ? "chosen" : "" }, el("td", { text: c.nodeId }), el("td", { text: c.feasible ? "yes" : "no" }), el("td", { class: "num", text: num(c.score).toFixed(3) }), el("td", { text: c.reason })),
                ),
              ),
            ),
      );
    }
    const redraw = debounce(draw, 150);
    let drawn = null;
    draw();
    follow(["sandbox"], {
      sandbox(s) {
        if (s.sandboxId !== id) return;
        // A new measure alone is not worth reading its history again.
        const same = drawn && !s.gone && ["state", "nodeId", "epoch", "endAtMs"].every((k) => s[k] === drawn[k]);
        drawn = s.gone ? null : s;
        if (!same) redraw();
      },
      reset: redraw,
    });
  }

  // ---- balance -------------------------------------------------------------------------------

  const STEPS = ["Planned", "Owned", "SourcePaused", "Restored", "TargetResumed", "Switched", "Done"];
  const STEP_NAMES = { Planned: "planned", Owned: "claim", SourcePaused: "pause + snapshot", Restored: "restore", TargetResumed: "resume", Switched: "switch", Done: "done" };

  function balancePage() {
    const app = $("#app");
    const drained = new Map();
    async function draw() {
      let b;
      let cluster;
      try {
        [b, cluster] = await Promise.all([api("/console/api/balance"), api("/console/api/cluster")]);
      } catch (err) {
        notice(`The balancer did not answer: ${err.message}`, true);
        return;
      }
      const o = b.observation;
      const pause = el("button", {
        type: "button",
        id: "pause",
        class: b.paused ? "" : "danger",
        text: b.paused ? "Resume balancing" : "Pause balancing",
        onclick: async () => {
          if (!(await confirmAction(b.paused ? "Resume balancing? The balancer plans and moves again." : "Pause balancing? No new plan starts until resumed."))) return;
          try {
            await post("/console/api/balance/pause", { paused: !b.paused });
          } catch (err) {
            notice(`Failed: ${err.message}`, true);
          }
          draw();
        },
      });
      const draining = (b.draining || []).map((node) => {
        const left = (b.remaining || {})[node] || 0;
        drained.set(node, Math.max(drained.get(node) || 0, left));
        const most = drained.get(node) || 1;
        return el(
          "li",
          {},
          `${node}: ${left} left `,
          el("progress", { max: most, value: most - left, "aria-label": `Drain of ${node}` }),
          el("button", { type: "button", "aria-label": `Undrain ${node}`, text: "Undrain", onclick: () => act(node, true) }),
        );
      });
      async function act(node, undo) {
        if (!(await confirmAction(undo ? `Make ${node} ready again?` : `Drain ${node}? The balancer moves its sandboxes away.`))) return;
        try {
          await post(`/console/api/nodes/${encodeURIComponent(node)}/drain`, { undo });
        } catch (err) {
          notice(`Failed: ${err.message}`, true);
        }
        draw();
      }
      const nodeButtons = cluster.nodes
        .filter((n) => n.state === "ready" && !(b.draining || []).includes(n.nodeId))
        .map((n) => el("button", { type: "button", class: "danger", "aria-label": `Drain ${n.nodeId}`, text: `Drain ${n.nodeId}`, onclick: () => act(n.nodeId, false) }));
      fill(
        app,
        el(
          "section",
          { class: "summary", "aria-label": "Observation" },
          el("span", { class: `pill ${tone(o.status)}`, id: "observation", text: o.status || "no observation yet" }),
          ` spread ${num(o.spread).toFixed(3)} over ${o.readyNodes} ready nodes · balancing ${b.paused ? "paused" : "active"} `,
          pause,
        ),
        el("h2", { text: "Drains" }),
        draining.length ? el("ul", { id: "drains" }, draining) : el("p", { text: "No node is draining." }),
        el("p", { class: "actions" }, nodeButtons),
        b.stuck.length ? el("h2", { text: "Stuck" }) : null,
        b.stuck.length ? el("ul", {}, b.stuck.map((s) => el("li", { text: `${s.sandboxId} on ${s.nodeId}: ${s.failures} failures, ${s.error}` }))) : null,
        el("h2", { text: "Plans" }),
        b.plans.length ? null : el("p", { id: "no-plans", text: "No plan yet: the balancer plans when the spread passes its threshold, or a node drains." }),
        el("div", { id: "plans" }, b.plans.map((p) => planElement(p, b.activePlan))),
      );
    }
    function planElement(p, activePlan) {
      const skips = Object.entries(p.skips || {}).map(([why, n]) => `${n} skipped (${why})`).join(", ");
      return el(
        "details",
        { open: p.planId === activePlan || p.state === "Running" || p.state === "running" ? true : null, "data-plan-id": p.planId },
        el(
          "summary",
          {},
          el("span", { class: `pill ${tone(p.state)}`, text: p.state }),
          ` ${p.planId} · ${p.reason} · spread ${num(p.spreadBefore).toFixed(3)} → ${num(p.spreadExpected).toFixed(3)} · ${p.moves.length} moves${(p.drops || []).length ? ` · ${p.drops.length} pooled dropped` : ""}${skips ? ` · ${skips}` : ""} · ${when(p.createdAtMs)}${p.finishedAtMs ? ` · took ${age(p.finishedAtMs - p.createdAtMs)}` : ""}`,
        ),
        el(
          "table",
          { "aria-label": `Moves of ${p.planId}` },
          el("thead", {}, el("tr", {}, ["Sandbox", "From → to", "Memory", "Steps", "Downtime", "Error"].map((h) => el("th", { scope: "col", text: h })))),
          el(
            "tbody",
            {},
            p.moves.map((m) =>
              el(
                "tr",
                { class: "move", "data-sandbox-id": m.sandboxId, "data-step": m.step },
                el("td", {}, el("a", { href: `/console/sandboxes/${encodeURIComponent(m.sandboxId)}`, text: m.sandboxId })),
                el("td", { text: `${m.from} → ${m.to}` }),
                el("td", { class: "num", text: mib(m.memoryMib) }),
                el("td", {}, steps(m.step)),
                el("td", { class: "num", text: m.downtimeMs ? `${m.downtimeMs} ms` : "—" }),
                el("td", { text: m.error || "" }),
              ),
            ).concat(
              // A pooled sandbox is dropped, not moved: its pool refills wherever placement puts it.
              (p.drops || []).map((d) =>
                el(
                  "tr",
                  { class: "drop", "data-sandbox-id": d.sandboxId },
                  el("td", {}, el("a", { href: `/console/sandboxes/${encodeURIComponent(d.sandboxId)}`, text: d.sandboxId })),
                  el("td", { text: `${d.from} → dropped (its pool refills)` }),
                  el("td", { class: "num", text: mib(d.memoryMib) }),
                  el("td", {}, el("span", { class: "pill", text: "Dropped" })),
                  el("td", { class: "num", text: "—" }),
                  el("td", { text: "" }),
                ),
              ),
            ),
          ),
        ),
      );
    }
    /** A plan as it changes: drawn in place, or first in the list when new. */
    function drawPlan(p) {
      const list = document.getElementById("plans");
      if (!list) return;
      document.getElementById("no-plans")?.remove();
      const fresh = planElement(p, p.planId);
      const old = list.querySelector(`details[data-plan-id="${CSS.escape(p.planId)}"]`);
      if (old) old.replaceWith(fresh);
      else list.prepend(fresh);
    }
    function steps(current) {
      const at = STEPS.indexOf(current);
      if (at < 0) return el("span", { class: "pill rollback", text: current });
      return el("ol", { class: "steps", "aria-label": `At step ${current}` }, STEPS.map((s, i) => el("li", { class: i < at ? "done" : i === at ? "now" : "", text: STEP_NAMES[s] })));
    }
    const redraw = debounce(draw, 300);
    draw();
    follow(["balance", "plan", "sandbox"], {
      // A plan's own changes come whole as `plan`; the rest of the page (observation, pause,
      // drains' progress) is read again.
      balance: (b) => (b.key.startsWith("balance-plan/") ? null : redraw()),
      plan: drawPlan,
      sandbox: redraw,
      reset: redraw,
    });
  }

  // ---- templates -----------------------------------------------------------------------------

  function templatesPage() {
    const app = $("#app");
    async function draw() {
      let list;
      try {
        list = await api("/console/api/templates");
      } catch (err) {
        notice(`Could not read templates: ${err.message}`, true);
        return;
      }
      app.replaceChildren(
        el(
          "table",
          { "aria-label": "Templates", id: "templates" },
          el("thead", {}, el("tr", {}, ["Template", "Names", "Team", "Resources", "Tags", "Warm pool", "Builds"].map((h) => el("th", { scope: "col", text: h })))),
          el(
            "tbody",
            {},
            list.map(({ template: t, builds }) =>
              el(
                "tr",
                { "data-template-id": t.templateId },
                el("th", { scope: "row", text: t.templateId }),
                el("td", { text: t.names.join(", ") }),
                el("td", { text: t.public ? "public" : t.teamId }),
                el("td", { text: t.vcpus ? `${t.vcpus} vCPU · ${t.memoryMb} MB` : "the create's" }),
                el("td", { text: Object.keys(t.tags).join(", ") }),
                el("td", { class: "num", text: t.poolSize == null ? "—" : `${t.poolSlots} / ${t.poolSize}` }),
                el("td", {}, builds.map((b) => el("a", { class: `pill ${tone(b.status)}`, href: `/console/builds/${encodeURIComponent(b.buildId)}`, text: `${b.status} ${b.buildId.slice(0, 8)}` }))),
              ),
            ),
          ),
        ),
      );
    }
    const redraw = debounce(draw, 150);
    draw();
    follow(["template", "build"], { template: redraw, build: redraw, reset: redraw });
  }

  function buildPage(initial) {
    const id = initial.buildId;
    const app = $("#app");
    const status = el("p", { id: "build-status", role: "status", "aria-live": "polite" });
    const log = el("pre", { id: "build-log", tabindex: "0", "aria-label": "Build log" });
    let lines = 0;
    app.append(status, log);
    function show(row) {
      status.textContent = `${row.buildId} of ${row.templateId}: ${row.status}${row.nodeId ? ` on ${row.nodeId}` : ""}${row.reason ? ` — ${row.reason}` : ""}`;
      status.dataset.status = row.status;
    }
    function append(chunk) {
      const stick = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
      const skip = Math.max(0, lines - chunk.offset);
      for (const l of chunk.lines.slice(skip)) {
        log.append(el("span", { class: `log ${tone(l.level)}`, text: `${l.step ? `[${l.step}] ` : ""}${l.message}\n` }));
      }
      lines = Math.max(lines, chunk.offset + chunk.lines.length);
      if (stick) log.scrollTop = log.scrollHeight;
    }
    async function catchUp() {
      try {
        const answer = await api(`/console/api/builds/${encodeURIComponent(id)}?offset=${lines}`);
        show(answer.build);
        append(answer.log);
      } catch (err) {
        notice(`${id}: ${err.message}`, true);
      }
    }
    catchUp();
    follow(["build"], {
      build([row, chunk]) {
        if (row.buildId !== id) return;
        show(row);
        if (chunk.offset > lines) catchUp();
        else {
          append(chunk);
          // An event carries a bounded chunk: the rest is read.
          if (row.logLines > lines) catchUp();
        }
      },
      reset: catchUp,
    });
  }

  // ---- start ---------------------------------------------------------------------------------

  const saved = localStorage.getItem("console-theme");
  if (saved) document.documentElement.dataset.theme = saved;
  $("#theme")?.addEventListener("click", () => {
    const dark = document.documentElement.dataset.theme
      ? document.documentElement.dataset.theme === "dark"
      : matchMedia("(prefers-color-scheme: dark)").matches;
    document.documentElement.dataset.theme = dark ? "light" : "dark";
    localStorage.setItem("console-theme", document.documentElement.dataset.theme);
  });
  const initial = JSON.parse($("#initial")?.textContent || "null");
  const pages = { cluster: clusterPage, sandboxes: sandboxesPage, sandbox: sandboxPage, balance: balancePage, templates: templatesPage, build: buildPage };
  const start = pages[document.body.dataset.page];
  if (start) start(initial);
})();
