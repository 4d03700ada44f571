"""`crucible dashboard`: the run's panels, live, from the store, in a browser, without Grafana.

The page draws the store panels of the shipped Grafana dashboards (dashboards/*.json: the same
SQL, so both views agree) and refreshes them every few seconds, plus a trajectory browser: a
task's group, one sample's transcript and its trace, through the saved queries of `crucible query`.
The server is the standard library's, on 127.0.0.1 unless told otherwise; it only ever runs the
SQL shipped with Crucible (panel SQL, saved queries with bound parameters), never SQL from a request.
It has no login: it answers only requests addressed to it by an IP address, localhost or the --host
it was given (a DNS-rebinding page names the attacker's host), and holds a bounded number of
connections, each for at most IDLE_TIMEOUT_S between reads.

    GET /                      the page
    GET /api/panels            [{id, title, type}]
    GET /api/panels/<id>       {columns, rows} of that panel's query
    GET /api/query/<name>?p=v  {columns, rows} of a saved query (crucible query NAME --p v)
"""
from __future__ import annotations

import datetime as dt
import decimal
import errno
import ipaddress
import json
import logging
import math
import socket
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from importlib import resources
from urllib.parse import parse_qs, urlparse

from crucible.shared.http_server import BoundedThreadingHTTPServer, RequestHandler, addressed_to_us
from crucible.shared.store import queries

log = logging.getLogger("crucible.dashboard")
STORE_DATASOURCE = "grafana-clickhouse-datasource"
IDLE_TIMEOUT_S = 10.0  # a connection silent this long (a half-sent request) is closed
MAX_CONNECTIONS = 32  # a browser opens 6 per host; connections past this are closed as they arrive
MIN_REFRESH_S = 0.5


class DashboardError(RuntimeError):
    """A flag the dashboard cannot serve with; the text names it (the CLI prints it on one line)."""


@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    type: str  # timeseries, barchart or table (Grafana's names)
    sql: str


def store_panels() -> list[Panel]:
    """Every panel of the shipped dashboards that reads the store, in dashboard order."""
    panels = []
    for source in sorted(resources.files("crucible.dashboards").iterdir(), key=lambda p: p.name):
        if not source.name.endswith(".json"):
            continue
        for panel in json.loads(source.read_text())["panels"]:
            sql = [t["rawSql"] for t in panel.get("targets", []) if t.get("datasource", {}).get("type") ==
                   STORE_DATASOURCE and t.get("rawSql")]
            if sql:
                panels.append(Panel(len(panels), panel["title"], panel["type"], sql[0]))
    return panels


def jsonable(value):
    """A store value as JSON can carry it: times as ISO text, maps as objects, NaN and inf as null."""
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


class Dashboard:
    """What the HTTP handler asks: panels and saved queries over one store client (one query at a time)."""

    def __init__(self, client, refresh_s: float = 5.0):
        self.client = client
        self.refresh_s = refresh_s
        self.panels = store_panels()
        self.lock = threading.Lock()

    def panel(self, panel_id: str) -> dict | None:
        """A panel's rows by its id as the URL spells it; None when no panel has it ('²' and '01' do not,
        though int() reads them)."""
        panel = next((p for p in self.panels if str(p.id) == panel_id), None)
        if panel is None:
            return None
        with self.lock:
            result = self.client.query(panel.sql)
        return {"columns": list(result.column_names), "rows": jsonable(list(result.result_rows))}

    def saved(self, name: str, params: dict[str, str]) -> dict:
        """A saved query's rows; a parameter it does not take is refused (queries.run)."""
        with self.lock:
            columns, rows = queries.run(self.client, name, **params)
        return {"columns": columns, "rows": jsonable(rows)}


