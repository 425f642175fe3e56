"""How a `Plan` is shown: the JSON object, the text plan and candidates table, and the goodput-vs-rate plot.

`plan_json` is the stable machine-readable form (`kvbaton plan --json`):
  {"best": {"prefill": {"tp", "pp", "replicas"}, "decode": {...}, "per_gpu_goodput_rps", ...},
   "candidates": [...], ...}
with `"colocated": {...}` in place of the two pools when a colocated unit wins. `best` is the
deployment unit that is replicated; with a target rate it also says how many units it takes.
It holds no timing: the same inputs give the same bytes, whatever the number of processes
(the search's wall time is in the text and in `--out`'s report.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbaton.plan.planner import Candidate, Plan
from kvbaton.plan.serve_layout import serve_command


def candidate_json(c: Candidate) -> dict[str, Any]:
    r = c.result
    return {
        **c.placement.to_json(), "algorithm": c.placement.algorithm, "num_gpus": c.placement.num_gpus,
        "cluster": c.placement.cluster_spec, "per_gpu_goodput_rps": r.per_gpu_rps,
        "goodput_rps": float(f"{r.per_gpu_rps * c.placement.num_gpus:.12g}"), "pruned": r.pruned, "capped": r.capped,
        "num_probes": len(r.probes), "bound_per_gpu_rps": round(c.bound_per_gpu_rps, 4),
    }


def plan_json(plan: Plan, rate_rps: float | None = None) -> dict[str, Any]:
    best = candidate_json(plan.best)
    if rate_rps is not None:
        best["target_rate_rps"] = rate_rps
        best["units"] = plan.units_for(rate_rps)
        best["total_gpus"] = best["units"] * plan.best.placement.num_gpus
    req = plan.request
    s = req.settings
    return {
        "best": best,
        "best_disaggregated": candidate_json(plan.best_disaggregated) if plan.best_disaggregated else None,
        "best_colocated": candidate_json(plan.best_colocated) if plan.best_colocated else None,
        "candidates": [candidate_json(c) for c in plan.candidates],
        "settings": {
            "model": req.model, "gpu": req.gpu, "num_gpus": req.num_gpus, "gpus_per_node": req.gpus_per_node,
            "affinity": req.affinity, "cost_model": req.cost_model, "workload": req.workload,
            "workload_params": {k: v for k, v in req.workload_params}, "num_requests": plan.num_requests,
            "mean_prompt_tokens": round(plan.workload_means[0], 1),
            "mean_output_tokens": round(plan.workload_means[1], 1),
            "ttft_slo_s": s.slo.ttft_s, "tpot_slo_s": s.slo.tpot_s, "attainment": s.attainment, "joint": s.joint,
            "rate_step_rps": s.step_rps, "first_ceiling_rps": s.ceiling_rps, "max_per_gpu_rps": s.max_per_gpu_rps,
            "seed": req.seed,
        },
    }


def _goodput_cell(c: Candidate) -> str:
    r = c.result
    if r.pruned:  # the tightest bound it knows: the lowest rate it failed
        failed = [p.per_gpu_rps for p in r.probes if not p.met]
        return f"< {min(failed):.2f}" if failed else "pruned"
    return f">= {r.per_gpu_rps:.2f}" if r.capped else f"{r.per_gpu_rps:.2f}"


def candidates_table(plan: Plan) -> str:
    rows = sorted(plan.candidates, key=lambda c: (c.result.pruned, -c.result.per_gpu_rps, c.placement.num_gpus))
    lines = [f"{'placement':<36} {'GPUs':>4} {'goodput/GPU':>11} {'unit req/s':>10} {'probes':>6}  algorithm",
             "-" * 84]
    for c in rows:
        unit = "-" if c.result.pruned else f"{c.result.per_gpu_rps * c.placement.num_gpus:.2f}"
        lines.append(f"{c.placement.label:<36} {c.placement.num_gpus:>4} {_goodput_cell(c):>11} {unit:>10} "
                     f"{len(c.result.probes):>6}  {c.placement.algorithm}")
    return "\n".join(lines)


def plan_text(plan: Plan, rate_rps: float | None = None) -> str:
    req, best = plan.request, plan.best
    p = best.placement
    s = req.settings
    head = (f"kvbaton plan: {req.model} on {req.num_gpus} x {req.gpu} ({req.gpus_per_node} per node), "
            f"TTFT {s.slo.ttft_s:g} s / TPOT {s.slo.tpot_s:g} s at {100 * s.attainment:g} % "
            f"({'jointly' if s.joint else 'each'}), {req.workload} "
            f"(mean prompt {plan.workload_means[0]:.0f}, output {plan.workload_means[1]:.0f} tokens)")
    if p.disaggregated:
        assert p.prefill is not None and p.decode is not None
        unit = (f"prefill pool: {p.prefill.replicas} x (tp {p.prefill.tp}, pp {p.prefill.pp}); "
                f"decode pool: {p.decode.replicas} x (tp {p.decode.tp}, pp {p.decode.pp}); KV over {p.link}")
    else:
        assert p.colocated is not None
        unit = (f"colocated: {p.colocated.replicas} x (tp {p.colocated.tp}, pp {p.colocated.pp}), chunked prefill "
                f"{req.colocated_chunk_tokens} tokens")
    lines = [head, f"best unit ({p.num_gpus} GPUs): {unit}",
             f"  per-GPU goodput {best.result.per_gpu_rps:.2f} req/s, unit goodput "
             f"{best.result.per_gpu_rps * p.num_gpus:.2f} req/s"]
    if best.result.per_gpu_rps <= 0:
        lines.append(f"  no placement meets the SLOs at any searched rate (the lowest: {s.step_rps:g} req/s per GPU)")
    for name, other in (("best disaggregated", plan.best_disaggregated), ("best colocated", plan.best_colocated)):
        if other is not None and other is not best:
            lines.append(f"  {name}: {other.placement.label}, {other.result.per_gpu_rps:.2f} req/s per GPU")
    if rate_rps is not None:
        units = plan.units_for(rate_rps)
        lines.append(f"  for {rate_rps:g} req/s: {units} unit(s) = {units * p.num_gpus} GPUs")
    lines.append(f"  launch here: {serve_command(plan_json(plan, rate_rps))}")
    lines += [f"searched {len(plan.candidates)} placements in {plan.search_s:.1f} s", "", candidates_table(plan)]
    return "\n".join(lines)


def plot_goodput(path: str | Path, curves: Sequence[tuple[str, Sequence[tuple[float, float, float]]]],
                 attainment: float) -> None:
    """Per-GPU goodput and SLO attainment against the per-GPU offered rate, one line per placement.

    `curves`: (label, [(per-GPU rate, per-GPU goodput, attainment), ...]).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_goodput, ax_attain) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in curves:
        xs = [x for x, _, _ in points]
        ax_goodput.plot(xs, [g for _, g, _ in points], marker="o", label=label)
        ax_attain.plot(xs, [a for _, _, a in points], marker="o", label=label)
    ax_goodput.set(xlabel="offered rate per GPU (req/s)", ylabel="goodput per GPU (req/s meeting both SLOs)",
                   title="goodput vs rate")
    ax_attain.axhline(attainment, color="grey", linestyle="--", linewidth=1)
    ax_attain.set(xlabel="offered rate per GPU (req/s)", ylabel="SLO attainment (both)", ylim=(0, 1.02),
                  title="attainment vs rate")
    ax_goodput.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
