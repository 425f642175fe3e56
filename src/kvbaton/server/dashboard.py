"""The live dashboard the router serves: `GET /dashboard`, one HTML page with its script inline (no build
step), polling `GET /dashboard/data` every second for the JSON `dashboard_data` builds.

The page holds no cluster data, so it is open; the data is an admin route (`auth.ADMIN_PATHS`). With API
keys, the page takes an admin key from its URL fragment (`/dashboard#key=...`, which no request carries
to a server or a log), keeps it in the tab's sessionStorage and sends it as a bearer token.

Per worker: role and the pool it serves now (a worker lent to mixed duty shows it), its parallelism (TP x PP
rank processes), running and waiting
requests, KV use (vLLM's: blocks only the prefix cache holds count as free), the prefix cache's hit ratio in
tokens, its device blocks cached and the blocks it loaded from the KV store, KV transfers in flight, speculative drafts
accepted of proposed; for the router: recent request rate, TTFT and ITL percentiles, refusals.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvbaton.server.metrics import kv_cache_usage
from kvbaton.server.recent import RecentSummary

REFRESH_S = 1.0


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def worker_row(worker: Mapping[str, object], lent: Mapping[str, object]) -> dict[str, object]:
    worker_id = str(worker.get("worker_id", ""))
    queries = _int(worker.get("prefix_cache_queries_tokens"))
    transfers = worker.get("transfers") if isinstance(worker.get("transfers"), Mapping) else {}
    spec = worker.get("spec_decode") if isinstance(worker.get("spec_decode"), Mapping) else {}
    store = worker.get("kv_store") if isinstance(worker.get("kv_store"), Mapping) else {}
    return {
        "worker_id": worker_id, "role": worker.get("role", ""),
        "pool": "mixed" if worker_id in lent else worker.get("role", ""),
        "tensor_parallel_size": _int(worker.get("tensor_parallel_size", 1)),
        "pipeline_parallel_size": _int(worker.get("pipeline_parallel_size", 1)),
        "num_running": _int(worker.get("num_running")), "num_waiting": _int(worker.get("num_waiting")),
        "kv_cache_usage": round(kv_cache_usage(worker), 4), "num_blocks": _int(worker.get("num_blocks")),
        "prefix_hit_ratio": round(_int(worker.get("prefix_cache_hits_tokens")) / queries, 4) if queries else None,
        "num_device_cached_blocks": _int(worker.get("num_cached_blocks")),
        "num_store_loaded_blocks": _int(store.get("num_loaded_blocks")),  # type: ignore[union-attr]
        "num_transfers_in_flight": _int(transfers.get("num_live")),  # type: ignore[union-attr]
        "num_draft_tokens": _int(spec.get("num_draft_tokens")),  # type: ignore[union-attr]
        "num_accepted_tokens": _int(spec.get("num_accepted_tokens")),  # type: ignore[union-attr]
        "num_preemptions": _int(worker.get("num_preemptions")),
        "last_heartbeat_age_s": worker.get("last_heartbeat_age_s"),
    }


def dashboard_data(info: Mapping[str, object], recent: RecentSummary, model_name: str) -> dict[str, object]:
    """The page's JSON: the cluster's workers (from `cluster_info()`) and the router's recent traffic."""
    lent = info.get("lent_workers") if isinstance(info.get("lent_workers"), Mapping) else {}
    workers = [w for w in info.get("workers", []) or [] if isinstance(w, Mapping)]  # type: ignore[union-attr]
    return {
        "model": model_name, "policy": info.get("policy", ""), "refresh_s": REFRESH_S,
        "workers": [worker_row(w, lent) for w in workers],  # type: ignore[arg-type]
        "lost_workers": info.get("lost_workers", {}), "num_in_flight": _int(info.get("num_in_flight")),
        "num_rejected": _int(info.get("num_rejected")), "pool_switches": _int(info.get("pool_switches")),
        "recent": {"window_s": recent.window_s, "num_finished": recent.num_finished,
                   "requests_per_s": round(recent.requests_per_s, 3), "ttft_s": recent.ttft_s,
                   "itl_s": recent.itl_s, "refusals": recent.refusals},
    }


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvbaton</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .3em; } .muted { color: #777; }
.cards { display: flex; gap: 1em; flex-wrap: wrap; margin: 1em 0; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: .6em 1em; min-width: 9em; }
.card b { display: block; font-size: 1.4em; }
table { border-collapse: collapse; width: 100%; } th, td { padding: .35em .6em; border-bottom: 1px solid #eee;
  text-align: right; } th:nth-child(-n+3), td.text { text-align: left; }
th { background: #f6f6f6; } .bar { background: #e8eef8; position: relative; min-width: 5em; }
.bar span { position: absolute; left: 0; top: 0; bottom: 0; background: #8fb0e8; }
.bar em { position: relative; font-style: normal; } #status.error { color: #b00; }
</style></head>
<body>
<h1>kvbaton <span id="model" class="muted"></span></h1>
<div id="status" class="muted">connecting...</div>
<div class="cards">
  <div class="card">requests/s<b id="rate">-</b></div>
  <div class="card">TTFT p50 / p90 / p99<b id="ttft">-</b></div>
  <div class="card">ITL p50 / p90 / p99<b id="itl">-</b></div>
  <div class="card">in flight<b id="inflight">-</b></div>
  <div class="card">rejections<b id="rejections">-</b></div>
</div>
<table id="workers"><thead><tr><th>worker</th><th>role</th><th>pool</th><th>TP x PP</th><th>running</th>
<th>waiting</th>
<th>KV use</th><th>hit ratio</th><th>blocks (device cached / store loaded)</th><th>transfers in flight</th>
<th>drafts accepted</th><th>preemptions</th></tr></thead><tbody></tbody></table>
<p id="lost" class="muted"></p>
<script>
"use strict";
const fromHash = new URLSearchParams(location.hash.slice(1)).get("key");
if (fromHash) { sessionStorage.setItem("kvbaton-key", fromHash); history.replaceState(null, "", location.pathname); }
const key = sessionStorage.getItem("kvbaton-key");
const $ = (id) => document.getElementById(id);
const ms = (s) => s === null || s === undefined ? "-" : (s * 1000).toFixed(s < 0.1 ? 1 : 0) + " ms";
const pct = (x) => x === null || x === undefined ? "-" : (x * 100).toFixed(1) + " %";
function cell(row, text, cls) {
  const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td;
}
function bar(row, fraction) {
  const td = cell(row, "", "bar"); const fill = document.createElement("span");
  fill.style.width = Math.min(100, fraction * 100) + "%"; const label = document.createElement("em");
  label.textContent = pct(fraction); td.append(fill, label);
}
function render(data) {
  $("model").textContent = data.model + " - " + data.policy;
  const r = data.recent;
  $("rate").textContent = r.requests_per_s.toFixed(2);
  $("ttft").textContent = [r.ttft_s.p50, r.ttft_s.p90, r.ttft_s.p99].map(ms).join(" / ");
  $("itl").textContent = [r.itl_s.p50, r.itl_s.p90, r.itl_s.p99].map(ms).join(" / ");
  $("inflight").textContent = data.num_in_flight;
  const refused = Object.entries(r.refusals).map(([why, n]) => why + " " + n).join(", ");
  const lately = refused ? " (last " + r.window_s / 60 + " min: " + refused + ")" : "";
  $("rejections").textContent = data.num_rejected + lately;
  const body = $("workers").tBodies[0]; body.replaceChildren();
  for (const w of data.workers) {
    const row = body.insertRow(); row.dataset.workerId = w.worker_id;
    cell(row, w.worker_id, "text"); cell(row, w.role, "text"); cell(row, w.pool, "text");
    cell(row, w.tensor_parallel_size + " x " + w.pipeline_parallel_size);
    cell(row, w.num_running); cell(row, w.num_waiting); bar(row, w.kv_cache_usage);
    cell(row, pct(w.prefix_hit_ratio)); cell(row, w.num_device_cached_blocks + " / " + w.num_store_loaded_blocks);
    cell(row, w.num_transfers_in_flight);
    cell(row, w.num_accepted_tokens + " / " + w.num_draft_tokens); cell(row, w.num_preemptions);
  }
  const lost = Object.keys(data.lost_workers || {});
  $("lost").textContent = lost.length ? "lost: " + lost.join(", ") : "";
}
async function poll() {
  try {
    const answer = await fetch("/dashboard/data", { headers: key ? { Authorization: "Bearer " + key } : {} });
    if (!answer.ok) {
      const why = answer.status === 401 || answer.status === 403 ? " (open /dashboard#key=ADMIN_KEY)" : "";
      throw new Error("HTTP " + answer.status + why);
    }
    render(await answer.json());
    $("status").className = "muted"; $("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    $("status").className = "error"; $("status").textContent = String(error.message || error);
  }
  setTimeout(poll, REFRESH_MS);
}
const REFRESH_MS = __REFRESH_MS__;
poll();
</script>
</body></html>
""".replace("__REFRESH_MS__", str(int(REFRESH_S * 1000)))