def handler_for(dashboard: Dashboard, bound_host: str) -> type[BaseHTTPRequestHandler]:
    class Handler(RequestHandler):
        server_version = "crucible-dashboard"
        timeout = IDLE_TIMEOUT_S  # for each read and write of the connection (StreamRequestHandler sets it)

        def do_GET(self):  # noqa: N802 (the standard library's name)
            url = urlparse(self.path)
            parts = [p for p in url.path.split("/") if p]
            host = self.headers.get("Host")
            if not addressed_to_us(host, bound_host):
                return self._json(HTTPStatus.FORBIDDEN, {"error": f"Host {str(host)[:100]!r} is not this dashboard: "
                                                         "open it by its IP address or localhost"})
            try:
                if not parts:
                    return self._send(HTTPStatus.OK, PAGE.replace("__REFRESH_MS__", str(int(dashboard.refresh_s * 1000))),
                                      "text/html; charset=utf-8")
                if parts == ["api", "panels"]:
                    return self._json(HTTPStatus.OK, [{"id": p.id, "title": p.title, "type": p.type}
                                                      for p in dashboard.panels])
                if len(parts) == 3 and parts[:2] == ["api", "panels"]:
                    rows = dashboard.panel(parts[2])
                    if rows is None:
                        return self._json(HTTPStatus.NOT_FOUND, {"error": f"no panel {parts[2]!r}"})
                    return self._json(HTTPStatus.OK, rows)
                if len(parts) == 3 and parts[:2] == ["api", "query"]:
                    params = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
                    return self._json(HTTPStatus.OK, dashboard.saved(parts[2], params))
                return self._json(HTTPStatus.NOT_FOUND, {"error": f"nothing at {url.path}"})
            except queries.QueryError as exc:
                return self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            except Exception as exc:  # the store refused or is down: the page shows it and retries
                log.warning("%s: %s", url.path, exc)
                return self._json(HTTPStatus.BAD_GATEWAY, {"error": f"the store: {str(exc)[:300]}"})

        def _json(self, status: HTTPStatus, body) -> None:
            self._send(status, json.dumps(body, separators=(",", ":")), "application/json")

        def _send(self, status: HTTPStatus, text: str, content_type: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            log.debug(fmt, *args)

    return Handler


class Server(BoundedThreadingHTTPServer):
    """The dashboard's server: MAX_CONNECTIONS at most, a connection past that closed at once."""

    def __init__(self, address, handler):
        super().__init__(address, handler, MAX_CONNECTIONS)


def check_refresh(refresh_s: float) -> None:
    """DashboardError unless the page may poll every `refresh_s` seconds (NaN, 0 or less polled without pause)."""
    if not (math.isfinite(refresh_s) and refresh_s >= MIN_REFRESH_S):
        raise DashboardError(f"--refresh {refresh_s:g}: give the seconds between refreshes, at least {MIN_REFRESH_S:g}")


def serve(client, host: str = "127.0.0.1", port: int = 8050, refresh_s: float = 5.0) -> Server:
    """A started server (in a daemon thread); `.server_address` says where, `.shutdown()` stops it.
    Raises DashboardError naming the flag (--refresh, --host, --port) it cannot serve with."""
    check_refresh(refresh_s)
    dashboard = Dashboard(client, refresh_s)
    try:
        server = Server((host, port), handler_for(dashboard, host))
    except (OSError, OverflowError) as exc:  # no such address here; a port in use, privileged or past 65535
        on_host = isinstance(exc, socket.gaierror) or getattr(exc, "errno", None) == errno.EADDRNOTAVAIL
        flag = f"--host {host}" if on_host else f"--port {port}"
        raise DashboardError(f"{flag}: cannot listen there ({exc})") from None
    if not ipaddress.ip_address(server.server_address[0]).is_loopback:
        log.warning("crucible dashboard: listening on %s, beyond this machine, with no login: whoever reaches it "
                    "reads every stored prompt and completion", host)
    threading.Thread(target=server.serve_forever, name="dashboard", daemon=True).start()
    return server


PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Crucible run</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header{background:#1d2330;color:#fff;padding:10px 18px;display:flex;gap:18px;align-items:baseline}
header h1{font-size:18px;margin:0} #status{opacity:.8}
main{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:12px;padding:12px}
section{background:#fff;border-radius:6px;padding:10px 12px;box-shadow:0 1px 2px #0002;overflow:auto;max-height:420px}
section h2{font-size:14px;margin:0 0 6px} .empty,.error{color:#888} .error{color:#b00020}
table{border-collapse:collapse;font-size:12px;width:100%} td,th{border-bottom:1px solid #eee;padding:2px 6px;text-align:left;white-space:nowrap}
a{color:#1565c0;cursor:pointer} .legend span{margin-right:12px;font-size:12px} svg text{font-size:10px;fill:#555}
#browser{grid-column:1/-1;max-height:none} #browser input{width:380px} pre{white-space:pre-wrap;font-size:12px}
</style></head><body>
<header><h1>Crucible</h1><span id="status">loading...</span></header>
<main id="panels"></main>
<main><section id="browser" data-panel="browser"><h2>Trajectory browser</h2>
<form id="open-task"><input id="task-id" placeholder="task id (or click one in a table)"> <button>open</button></form>
<div id="group"></div><div id="episode"></div><div id="trace"></div></section></main>
<script>
const REFRESH_MS = __REFRESH_MS__;
const COLORS = ["#1565c0","#e65100","#2e7d32","#6a1b9a","#c62828","#00838f","#5d4037","#9e9d24"];
const $ = (s) => document.querySelector(s);
const esc = (v) => String(v ?? "").replace(/[&<>"]/g, c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;"}[c]));
async function get(url){ const r = await fetch(url); const body = await r.json(); if(!r.ok) throw new Error(body.error||r.status); return body; }

function table(data, limit=60){
  const cols = data.columns;
  const link = {task_id:"task", trajectory_id:"trajectory"};
  const rows = data.rows.slice(0, limit).map(r => "<tr>" + r.map((v, i) => {
    const kind = link[cols[i]];
    const text = typeof v === "object" && v !== null ? JSON.stringify(v) : v;
    return kind ? `<td><a data-open="${kind}" data-id="${esc(v)}">${esc(text)}</a></td>` : `<td>${esc(text)}</td>`;
  }).join("") + "</tr>").join("");
  return `<table><tr>${cols.map(c => `<th>${esc(c)}</th>`).join("")}</tr>${rows}</table>`;
}

function series(data){  // x = the first column; long format (x, name, value) is pivoted to one series per name
  const cols = data.columns, rows = data.rows;
  if (cols.length === 3 && rows.length && typeof rows[0][1] === "string"){
    const by = new Map();  // a series may be named anything stored: "__proto__" broke a plain object
    rows.forEach(([x, name, y]) => { if (!by.has(name)) by.set(name, []); by.get(name).push([x, y]); });
    return [...by.entries()];
  }
  return cols.slice(1).map((name, i) => [name, rows.map(r => [r[0], r[i + 1]])])
             .filter(([, pts]) => pts.some(([, y]) => typeof y === "number"));
}

function chart(data, bars){
  const all = series(data), W = 540, H = 220, L = 44, B = 22;
  const xs = [...new Set(data.rows.map(r => r[0]))];
  const numericX = xs.every(x => typeof x === "number");
  const ys = all.flatMap(([, pts]) => pts.map(p => p[1]).filter(y => typeof y === "number"));
  if (!ys.length) return '<p class="empty">no numbers yet</p>';
  let lo = Math.min(0, ...ys), hi = Math.max(...ys); if (hi === lo) hi = lo + 1;
  const xpos = x => numericX ? L + (xs.length > 1 ? (x - Math.min(...xs)) / ((Math.max(...xs) - Math.min(...xs)) || 1) : 0.5) * (W - L - 8)
                             : L + (xs.indexOf(x) + 0.5) / xs.length * (W - L - 8);
  const ypos = y => H - B - (y - lo) / (hi - lo) * (H - B - 8);
  let svg = `<svg width="${W}" height="${H}" role="img"><line x1="${L}" y1="${H-B}" x2="${W}" y2="${H-B}" stroke="#999"/>` +
            `<line x1="${L}" y1="4" x2="${L}" y2="${H-B}" stroke="#999"/><text x="2" y="12">${+hi.toPrecision(3)}</text>` +
            `<text x="2" y="${H-B}">${+lo.toPrecision(3)}</text><text x="${L}" y="${H-6}">${esc(xs[0])}</text>` +
            `<text x="${W-60}" y="${H-6}">${esc(xs[xs.length-1])}</text>`;
  all.forEach(([name, pts], k) => {
    const c = COLORS[k % COLORS.length], ok = pts.filter(([, y]) => typeof y === "number");
    if (bars){
      const w = Math.max(2, (W - L - 8) / xs.length / (all.length + 1));
      ok.forEach(([x, y]) => svg += `<rect class="bar" x="${xpos(x) - w * all.length / 2 + k * w}" y="${ypos(Math.max(y, 0))}" width="${w}" height="${Math.abs(ypos(y) - ypos(0))}" fill="${c}"><title>${esc(x)}: ${y}</title></rect>`);
    } else {
      const d = ok.map(([x, y], i) => `${i ? "L" : "M"}${xpos(x).toFixed(1)},${ypos(y).toFixed(1)}`).join("");
      svg += `<path class="series" d="${d}" fill="none" stroke="${c}" stroke-width="1.6"/>`;
      if (ok.length === 1) svg += `<circle cx="${xpos(ok[0][0])}" cy="${ypos(ok[0][1])}" r="3" fill="${c}"/>`;
    }
  });
  const legend = all.map(([name], k) => `<span style="color:${COLORS[k % COLORS.length]}">&#9632; ${esc(name)}</span>`).join("");
  return svg + `</svg><div class="legend">${legend}</div>`;
}

// What each panel shows now: a panel whose rows did not change is not drawn again, so a click, a
// selection or a hover in it outlives the refresh (a link redrawn between a click's press and release
// got no click at all).
const drawn = new Map();
async function refresh(panel){
  const el = document.getElementById("panel-" + panel.id);
  let html;
  try {
    const data = await get("/api/panels/" + panel.id);
    el.dataset.rows = data.rows.length;
    html = !data.rows.length ? '<p class="empty">no rows yet</p>'
      : panel.type === "table" ? table(data) : chart(data, panel.type === "barchart");
  } catch (e) { html = `<p class="error">${esc(e.message)}</p>`; }
  if (drawn.get(panel.id) !== html) { el.querySelector(".body").innerHTML = html; drawn.set(panel.id, html); }
}

async function openTask(id){
  $("#task-id").value = id; $("#episode").innerHTML = $("#trace").innerHTML = "";
  try { const g = await get("/api/query/task?task=" + encodeURIComponent(id));
        $("#group").innerHTML = `<h2>Task ${esc(id)}: ${g.rows.length} samples</h2>` + table(g, 200); }
  catch (e) { $("#group").innerHTML = `<p class="error">${esc(e.message)}</p>`; }
}
async function openTrajectory(id){
  for (const [name, el] of [["episode", "#episode"], ["trace", "#trace"]]){
    try { const d = await get(`/api/query/${name}?trajectory=` + encodeURIComponent(id));
          $(el).innerHTML = `<h2>${name === "episode" ? "Transcript" : "Trace"} of ${esc(id)}</h2>` +
                            (d.rows.length ? table(d, 500) : '<p class="empty">none stored (single-turn samples have no transcript)</p>'); }
    catch (e) { $(el).innerHTML = `<p class="error">${esc(e.message)}</p>`; }
  }
}
document.addEventListener("click", ev => {
  const a = ev.target.closest("a[data-open]"); if (!a) return;
  a.dataset.open === "task" ? openTask(a.dataset.id) : openTrajectory(a.dataset.id);
  $("#browser").scrollIntoView();
});
$("#open-task").addEventListener("submit", ev => { ev.preventDefault(); openTask($("#task-id").value.trim()); });

(async () => {
  let panels;
  try { panels = await get("/api/panels"); } catch (e) { $("#status").textContent = e.message; return; }
  $("#panels").innerHTML = panels.map(p => `<section id="panel-${p.id}" data-panel="${esc(p.title)}" data-type="${p.type}"><h2>${esc(p.title)}</h2><div class="body"><p class="empty">loading...</p></div></section>`).join("");
  const tick = async () => { await Promise.all(panels.map(refresh)); $("#status").textContent = "updated " + new Date().toLocaleTimeString(); };
  await tick(); document.body.dataset.ready = "1"; setInterval(tick, REFRESH_MS);
})();
</script></body></html>
"""
